"""load -> pipeline -> verify -> save, in one place."""
from __future__ import annotations

import contextlib
import gc
import inspect
import os
import textwrap
from typing import Dict, Optional, Sequence, Union

from vfgraph.version import __version__
from vfgraph.errors import InputError, InternalError, VfgraphError
from vfgraph.io import formats, graphdef, keras_file, objectgraph, outputs, savedmodel
from vfgraph.item import GraphItem
from vfgraph.passes.base import Flag, flags, parse_pipeline
from vfgraph.passes.manager import AfterEach, PassManager
from vfgraph.rewrites.insert_allreduce import InsertAllreducePass
from vfgraph.rewrites.microbatch_inference import MicrobatchInferencePass
from vfgraph.rewrites.partition_stages import PartitionStagesPass
from vfgraph.rewrites.split_vnodes import SplitVnodesPass
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


#: The passes of the pipeline :func:`rewrite` runs without one given, in their order: their
#: options with a command-line flag (:func:`vfgraph.passes.base.option`) are its keywords.
DEFAULT_PASSES = (PartitionStagesPass, SplitVnodesPass, InsertAllreducePass, MicrobatchInferencePass)
_LISTS = ("devices", "split_at")  # str options a Python caller gives as a list of names (';'-joined in a pipeline)


def pass_options() -> Dict[str, Flag]:
    """The pass options :func:`rewrite` takes as keywords, by keyword (the flag's ``dest``): those
    of :data:`DEFAULT_PASSES` that declare a command-line flag, each with its declaration's
    default, check and help (a keyword several passes declare, such as ``vnode_batch``, sets
    each of them)."""
    return {f.dest: f for f in flags(DEFAULT_PASSES)}


def _given_options(options: dict) -> Dict[str, object]:
    """The pass options given to :func:`rewrite` (None, or False for a switch: not given), in
    their declarations' order and type (a list of names as one ';'-separated text, a path as
    text), each checked by its declaration (:meth:`Flag.problem`, the check the command line
    makes): a value one refuses raises its pass's :class:`OptionError`, an unknown keyword a
    TypeError naming the known ones."""
    known = pass_options()
    unknown = [k for k in options if k not in known]
    if unknown:
        raise TypeError(f"unexpected keyword argument(s) {', '.join(map(repr, unknown))}; the pass options are "
                        f"{', '.join(known)} (and {', '.join(_OWN_KEYWORDS)})")
    given: Dict[str, object] = {}
    for key, flag in known.items():
        value = options.get(key)
        if value is None or value is False:
            continue
        if key in _LISTS and isinstance(value, (list, tuple)):
            value = ";".join(value)
        elif isinstance(value, os.PathLike):
            value = os.fspath(value)
        refused = flag.problem(value)
        if refused is not None:
            raise refused
        given[key] = value
    return given


def _staged(given: dict) -> bool:
    """Whether the default pipeline cuts the training step into stages: more than one stage
    (``stages=1`` is the step as it is), devices or cuts given."""
    return given.get("stages") not in (None, 1) or bool(given.get("devices")) or bool(given.get("split_at"))


def default_pipeline(has_training: bool = True, allreduce: bool = False, **options) -> str:
    """The pipeline :func:`rewrite` runs without one given, for its pass options ``options``
    (:func:`pass_options`; those left out keep their passes' defaults): partition-stages where
    the step is cut into stages (``stages`` other than 1, or ``devices``, or ``split_at``; with
    these alone, ``stages=1``), then split-vnodes (and insert-allreduce, with ``allreduce``)
    where the model trains (``has_training``), then microbatch-inference. Each pass gets the
    options that declare its flags and checks them; ``profile_batch`` only reaches
    partition-stages where it profiles a step (``balance="profile"`` without ``profile``)."""
    given = _given_options(options)
    if given.get("balance") != "profile" or given.get("profile"):
        given.pop("profile_batch", None)  # (no step profiled here)
    runs = [cls for cls, on in zip(DEFAULT_PASSES, (has_training and _staged(given), has_training,
                                                    has_training and allreduce, True)) if on]
    if runs[0] is PartitionStagesPass:
        given.setdefault("stages", 1)  # (cut by devices or split_at alone)
    known = pass_options()
    passes = [cls(**{field: given[key] for key, f in known.items() if key in given
                     for name, field in f.sets if name == cls.name}) for cls in runs]
    return ",".join(p.spec() for p in passes)


