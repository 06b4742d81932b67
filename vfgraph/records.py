"""Typed records of what the passes did to a model.

A pass that rewrites a signature publishes a record of it, which later passes, the runtime
and the command line read: the virtual-node layout of a training step, the all-reduce
inserted into it, the micro-batching of a serving function. The records are kept where they
always were, as plain JSON in ``item.metadata["rewrites"][PASS][signature key]``, which
:func:`vfgraph.save` writes to ``assets.extra/vfgraph.json``; this module gives them a type,
so a reader names the record it wants (``records.get(item, VirtualNodes)``) instead of
spelling pass names and keys. ``to_json()`` gives exactly the dict a record is stored as;
``from_json()`` also reads the records older versions wrote (keys they did not write get
defaults).
"""
from __future__ import annotations

import json
import os
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any, ClassVar, Dict, Mapping, MutableMapping, Optional, Tuple, Type, TypeVar, Union

from vfgraph.errors import InputError

if TYPE_CHECKING:
    from vfgraph.item import GraphItem

REWRITES = "rewrites"  # the metadata key the records are stored under
METADATA_FILE = os.path.join("assets.extra", "vfgraph.json")  # where a model directory keeps its metadata


@dataclass(frozen=True)
class Gradient:
    """One tensor at the cut of a training step that the virtual-node loop sums: a variable's
    gradient, a statistic, or the row indices of a sparse gradient."""

    tensor: str                # the tensor in the original training function
    variable: Optional[str]    # the variable it updates, if any
    role: str                  # "gradient" | "statistic" | "indices"
    shape: Optional[Tuple[int, ...]]

    def to_json(self) -> dict:
        return {"tensor": self.tensor, "variable": self.variable, "role": self.role,
                "shape": None if self.shape is None else list(self.shape)}

    @classmethod
    def from_json(cls, d: Mapping[str, Any]) -> "Gradient":
        shape = d.get("shape")
        return cls(d["tensor"], d.get("variable"), d.get("role", "gradient"),
                   None if shape is None else tuple(shape))


@dataclass(frozen=True)
class RandomOp:
    """A random op of a step's per-virtual-node part: ``keyed`` says how its draws are fixed
    by (seed, step, global virtual node index) ("seed variable", "generator", "fixed seed"),
    or is empty when they cannot be, ``reason`` saying why."""

    node: str
    op: str
    keyed: str
    reason: str = ""

    def to_json(self) -> dict:
        d = {"node": self.node, "op": self.op, "keyed": self.keyed}
        if self.reason:
            d["reason"] = self.reason
        return d

    @classmethod
    def from_json(cls, d: Mapping[str, Any]) -> "RandomOp":
        return cls(d["node"], d["op"], d.get("keyed", ""), d.get("reason", ""))


@dataclass(frozen=True)
class MemoryBudget:
    """How a memory budget chose the virtual-node batch b: the step's peak memory measured at
    ``batches`` (``peaks``, bytes, on ``device``, where ``measured_on`` says), the fit memory =
    ``fixed`` + ``per_example`` x b through them (least squares), the ``budget`` (bytes) and
    the ``margin`` kept free of it, and the ``chosen`` b: the largest whose fitted memory is
    within budget x (1 - margin). The peaks are of the step as split-vnodes runs it (the
    virtual-node loop, its sums). ``source``: "measured" (here, at the rewrite) or "profile"
    (read from a profile's file)."""

    budget: int
    margin: float
    fixed: int
    per_example: int
    chosen: int
    batches: Tuple[int, ...]
    peaks: Tuple[int, ...]
    device: str = "CPU"
    source: str = "measured"
    measured_on: Tuple[Tuple[str, str], ...] = ()

    def to_json(self) -> dict:
        return {"budget": self.budget, "margin": self.margin, "fixed": self.fixed, "per_example": self.per_example,
                "chosen": self.chosen, "batches": list(self.batches), "peaks": list(self.peaks),
                "device": self.device, "source": self.source, "measured_on": dict(self.measured_on)}

    @classmethod
    def from_json(cls, d: Mapping[str, Any]) -> "MemoryBudget":
        return cls(int(d["budget"]), float(d["margin"]), int(d["fixed"]), int(d["per_example"]), int(d["chosen"]),
                   tuple(d.get("batches", ())), tuple(d.get("peaks", ())), d.get("device", "CPU"),
                   d.get("source", "measured"), tuple(sorted(d.get("measured_on", {}).items())))


