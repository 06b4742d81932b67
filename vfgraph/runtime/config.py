"""A training run's configuration: its options (:class:`TrainConfig`), each checked here, and
what the rewrite's records say about the model it trains (:class:`ModelPlan`)."""
from __future__ import annotations

import math
import os
from dataclasses import dataclass
from typing import Callable, Dict, List, Optional, Tuple, Union

from vfgraph import records
from vfgraph.errors import InputError
from vfgraph.io import savedmodel, serving
from vfgraph.records import Allreduce, VirtualNodes
from vfgraph.runtime import elastic as el
from vfgraph.runtime.data import TrainData
from vfgraph.runtime.devices import stages_of
from vfgraph.runtime.elastic import ElasticOptions
from vfgraph.runtime.preprocess import InputFn
from vfgraph.runtime.sources import data_files


@dataclass
class TrainConfig:
    """The options of a training run, as :func:`vfgraph.runtime.train.train` takes them (which
    says what each does); :meth:`check` checks them."""

    model: str
    data_path: str
    steps: int
    batch_size: int
    out: str
    resume: bool = False
    force: bool = False
    signature: str = "train"
    checkpoint_every: int = 100
    seed: int = 0
    progress: bool = True
    vnodes_per_rank: Union[List[int], str, None] = None
    threads: Optional[int] = None
    allow_nonfinite: bool = False
    elastic: Optional[ElasticOptions] = None
    stall_warning: float = 60.0
    stall_timeout: float = 600.0
    eval_data: Optional[str] = None
    eval_every: Optional[int] = None
    logdir: Optional[str] = None
    keras_file: Optional[str] = None  # the compiled .keras file the model was built from (its metrics validate)
    imports: Tuple[str, ...] = ()  # modules that file's model needs
    input_fn: Union[str, Callable, None] = None  # MODULE:FUNCTION or a callable: decodes each example

    def input_function(self) -> Optional[InputFn]:
        """--input-fn imported (None: none); one line for one that cannot be."""
        return InputFn.resolve(self.input_fn)

    @property
    def auto(self) -> bool:
        """--vnodes-per-rank auto: shares planned from the ranks' measured speeds."""
        return self.vnodes_per_rank == "auto"

    @property
    def output(self) -> str:
        """The trained model's path, absolute."""
        return os.path.abspath(self.out)

    @property
    def ckpt_dir(self) -> str:
        """Where the run's checkpoints go: ``OUT.ckpt``."""
        return self.output + ".ckpt"

    @property
    def data_files(self) -> List[str]:
        """The files of the data: those of a glob pattern, or the one path given."""
        return data_files(self.data_path)

    def check(self) -> None:
        """One line for an option out of its range, or options that exclude each other."""
        for name, value, least in (("--steps", self.steps, 1), ("--batch-size", self.batch_size, 1),
                                   ("--checkpoint-every", self.checkpoint_every, 0), ("--seed", self.seed, 0)):
            if not isinstance(value, int) or value < least:
                raise InputError(f"{name} {value}: give an integer of at least {least}")
        for name, value in (("--stall-warning", self.stall_warning), ("--stall-timeout", self.stall_timeout)):
            if isinstance(value, bool) or not isinstance(value, (int, float)) or not 0 <= value < math.inf:
                shown = f"{value:g}" if isinstance(value, float) else value
                raise InputError(f"{name} {shown}: give a number of seconds of at least 0 (0: off)")
        if self.resume and self.force:
            raise InputError("--resume and --force: give one (--resume continues a checkpoint, --force starts over)")
        self.input_function()
        self._check_reports()

    def _check_reports(self) -> None:
        """--eval-data, --eval-every and --logdir: a validation file that is there, a positive
        interval, a log directory that is not a file nor inside the run's outputs."""
        if self.eval_every is not None:
            if isinstance(self.eval_every, bool) or not isinstance(self.eval_every, int) or self.eval_every < 1:
                raise InputError(f"--eval-every {self.eval_every}: give an integer of at least 1 (steps between "
                                 "validations)")
            if not self.eval_data:
                raise InputError(f"--eval-every {self.eval_every} without --eval-data: give the validation data "
                                 "(an .npz file or TFRecord files) with --eval-data PATH")
        if self.eval_data and not any(os.path.isfile(f) for f in data_files(self.eval_data)):
            raise InputError(f"--eval-data {self.eval_data}: no such file; give the validation data (an .npz file "
                             "or TFRecord files)")
        if self.logdir:
            logdir = os.path.abspath(self.logdir)
            if os.path.exists(logdir) and not os.path.isdir(logdir):
                raise InputError(f"--logdir {self.logdir}: a file, not a directory; give a directory for the "
                                 "TensorBoard event files")
            for kept in (self.output, self.ckpt_dir, serving.sibling_dir(self.output)):
                if logdir == kept or logdir.startswith(kept + os.sep):
                    raise InputError(f"--logdir {self.logdir}: inside the run's output {kept}, which the run "
                                     "replaces; give a directory outside it")

    def agreed(self, fingerprint: str, data: TrainData) -> Dict[str, Tuple[object, str]]:
        """What the ranks of a job must agree on to run the same steps and as many collective calls
        (option -> (compared, shown), for :func:`vfgraph.runtime.world.same_everywhere`). Not in
        it, as they may differ by design: --threads, --vnodes-per-rank (each rank's share), -v and
        --no-progress, and how a process an elastic job started was started."""
        digest, n = data.digest(), len(data)
        shown = {"--seed": self.seed, "--batch-size": self.batch_size, "--steps": self.steps,
                 "--checkpoint-every": self.checkpoint_every, "--train-signature": self.signature,
                 "--resume": self.resume, "--force": self.force, "--allow-nonfinite": self.allow_nonfinite,
                 "-o": self.output, "--eval-data": self.eval_data, "--eval-every": self.eval_every,
                 "--input-fn": data.preprocess.input_fn.name if data.preprocess else None}
        elastic = self.elastic
        if elastic is not None:  # (each rank's schedule says when the job changes size)
            shown.update({"--elastic-schedule": elastic.schedule, "--max-ranks": elastic.max_ranks,
                          "--host-discovery-script": elastic.discovery, "--discovery-interval": elastic.interval})
        config = {k: (v, str(v)) for k, v in shown.items()}
        config["--data"] = (digest, f"{n} examples of digest {digest[:12]}")
        config["the model"] = (fingerprint, f"fingerprint {fingerprint[:12]}")
        return config

    def resumable(self, fingerprint: str, data: TrainData) -> dict:
        """The configuration a checkpoint records and ``--resume`` requires unchanged
        (:func:`vfgraph.runtime.checkpoints.changed_config`)."""
        rec = records.read(self.model, VirtualNodes).get(self.signature)
        return {"batch_size": self.batch_size, "seed": self.seed, "signature": self.signature,
                "vnodes": [rec.vnodes, rec.vnode_batch] if rec else [1, 0],
                "model": fingerprint, "data": data.fingerprint(),  # (--input-fn by name: an edit of its body
                "input_fn": data.preprocess.input_fn.name if data.preprocess else None}  # is the user's to judge)