def rewrite(model: ModelLike, *, pipeline: Optional[str] = None, after_each: Optional[AfterEach] = None,
            outputs: Optional[Sequence[str]] = None, allreduce: Optional[str] = None,
            checkpoint: Optional[Union[str, os.PathLike]] = None, loss: str = "", in_place: bool = False,
            verify_each: bool = False, imports: Sequence[str] = (), keras_loss: str = "", keras_optimizer: str = "",
            label: str = "label", **options) -> GraphItem:
    """Rewrite ``model`` with virtual nodes; returns a new item (the input is not changed).
    With ``in_place``, a loaded item is rewritten itself and returned, without the copy (a
    model's size in memory and the time to copy it): for an item loaded only to be rewritten
    (a pass that fails leaves it partly rewritten).

    ``options`` are the passes' options, listed below (:func:`pass_options`): each keyword is
    the option of the default pipeline's passes (:func:`default_pipeline`) that declares the
    ``vfgraph rewrite`` flag of that name, with its default, check and help; one left out (or
    None) keeps its pass's default, a value its pass refuses raises the pass's
    :class:`~vfgraph.passes.base.OptionError`, an unknown keyword a TypeError. ``devices`` and
    ``split_at`` are lists of names here, ``profile`` a path.

    ``allreduce``: "mpi" (the default for a TF2 SavedModel's training step) adds the all-reduce
    over MPI ranks of at most ``fusion_mb`` MiB per fused buffer (on one process it is skipped
    at run time; loading the model then needs vfgraph's ops, see :func:`export` for serving),
    "none" leaves it out. The output depends only on the input and the options: where the ops
    cannot be built, "mpi" is an error. An option that would change nothing is refused (an
    all-reduce for a model without a TF2 training step, ``fusion_mb`` without one, a
    ``schedule`` without stages, any of the passes' options with a ``pipeline``, which holds
    its own). ``after_each(pass, item)`` sees each pass's result before the next pass edits it
    in place (``item.copy()`` keeps one). ``verify_each``: verify after every pass, not only at
    the end (names the pass that broke the graph; costs a verify per pass).

    ``stages`` > 1 cuts the training step into that many pipeline stages (partition-stages),
    stage k placed on ``devices[k]``, or without ``devices`` run by MPI rank k of
    ``mpiexec -n stages`` (the Stages record names their signatures); ``split_at`` names the
    forward ops that start stages 2..K. Without ``split_at`` the cuts balance each op's
    estimated cost, or with ``balance="profile"`` its measured time in a step of
    ``profile_batch`` examples run here, or the times in ``profile`` (which implies
    ``balance="profile"``).

    ``imports``, ``keras_loss``, ``keras_optimizer`` and ``label`` are :func:`load`'s, for a model
    given by its path (a .keras file; an inference SavedModel to fine-tune)."""
    if allreduce not in (None, "mpi", "none"):
        raise InputError(f"allreduce={allreduce!r}: choose 'mpi' or 'none'")
    given = _given_options(options)
    _check_applies(pipeline, given, allreduce)
    if given.get("profile"):
        if any(c in given["profile"] for c in ",{}"):
            raise InputError(f"profile {given['profile']!r}: a pipeline option cannot hold ',', '{{' or '}}'; give "
                             "the profile's path without them (move or link the file)")
        given["balance"] = "profile"
    with _gc_paused():
        return _rewrite(model, pipeline, given, allreduce, after_each, verify_each, in_place,
                        dict(outputs=outputs, checkpoint=checkpoint, loss=loss, imports=tuple(imports),
                             keras_loss=keras_loss, keras_optimizer=keras_optimizer, label=label))


def _options_doc() -> str:
    """The part of :func:`rewrite`'s docstring that lists its pass options, from their declarations."""
    lines = ["", "", "    The passes' options (:func:`pass_options`; partition-stages runs only with ``stages``",
             "    other than 1, ``devices`` or ``split_at``, insert-allreduce only with the all-reduce):", ""]
    for key, f in pass_options().items():
        where = ", ".join(f"{p}.{o.replace('_', '-')}" for p, o in f.sets)
        kind = "list of str" if key in _LISTS else f.type.__name__
        lines += textwrap.wrap(f"``{key}`` ({kind}, default {f.default!r}; {where}): {f.help}", 96,
                               initial_indent="    - ", subsequent_indent="      ", break_on_hyphens=False)
    return "\n".join(lines)


def _signature() -> inspect.Signature:
    """:func:`rewrite`'s signature with its pass options as keywords (None: the pass's default)."""
    sig = inspect.signature(rewrite)
    params = list(sig.parameters.values())[:-1]  # (without **options)
    params += [inspect.Parameter(key, inspect.Parameter.KEYWORD_ONLY, default=None,
                                 annotation=f"Optional[{'Sequence[str]' if key in _LISTS else f.type.__name__}]")
               for key, f in pass_options().items()]
    return sig.replace(parameters=params)


