"""load -> pipeline -> verify -> save, in one place."""
from __future__ import annotations

import contextlib
import gc
import os
from typing import Optional, Sequence, Union

from vfgraph.version import __version__
from vfgraph.errors import InputError, InternalError, VfgraphError
from vfgraph.io import formats, graphdef, keras_file, objectgraph, outputs, savedmodel
from vfgraph.item import GraphItem
from vfgraph.passes.base import parse_pipeline
from vfgraph.passes.manager import AfterEach, PassManager
from vfgraph.verification import verify

ModelLike = Union[str, os.PathLike, GraphItem]


def load(path: Union[str, os.PathLike], outputs: Optional[Sequence[str]] = None,
         checkpoint: Optional[Union[str, os.PathLike]] = None, loss: str = "", imports: Sequence[str] = (),
         keras_loss: str = "", keras_optimizer: str = "", label: str = "label") -> GraphItem:
    """Load an exported model without modifying it, read by the first of the formats of
    :mod:`vfgraph.io.formats` that recognises it (an option the model's format does not read
    is refused; a path none recognises names them all): a SavedModel directory; a Keras 3 ``.keras``
    file (compiled: its training step is built as ``fit`` runs it; ``imports`` names modules to
    import first, for custom layers); a frozen GraphDef (.pb / .pbtxt; ``outputs`` names its
    output tensors, default: unconsumed nodes); or a TF1 MetaGraphDef (.meta, or a checkpoint
    directory) with its checkpoint (default: beside it, or ``checkpoint``; ``loss`` names the
    train op's loss when it cannot be found). An inference SavedModel given ``keras_loss`` and
    ``keras_optimizer`` gets a training step over its serving function, the label fed as the
    input ``label`` (:mod:`vfgraph.io.keras_file`)."""
    with _gc_paused():
        return formats.load(os.fspath(path), outputs=outputs, checkpoint=checkpoint, loss=loss, imports=tuple(imports),
                            keras_loss=keras_loss, keras_optimizer=keras_optimizer, label=label)


def default_pipeline(vnodes: int, vnode_batch: int = 0, train_signature: str = "",
                     has_training: bool = True, allreduce: bool = False, fusion_mb: float = 4,
                     stages: int = 1, devices: Sequence[str] = (), split_at: Sequence[str] = (),
                     schedule: str = "1f1b", deterministic: bool = False, balance: str = "estimate",
                     profile_batch: int = 32, profile: str = "") -> str:
    """The pipeline :func:`rewrite` runs without one given: ``stages`` other than 1 (or devices, or
    split_at) cut the step into stages, then split-vnodes (and insert-allreduce) where the model
    trains, then microbatch-inference. Every option given reaches its pass, which checks it."""
    parts = []
    if has_training and (stages != 1 or devices or split_at):
        opts = [f"stages={stages}"] + (["devices=" + ";".join(devices)] if devices else [])
        opts += ["split-at=" + ";".join(split_at)] if split_at else []
        opts += [f"schedule={schedule}"] if schedule != "1f1b" else []
        opts += [f"balance={balance}"] if balance != "estimate" else []
        measure = balance != "estimate" and not profile  # a step profiled where the pass runs
        opts += [f"profile-batch={profile_batch}"] if measure and profile_batch != 32 else []
        opts += [f"profile={profile}"] if profile else []
        opts += [f"signature={train_signature}"] if train_signature else []
        parts.append("partition-stages{" + ",".join(opts) + "}")
    if has_training:
        opts = [f"vnodes={vnodes}"] + ([f"vnode-batch={vnode_batch}"] if vnode_batch else [])
        if train_signature:
            opts.append(f"signature={train_signature}")
        if deterministic:
            opts.append("deterministic=true")
        parts.append("split-vnodes{" + ",".join(opts) + "}")
        if allreduce:
            parts.append("insert-allreduce" + (f"{{fusion-mb={fusion_mb:g}}}" if fusion_mb != 4 else ""))
    parts.append("microbatch-inference" + (f"{{vnode-batch={vnode_batch}}}" if vnode_batch else ""))
    return ",".join(parts)