@dataclass(frozen=True)
class VirtualNodes:
    """split-vnodes: training signature ``function`` runs ``vnodes`` virtual nodes of
    ``vnode_batch`` examples each (0: the fed batch / V) in a loop over
    ``vnode_function``, sums their gradients through ``reduce_functions`` and runs
    ``update_function`` once. ``stepwise``: the step-wise signatures were added;
    ``per_vnode_seeds``: the seed reads offset per virtual node; ``deterministic``:
    floating-point sums are exact (fixed point), the same for any layout of the virtual nodes
    over ranks; ``random_ops``: the random ops of the virtual-node function and how each is
    keyed; ``index_function``: the function giving the global index of a process's first
    virtual node (called when random ops are keyed); ``accumulate_signature``
    and ``apply_signature``: the keys of the step-wise signatures ("" when not added; a record
    written before they were recorded gets them from ``stepwise`` and its signature key).
    ``memory``: how a memory budget chose ``vnode_batch`` (None without a budget).
    A reduce function's arguments are named ``SUMMED`` + k (summed over processes) or
    ``GATHERED`` + k (rows concatenated), which insert-allreduce reads."""

    PASS: ClassVar[str] = "split-vnodes"
    SUMMED: ClassVar[str] = "sum_"
    GATHERED: ClassVar[str] = "gather_"
    function: str
    vnodes: int = 1
    vnode_batch: int = 0
    vnode_function: str = ""
    update_function: str = ""
    per_vnode_seeds: Tuple[str, ...] = ()
    stepwise: bool = False
    reduce_functions: Tuple[str, ...] = ()
    gradients: Tuple[Gradient, ...] = ()
    deterministic: bool = False
    random_ops: Tuple[RandomOp, ...] = ()
    index_function: str = ""
    accumulate_signature: str = ""
    apply_signature: str = ""
    memory: Optional[MemoryBudget] = None

    @staticmethod
    def stepwise_signatures(key: str) -> Tuple[str, str]:
        """The keys split-vnodes gives the step-wise signatures of training signature ``key``:
        (accumulate, apply)."""
        return f"{key}_accumulate", f"{key}_apply"

    def to_json(self) -> dict:
        d = {"function": self.function, "vnodes": self.vnodes, "vnode_batch": self.vnode_batch,
             "vnode_function": self.vnode_function, "update_function": self.update_function,
             "per_vnode_seeds": list(self.per_vnode_seeds), "stepwise": self.stepwise,
             "reduce_functions": list(self.reduce_functions), "gradients": [g.to_json() for g in self.gradients]}
        if self.deterministic:
            d["deterministic"] = True
        if self.random_ops:
            d["random_ops"] = [r.to_json() for r in self.random_ops]
        if self.index_function:
            d["index_function"] = self.index_function
        if self.accumulate_signature:
            d["accumulate_signature"] = self.accumulate_signature
            d["apply_signature"] = self.apply_signature
        if self.memory is not None:
            d["memory"] = self.memory.to_json()
        return d

    @classmethod
    def from_json(cls, d: Mapping[str, Any], key: str = "") -> "VirtualNodes":
        """The record as stored for signature ``key``; a step-wise record written before the
        signatures' keys were recorded gets them from ``key``."""
        stepwise = d.get("stepwise", False)
        named = (d.get("accumulate_signature", ""), d.get("apply_signature", ""))
        if stepwise and not named[0] and key:
            named = cls.stepwise_signatures(key)
        return cls(d["function"], d.get("vnodes", 1), d.get("vnode_batch", 0), d.get("vnode_function", ""),
                   d.get("update_function", ""), tuple(d.get("per_vnode_seeds", ())), stepwise,
                   tuple(d.get("reduce_functions", ())), tuple(Gradient.from_json(g) for g in d.get("gradients", ())),
                   bool(d.get("deterministic", False)),
                   tuple(RandomOp.from_json(r) for r in d.get("random_ops", ())), d.get("index_function", ""),
                   *named, MemoryBudget.from_json(d["memory"]) if d.get("memory") else None)


@dataclass(frozen=True)
class Allreduce:
    """insert-allreduce: the reduce functions of a training signature sum over MPI ranks in
    ``buffers`` (per reduce function, the argument names of each fused buffer, then one per
    gathered sparse tensor) of at most ``fusion_mb`` MiB; ``broadcast_signature`` (None when
    not added) starts the ranks from the same variables and checks every rank loaded the
    graph with ``fingerprint``."""

    PASS: ClassVar[str] = "insert-allreduce"
    fusion_mb: float
    buffers: Tuple[Tuple[Tuple[str, ...], ...], ...] = ()
    fingerprint: str = ""
    broadcast_signature: Optional[str] = None

    @staticmethod
    def broadcast_name(key: str) -> str:
        """The key insert-allreduce gives the broadcast signature of training signature ``key``."""
        return f"{key}_broadcast"

    def to_json(self) -> dict:
        return {"fusion_mb": self.fusion_mb, "buffers": [[list(b) for b in groups] for groups in self.buffers],
                "fingerprint": self.fingerprint, "broadcast_signature": self.broadcast_signature}

    @classmethod
    def from_json(cls, d: Mapping[str, Any], key: str = "") -> "Allreduce":
        buffers = tuple(tuple(tuple(b) for b in groups) for groups in d.get("buffers", ()))
        return cls(d["fusion_mb"], buffers, d.get("fingerprint", ""), d.get("broadcast_signature"))