_OWN_KEYWORDS = tuple(inspect.signature(rewrite).parameters)[1:-1]  # rewrite's keywords that are not pass options
rewrite.__signature__ = _signature()  # (what help() and the command line read)
if rewrite.__doc__:  # (none under python -OO)
    rewrite.__doc__ += _options_doc()


def _as_flag(key: str, value) -> str:
    """A pass option given to :func:`rewrite` as its command-line flag gives it: ``--vnodes 8``."""
    flag = pass_options()[key].flag
    if isinstance(value, bool):
        return flag
    text = f"{value:g}" if isinstance(value, float) else str(value)
    return f"{flag} {text.replace(';', ',') if key in _LISTS else text}"


def _pipeline_example(given: dict) -> str:
    """A pipeline holding the pass options ``given`` (and 8 virtual nodes), for a message."""
    known = pass_options()
    parts: Dict[str, Dict[str, str]] = {"split-vnodes": {"vnodes": "8"}}
    for key, value in given.items():
        text = "true" if value is True else f"{value:g}" if isinstance(value, float) else str(value)
        for pass_name, field in known[key].sets:
            parts.setdefault(pass_name, {})[field.replace("_", "-")] = text
    return ",".join(f"{cls.name}{{{','.join(f'{k}={v}' for k, v in parts[cls.name].items())}}}"
                    for cls in DEFAULT_PASSES if cls.name in parts)


def _check_applies(pipeline: Optional[str], given: dict, allreduce: Optional[str]) -> None:
    """Refuse options the rewrite would ignore, before any work (those that depend on the model's
    kind are checked once it is loaded, by :func:`_check_model_applies`)."""
    if pipeline is not None:
        named = [_as_flag(k, v) for k, v in given.items()] + ([f"--allreduce {allreduce}"] if allreduce else [])
        if named:
            raise InputError(f"{', '.join(named)} with a pipeline: the pipeline holds its passes' options; give them "
                             f"in it, e.g. '{_pipeline_example(given)}'")
    if "fusion_mb" in given and allreduce == "none":
        raise InputError(f"{_as_flag('fusion_mb', given['fusion_mb'])} with --allreduce none: there is no all-reduce "
                         "to fuse; leave out one of them")
    if "schedule" in given and not _staged(given) and pipeline is None:
        raise InputError(f"--schedule {given['schedule']} without --stages: the schedule orders pipeline stages; give "
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


def _rewrite(model, pipeline, given, allreduce, after_each, verify_each, in_place, loading) -> GraphItem:
    """:func:`rewrite` with its pass options ``given`` checked (:func:`_given_options`), and
    :func:`load`'s arguments ``loading``."""
    owned = in_place or not isinstance(model, GraphItem)  # loaded here: held by nothing else
    if pipeline is None:  # every option checked by its pass, before the load
        parse_pipeline(default_pipeline(True, allreduce != "none", **given))
    else:
        parse_pipeline(pipeline)
    item = model if isinstance(model, GraphItem) else load(model, **loading)
    if pipeline is None:
        serving_only = (given.get("vnodes") in (None, 1) and bool(given.get("vnode_batch")) and not _staged(given)
                        and "deterministic" not in given)
        has_training = _has_training(item, given.get("train_signature", ""), serving_only)
        _check_model_applies(item, has_training, allreduce, given.get("fusion_mb"))
        reduced = allreduce != "none" and item.kind == "saved_model"  # TF1 and GraphDef outputs: one process
        pipeline = default_pipeline(has_training, reduced, **given)
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

    Serving is micro-batched in slices of ``vnode_batch`` examples (microbatch-inference's
    option, checked by its declaration), or of the training rewrite's b when the model records
    one; a model whose serving is already micro-batched keeps its slices; with no slice size
    known, the serving functions are kept as they are. The input is
    not changed; the output is written atomically (an existing version only with ``force``).
    ``imports``: :func:`load`'s, for a .keras file with custom layers."""
    from vfgraph.io import serving

    (slices,) = [f for f in flags([MicrobatchInferencePass]) if f.dest == "vnode_batch"]
    refused = slices.problem(vnode_batch)  # (microbatch-inference's check, as 'vfgraph rewrite --vnode-batch')
    if refused is not None:
        raise InputError(f"{slices.flag} {vnode_batch}: {refused.problem}")
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