def rewrite(model: ModelLike, vnodes: int = 1, vnode_batch: int = 0, pipeline: Optional[str] = None,
            train_signature: str = "", after_each: Optional[AfterEach] = None,
            outputs: Optional[Sequence[str]] = None, allreduce: Optional[str] = None,
            fusion_mb: Optional[float] = None,
            checkpoint: Optional[Union[str, os.PathLike]] = None, loss: str = "", in_place: bool = False,
            verify_each: bool = False, stages: int = 1, devices: Sequence[str] = (), split_at: Sequence[str] = (),
            schedule: Optional[str] = None, deterministic: bool = False, balance: str = "estimate",
            profile_batch: int = 32, profile: Union[str, os.PathLike] = "", imports: Sequence[str] = (),
            keras_loss: str = "", keras_optimizer: str = "", label: str = "label") -> GraphItem:
    """Rewrite ``model`` with virtual nodes; returns a new item (the input is not changed).
    With ``in_place``, a loaded item is rewritten itself and returned, without the copy (a
    model's size in memory and the time to copy it): for an item loaded only to be rewritten
    (a pass that fails leaves it partly rewritten).

    ``allreduce``: "mpi" (the default for a TF2 SavedModel's training step) adds the all-reduce
    over MPI ranks of at most ``fusion_mb`` MiB per fused buffer (default 4; on one process it is
    skipped at run time; loading the model then needs vfgraph's ops, see :func:`export` for
    serving), "none" leaves it out. The output depends only on the input and the options: where
    the ops cannot be built, "mpi" is an error. An option that would change nothing is refused
    (an all-reduce for a model without a TF2 training step, ``fusion_mb`` without one, a
    ``schedule`` without stages, any of these with a ``pipeline``, which holds its own). ``after_each(pass, item)``
    sees each pass's result before the next pass edits it in place (``item.copy()`` keeps one).
    ``verify_each``: verify after every pass, not only at the end (names the pass that broke
    the graph; costs a verify per pass).

    ``stages`` > 1 cuts the training step into that many pipeline stages (partition-stages),
    stage k placed on ``devices[k]``, or without ``devices`` run by MPI rank k of
    ``mpiexec -n stages`` (``train_stage_<k+1>`` signatures); ``split_at`` names the forward
    ops that start stages 2..K, ``schedule`` "1f1b" keeps at most K virtual nodes in flight,
    "gpipe" all. Without ``split_at`` the cuts balance each op's estimated cost, or with
    ``balance="profile"`` its measured time in a step of ``profile_batch`` examples run here
    (on this machine's CPU; the notes name the cuts chosen, to repeat the rewrite exactly), or
    the times in ``profile``, a file ``vfgraph profile`` wrote (implies ``balance="profile"``;
    the same file gives the same rewrite).

    ``deterministic`` sums the virtual nodes' gradients and outputs exactly (fixed point), so
    that any layout of the V virtual nodes over ranks (1x8, 2x4, 5+3) trains bit-identical
    parameters.

    ``imports``, ``keras_loss``, ``keras_optimizer`` and ``label`` are :func:`load`'s, for a model
    given by its path (a .keras file; an inference SavedModel to fine-tune)."""
    if allreduce not in (None, "mpi", "none"):
        raise InputError(f"allreduce={allreduce!r}: choose 'mpi' or 'none'")
    _check_applies(pipeline, vnodes, vnode_batch, allreduce, fusion_mb, stages, devices, split_at, schedule,
                   balance, profile)
    profile = os.fspath(profile)
    if profile:
        if any(c in profile for c in ",{}"):
            raise InputError(f"profile {profile!r}: a pipeline option cannot hold ',', '{{' or '}}'; give the "
                             "profile's path without them (move or link the file)")
        balance = "profile"
    with _gc_paused():
        return _rewrite(model, vnodes, vnode_batch, pipeline, train_signature, after_each, outputs, allreduce,
                        fusion_mb, checkpoint, loss, in_place, verify_each,
                        dict(stages=stages, devices=tuple(devices), split_at=tuple(split_at), schedule=schedule,
                             deterministic=deterministic, balance=balance, profile_batch=profile_batch,
                             profile=profile), dict(imports=tuple(imports), keras_loss=keras_loss,
                                                    keras_optimizer=keras_optimizer, label=label))


def _check_applies(pipeline, vnodes, vnode_batch, allreduce, fusion_mb, stages, devices, split_at, schedule,
                   balance, profile) -> None:
    """Refuse options the rewrite would ignore, before any work (those that depend on the model's
    kind are checked once it is loaded, by :func:`_check_model_applies`)."""
    staged = stages != 1 or bool(devices) or bool(split_at)
    if pipeline is not None:
        given = [f"--{n.replace('_', '-')} {v if isinstance(v, (int, float, str)) else ','.join(v)}" for n, v, unset in (
            ("vnodes", vnodes, 1), ("vnode_batch", vnode_batch, 0), ("allreduce", allreduce, None),
            ("fusion_mb", fusion_mb, None), ("stages", stages, 1), ("devices", tuple(devices), ()),
            ("split_at", tuple(split_at), ()), ("schedule", schedule, None), ("balance", balance, "estimate"),
            ("profile", os.fspath(profile), "")) if v != unset]
        if given:
            raise InputError(f"{', '.join(given)} with a pipeline: the pipeline holds its passes' options; give them "
                             "in it, e.g. 'split-vnodes{vnodes=8},insert-allreduce{fusion-mb=8}'")
    if fusion_mb is not None and allreduce == "none":
        raise InputError(f"--fusion-mb {fusion_mb:g} with --allreduce none: there is no all-reduce to fuse; leave "
                         "out one of them")
    if schedule is not None and not staged and pipeline is None:
        raise InputError(f"--schedule {schedule} without --stages: the schedule orders pipeline stages; give "
                         "--stages K (or --devices, --split-at), or leave out --schedule")