@dataclass
class ModelPlan:
    """What the rewrite's records say about the training step of the model: ``b`` examples per
    virtual node (0: the graph divides the fed batch itself), whether it all-reduces over ranks,
    its pipeline stages (None: none), the broadcast signature (None: the rewrite added none);
    and for an elastic run its schedule."""

    b: int
    reduces: bool
    stages: object
    schedule: Optional[list] = None
    broadcast: Optional[str] = None

    @classmethod
    def checked(cls, cfg: TrainConfig) -> "ModelPlan":
        """The plan of ``cfg``'s model, after checking the options (:meth:`TrainConfig.check`), the
        model and, for an elastic run, that the model can have one (without the broadcast
        signature, which :func:`broadcast_signature` adds)."""
        cfg.check()
        if not savedmodel.is_saved_model_dir(cfg.model):
            raise InputError(f"{cfg.model}: not a SavedModel directory")
        b, reduces = vnode_layout(cfg.model, cfg.signature)
        stages = stages_of(cfg.model, cfg.signature)
        schedule = None
        if cfg.elastic is not None:
            schedule = check_elastic(cfg, b, reduces, stages)
        return cls(b, reduces, stages, schedule)

    @property
    def staged_on_ranks(self) -> bool:
        """The step is cut into pipeline stages that run on ranks of their own."""
        return self.stages is not None and self.stages.on_ranks and self.stages.count > 1

    @property
    def in_process(self) -> int:
        """The pipeline stages that run on this process's devices (1: no stages, or on ranks)."""
        return self.stages.count if self.stages is not None and not self.stages.on_ranks else 1


def vnode_layout(model: str, signature: str) -> Tuple[int, bool]:
    """(examples per virtual node b, or 0 when the graph divides the fed batch itself;
    whether the step all-reduces over ranks), from the rewrite record of ``model``."""
    meta = records.read_metadata(model) or {}
    rec = records.get(meta, VirtualNodes).get(signature)
    return (rec.vnode_batch if rec else 0), signature in records.get(meta, Allreduce)


def broadcast_signature(model: str, signature: str) -> Optional[str]:
    """The key of the signature that starts the ranks from rank 0's variables, as the
    all-reduce record of ``model`` names it (None: the rewrite added none)."""
    rec = records.read(model, Allreduce).get(signature)
    return rec.broadcast_signature if rec else None


def check_elastic(cfg: TrainConfig, b: int, reduces: bool, stages) -> list:
    """The schedule of an elastic run, or a clear error for a model or options it cannot have."""
    elastic, model, batch_size = cfg.elastic, cfg.model, cfg.batch_size
    if elastic.max_ranks is None or not (elastic.schedule or elastic.discovery):
        raise InputError("--max-ranks goes with --elastic-schedule or --host-discovery-script (or both): give both "
                         "--max-ranks and one of them")
    if not elastic.interval > 0:
        raise InputError(f"--discovery-interval {elastic.interval}: give a positive number of seconds")
    if elastic.max_ranks < 1:
        raise InputError(f"--max-ranks {elastic.max_ranks}: give at least 1")
    schedule = el.parse_schedule(elastic.schedule, elastic.max_ranks)
    if not reduces or not b:
        raise InputError(f"{model}: an elastic run shares a fixed global batch of whole virtual nodes over its ranks; "
                         "rewrite the model with --vnode-batch B and --allreduce mpi")
    if stages is not None:
        raise InputError(f"{model}: its training step is cut into pipeline stages; an elastic run changes only the "
                         "number of data-parallel ranks of a model without stages")
    if cfg.vnodes_per_rank not in (None, "auto"):
        raise InputError("--vnodes-per-rank with --elastic-schedule: give auto, or nothing for even shares (fixed "
                         "shares cannot follow a changing number of ranks)")
    if batch_size % b == 0 and batch_size // b < elastic.max_ranks:
        raise InputError(f"--max-ranks {elastic.max_ranks}: the global batch holds {batch_size // b} virtual nodes, "
                         "and every rank needs at least one; give at most that many ranks, or a larger --batch-size")
    return schedule