@dataclass(frozen=True)
class Microbatch:
    """microbatch-inference: serving function ``function`` runs requests in slices of at most
    ``vnode_batch`` examples, a ``While`` in ``loop_function`` over ``body_function``, on
    TensorFlow's ``executor`` ("default", or the single-threaded executor's name)."""

    PASS: ClassVar[str] = "microbatch-inference"
    function: str
    vnode_batch: int
    loop_function: str = ""
    body_function: str = ""
    executor: str = "default"  # records written before the single-threaded loop have none

    def to_json(self) -> dict:
        return {"function": self.function, "loop_function": self.loop_function, "body_function": self.body_function,
                "vnode_batch": self.vnode_batch, "executor": self.executor}

    @classmethod
    def from_json(cls, d: Mapping[str, Any], key: str = "") -> "Microbatch":
        return cls(d["function"], d["vnode_batch"], d.get("loop_function", ""), d.get("body_function", ""),
                   d.get("executor", "default"))


@dataclass(frozen=True)
class StagePart:
    """One pipeline stage of a partitioned training step: its device ("" when the stages are
    MPI ranks), the variables it holds (parameters, then optimizer state) and their bytes,
    its estimated cost."""

    device: str
    variables: Tuple[str, ...] = ()
    parameter_bytes: int = 0
    optimizer_state: Tuple[str, ...] = ()
    optimizer_state_bytes: int = 0
    flops: int = 0       # estimated per example, forward and backward
    ops: int = 0         # ops placed on it

    def to_json(self) -> dict:
        return {"device": self.device, "variables": list(self.variables), "parameter_bytes": self.parameter_bytes,
                "optimizer_state": list(self.optimizer_state), "optimizer_state_bytes": self.optimizer_state_bytes,
                "flops": self.flops, "ops": self.ops}

    @classmethod
    def from_json(cls, d: Mapping[str, Any]) -> "StagePart":
        return cls(d["device"], tuple(d.get("variables", ())), d.get("parameter_bytes", 0),
                   tuple(d.get("optimizer_state", ())), d.get("optimizer_state_bytes", 0), d.get("flops", 0),
                   d.get("ops", 0))


@dataclass(frozen=True)
class Stages:
    """partition-stages: training function ``function`` is cut into ``len(parts)`` pipeline
    stages, stage k's ops and variables placed on ``parts[k].device``; ``schedule`` ("gpipe"
    or "1f1b") bounds how many virtual nodes are in flight at once; ``cut_bytes`` are the
    activation bytes per example crossing each cut; ``shared`` the variables several stages
    read, ``replicated`` those no stage owns (step counters, learning rates). On MPI ranks
    (no devices), ``signatures`` are the training signatures of stages 1..K (rank r runs
    stage r mod K + 1 of replica r // K), ``reduce_functions`` the reduce functions they call
    (summed over a stage's replicas): split-vnodes fills both in (``AMENDED_BY``). ``MARK``:
    the node attribute holding an op's stage (from 0) when the stages are MPI ranks."""

    PASS: ClassVar[str] = "partition-stages"
    AMENDED_BY: ClassVar[Tuple[str, ...]] = ("split-vnodes",)
    MARK: ClassVar[str] = "_vf_stage"
    function: str
    parts: Tuple[StagePart, ...]
    schedule: str = "1f1b"
    split_at: Tuple[str, ...] = ()   # the first forward op of stages 2..K
    cut_bytes: Tuple[int, ...] = ()
    shared: Tuple[str, ...] = ()
    replicated: Tuple[str, ...] = ()
    signatures: Tuple[str, ...] = ()
    reduce_functions: Tuple[str, ...] = ()

    @property
    def count(self) -> int:
        return len(self.parts)

    @staticmethod
    def signature_name(key: str, stage: int) -> str:
        """The key split-vnodes gives the training signature of stage ``stage`` (from 0) of
        training signature ``key`` when the stages are MPI ranks (read it from ``signatures``)."""
        return f"{key}_stage_{stage + 1}"

    @classmethod
    def stage_of(cls, node: Any) -> Optional[int]:
        """The stage (from 0) partition-stages marked NodeDef ``node`` with for MPI ranks, None
        when it marked none."""
        return node.attr[cls.MARK].i if cls.MARK in node.attr else None

    @property
    def on_ranks(self) -> bool:
        """Whether the stages are MPI ranks rather than devices of one process."""
        return not any(p.device for p in self.parts)

    def in_flight(self, vnodes: int) -> int:
        """Virtual nodes a loop of ``vnodes`` runs at once: all of them (GPipe), or one per
        stage (1F1B: at most K virtual nodes' activations alive)."""
        if self.count < 2:
            return 1
        return max(vnodes, self.count) if self.schedule == "gpipe" else self.count

    def to_json(self) -> dict:
        return {"function": self.function, "parts": [p.to_json() for p in self.parts], "schedule": self.schedule,
                "split_at": list(self.split_at), "cut_bytes": list(self.cut_bytes), "shared": list(self.shared),
                "replicated": list(self.replicated), "signatures": list(self.signatures),
                "reduce_functions": list(self.reduce_functions)}

    @classmethod
    def from_json(cls, d: Mapping[str, Any], key: str = "") -> "Stages":
        return cls(d["function"], tuple(StagePart.from_json(p) for p in d.get("parts", ())), d.get("schedule", "1f1b"),
                   tuple(d.get("split_at", ())), tuple(d.get("cut_bytes", ())), tuple(d.get("shared", ())),
                   tuple(d.get("replicated", ())), tuple(d.get("signatures", ())),
                   tuple(d.get("reduce_functions", ())))