def _check_model_applies(item: GraphItem, has_training: bool, allreduce, fusion_mb) -> None:
    """Refuse all-reduce options for a model whose rewrite has no all-reduce: a TF1 or GraphDef
    model (its step trains on one process) or one whose serving only is rewritten."""
    given = " and ".join(f for f, v in (("--allreduce mpi", allreduce == "mpi"),
                                        (f"--fusion-mb {fusion_mb or 0:g}", fusion_mb is not None)) if v)
    if not given:
        return
    if item.kind != "saved_model":
        raise InputError(f"{item.source}: {given}: the rewritten step of a TF1 or GraphDef model trains on one "
                         "process, without an all-reduce; leave out the option (or export the model as a TF2 "
                         "SavedModel to train it over MPI ranks)")
    if not has_training:
        raise InputError(f"{item.source}: {given}: only the model's serving is rewritten (it has no training "
                         "step), so there is no all-reduce; leave out the option")


@contextlib.contextmanager
def _gc_paused():
    """Pause Python's cyclic garbage collector: a rewrite allocates hundreds of thousands of
    small objects and almost no cycles, and each full collection rescans everything TensorFlow
    holds (a fifth of ResNet-50's rewrite time). Reference counting still frees as usual."""
    was = gc.isenabled()
    gc.disable()
    try:
        yield
    finally:
        if was:
            gc.enable()


def _rewrite(model, vnodes, vnode_batch, pipeline, train_signature, after_each, outputs, allreduce, fusion_mb,
             checkpoint, loss, in_place, verify_each, partition=None, keras=None) -> GraphItem:
    owned = in_place or not isinstance(model, GraphItem)  # loaded here: held by nothing else
    if pipeline is not None and (partition or {}).get("deterministic"):
        raise InputError("deterministic with a pipeline: give split-vnodes the option instead, "
                         "e.g. 'split-vnodes{vnodes=8,deterministic=true}'")
    part = {k: v for k, v in (partition or {}).items() if v is not None}  # (None: the default)
    fusion = 4 if fusion_mb is None else fusion_mb
    if pipeline is None:
        parse_pipeline(default_pipeline(vnodes, vnode_batch, train_signature, True, allreduce != "none", fusion,
                                        **part))  # every option checked by its pass, before the load
    else:
        parse_pipeline(pipeline)
    item = model if isinstance(model, GraphItem) else load(model, outputs, checkpoint, loss, **(keras or {}))
    if pipeline is None:
        staged = part.get("stages", 1) != 1 or part.get("devices") or part.get("split_at")
        serving_only = vnodes == 1 and bool(vnode_batch) and not staged and not part.get("deterministic")
        has_training = _has_training(item, train_signature, serving_only)
        _check_model_applies(item, has_training, allreduce, fusion_mb)
        reduced = allreduce != "none" and item.kind == "saved_model"  # TF1 and GraphDef outputs: one process
        pipeline = default_pipeline(vnodes, vnode_batch, train_signature, has_training, reduced, fusion, **part)
    source_fingerprint = savedmodel.source_fingerprint(item.source, keras_file.variables_read(item))
    seq = PassManager(parse_pipeline(pipeline), verify_each=verify_each, after_each=after_each)
    out, notes = seq.run(item, owned=owned)
    objectgraph.relink_captured_tensors(out.meta_graph.object_graph_def, out.library)
    try:
        verify(out)
    except VfgraphError as e:  # the passes made what TensorFlow's loader would refuse
        raise InternalError(f"the rewritten model would not load ({seq.spec()}): {e}") from e
    history = list(out.metadata.get("history", []))
    history.append({"pipeline": seq.spec(),
                    "source_fingerprint": source_fingerprint,
                    "vfgraph_version": __version__})
    out.metadata["history"] = history
    out.metadata["notes"] = notes
    return out