Record = Union[VirtualNodes, Allreduce, Microbatch, Stages]
R = TypeVar("R", VirtualNodes, Allreduce, Microbatch, Stages)
KINDS: Tuple[Type, ...] = (VirtualNodes, Allreduce, Microbatch, Stages)


def kind_of(pass_name: str) -> Optional[Type]:
    """The record type stored under ``pass_name`` in the metadata (None: no record type is)."""
    return next((k for k in KINDS if k.PASS == pass_name), None)


def amended_by(pass_name: str) -> Tuple[Type, ...]:
    """The record types another pass produces that pass ``pass_name`` may fill in (their
    ``AMENDED_BY``)."""
    return tuple(k for k in KINDS if pass_name in getattr(k, "AMENDED_BY", ()))


def _metadata(source: Union["GraphItem", Mapping[str, Any], None]) -> Mapping[str, Any]:
    if source is None:
        return {}
    return source if isinstance(source, Mapping) else source.metadata


def rewrites(source: Union["GraphItem", Mapping[str, Any], None]) -> Mapping[str, Any]:
    """Every pass's records as stored (pass name -> signature key -> JSON), for a report that
    shows them whole; empty for a model no pass rewrote."""
    return _metadata(source).get(REWRITES, {})


def get(source: Union["GraphItem", Mapping[str, Any], None], kind: Type[R]) -> Dict[str, R]:
    """The records of type ``kind`` in an item or its metadata: signature key -> record
    (empty when that pass rewrote no signature). Each is read by ``kind.from_json(stored,
    key)``: a record may derive what older versions did not store from its signature key."""
    return {key: kind.from_json(d, key) for key, d in rewrites(source).get(kind.PASS, {}).items()}


def put(target: Union["GraphItem", MutableMapping[str, Any]], key: str, record: Record) -> None:
    """Store ``record`` for signature ``key`` in an item's metadata (or in a metadata dict)."""
    meta = target if isinstance(target, MutableMapping) else target.metadata
    meta.setdefault(REWRITES, {}).setdefault(record.PASS, {})[key] = record.to_json()


def read(path: str, kind: Type[R]) -> Dict[str, R]:
    """The records of type ``kind`` of the SavedModel directory ``path`` (from its
    ``assets.extra/vfgraph.json``; empty when vfgraph did not write it)."""
    return get(read_metadata(path) or {}, kind)


def read_metadata(path: str) -> Optional[dict]:
    """The metadata vfgraph wrote beside the model directory ``path``
    (``assets.extra/vfgraph.json``: the records, the history, the training state), None
    when there is none."""
    p = os.path.join(path, METADATA_FILE)
    if not os.path.isfile(p):
        return None
    try:
        with open(p) as f:
            return json.load(f)
    except (OSError, ValueError) as e:
        raise InputError(f"{p}: vfgraph's record cannot be read ({e}); restore the model directory from where it "
                         "came") from None