def _has_training(item: GraphItem, train_signature: str, serving_only: bool) -> bool:
    """Whether the default pipeline rewrites a training signature of ``item``. A SavedModel
    without one is refused (a rewrite would change nothing of its training), unless only its
    serving is micro-batched (``serving_only``: a slice size and nothing else); a frozen
    GraphDef has none to rewrite."""
    names = ", ".join(sorted(item.signatures)) or "none"
    if train_signature and train_signature not in item.signatures:
        raise InputError(f"{item.source}: no training signature {train_signature!r} (signatures: {names}); pass "
                         "--train-signature NAME with one of them, or leave it out to use the one found")
    if train_signature or any(s.is_training for s in item.signatures.values()):
        return True
    if item.kind == "saved_model" and not serving_only:
        raise InputError(f"{item.source}: no training signature (signatures: {names}; none updates variables from a "
                         f"batch, and none is named 'train'): the model has no training step; give one with "
                         f"{keras_file.LOSS_FLAG} NAME {keras_file.OPTIMIZER_FLAG} NAME (or export it as a signature "
                         "and pass --train-signature NAME), or micro-batch its serving with --vnode-batch B alone")
    return False


@outputs.command()
def save(item: GraphItem, out: Union[str, os.PathLike], force: bool = False) -> str:
    """Write ``item`` atomically: a SavedModel directory, or a GraphDef file for graph inputs
    (locked while it is written, by vfgraph.io.outputs' rule)."""
    outputs.lock(os.fspath(out), [item.source] if item.kind == "graph_def" else savedmodel.input_paths(item))
    if item.kind == "graph_def":
        return graphdef.save_graph_def(item, os.fspath(out), force=force)
    return savedmodel.save_saved_model(item, os.fspath(out), force=force)


@outputs.command()
def export(model: ModelLike, out: Union[str, os.PathLike], version: int = 1, vnode_batch: int = 0,
           force: bool = False, imports: Sequence[str] = ()) -> str:
    """Write a serving-only SavedModel of ``model`` at ``out/<version>/`` (TF Serving's layout)
    and return that directory: the serving signatures, micro-batched, and the variables they
    read; no training functions and none of vfgraph's ops, so TensorFlow loads and serves it
    without vfgraph (Python, the C API, TF Serving).

    Serving is micro-batched in slices of ``vnode_batch`` examples, or of the training rewrite's
    b when the model records one; a model whose serving is already micro-batched keeps its
    slices; with no slice size known, the serving functions are kept as they are. The input is
    not changed; the output is written atomically (an existing version only with ``force``).
    ``imports``: :func:`load`'s, for a .keras file with custom layers."""
    from vfgraph.io import serving

    if not isinstance(vnode_batch, int) or vnode_batch < 0:
        raise InputError(f"--vnode-batch {vnode_batch}: give the examples per slice (0: the model's own)")
    sources = savedmodel.input_paths(model) if isinstance(model, GraphItem) else [os.fspath(model)]
    outputs.lock(os.fspath(out), sources)
    serving.prepare_target(os.fspath(out), version, force, sources)
    with _gc_paused():
        item = model if isinstance(model, GraphItem) else load(model, imports=imports)
        item = _sliced_for_serving(item, vnode_batch, in_place=not isinstance(model, GraphItem))
        return serving.save_serving_model(item, os.fspath(out), version, force)


def _sliced_for_serving(item: GraphItem, vnode_batch: int, in_place: bool) -> GraphItem:
    """``item`` with its serving signatures micro-batched (microbatch-inference) when a slice size
    is known and they are not already."""
    import logging

    from vfgraph import records
    from vfgraph.io.serving import serving_keys
    from vfgraph.records import Microbatch, VirtualNodes

    done = records.get(item, Microbatch)
    keys = serving_keys(item)
    sliced = {done[k].vnode_batch for k in keys if k in done}
    if sliced:
        if vnode_batch and sliced != {vnode_batch}:
            raise InputError(f"{item.source}: serving is already micro-batched in slices of "
                             f"{', '.join(map(str, sorted(sliced)))}; export it without --vnode-batch, or export the "
                             f"original model with --vnode-batch {vnode_batch}")
        return item
    b = vnode_batch or next((int(r.vnode_batch) for r in records.get(item, VirtualNodes).values() if r.vnode_batch), 0)
    if not b or not keys:
        return item
    item = rewrite(item, pipeline=f"microbatch-inference{{vnode-batch={b}}}", in_place=in_place)
    for note in item.metadata.get("notes", []):
        logging.getLogger("vfgraph").warning("%s", note)
    return item
