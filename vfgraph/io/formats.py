"""The model formats vfgraph reads, in one ordered list: how each is recognised and read.

:func:`load` is the one way in: it checks the path can be read and the options' own rules,
asks each format in turn whether the path is one of its (``sniff``: by name and content, never
raising), and lets the first that says yes read it. An option a format does not read is refused
(it would be silently ignored), naming the option and the format; a path no format recognises
is refused with the list of formats. A new format is one :class:`Format` in :data:`_FORMATS`
(or given to :func:`register`), nothing else: ``vfgraph.load`` and every command that loads a
model read it from here.

The order matters where two formats could claim one path: a ``.keras`` file is recognised by
its content whatever its name; a directory with both ``saved_model.pb`` and a ``checkpoint``
file is a SavedModel; a ``.pbtxt`` holding a SavedModel is not read as a GraphDef.
"""
from __future__ import annotations

import os
from dataclasses import dataclass
from typing import Callable, Dict, List, Optional, Sequence, Tuple, Union

from vfgraph.errors import InputError
from vfgraph.io import files, graphdef, keras_file, metagraph, savedmodel
from vfgraph.item import GraphItem


def _not_read(flag: str, what: str) -> Callable[[str, str], InputError]:
    return lambda path, kind: InputError(f"{path}: {flag} names {what}, and this is {kind}; leave it out")


# load options a format may not read -> the error for one given to a format that does not read it
# (path, the format's kind); any other option is read where it applies and otherwise left alone
# (imports; a label without a loss)
_REFUSED: Dict[str, Callable[[str, str], InputError]] = {
    "keras_loss": lambda path, kind: keras_file.fine_tune_refused(path),  # (the optimizer comes with it)
    "outputs": _not_read("--outputs", "a frozen GraphDef's output tensors"),
    "checkpoint": _not_read("--checkpoint", "a TF1 MetaGraphDef's checkpoint"),
    "loss": _not_read("--loss", "a TF1 MetaGraphDef's loss tensor"),
}
FINE_TUNE_OPTIONS = ("keras_loss", "keras_optimizer", "label")  # read together, given with a loss


@dataclass(frozen=True)
class Format:
    """One model format: ``name`` (short, unique), ``description`` (what the user gives, for
    messages: "a frozen GraphDef (.pb, .pbtxt)"), ``kind`` (what the model is, for messages:
    "a frozen GraphDef"), ``sniff(path)`` (whether ``path`` is one; never raises),
    ``reader(path, **options)`` (the item; given only the options named in ``reads``)."""

    name: str
    description: str
    kind: str
    sniff: Callable[[str], bool]
    reader: Callable[..., GraphItem]
    reads: Tuple[str, ...] = ()

    def load(self, path: str, **options) -> GraphItem:
        """The model at ``path`` (one of this format's), read with ``options``: a load option
        this format does not read is refused when given."""
        for name, refusal in _REFUSED.items():
            if options.get(name) and name not in self.reads:
                raise refusal(path, self.kind)
        return self.reader(path, **{k: v for k, v in options.items() if k in self.reads})


def _keras(path: str, imports: Sequence[str] = ()) -> GraphItem:
    return keras_file.load_keras_file(path, imports)


def _saved_model(path: str, imports: Sequence[str] = (), keras_loss: str = "", keras_optimizer: str = "",
                 label: str = "label") -> GraphItem:
    if keras_loss:
        return keras_file.fine_tuned(path, keras_loss, keras_optimizer, label, imports)
    return savedmodel.load_saved_model(path)


def _meta_graph(path: str, checkpoint: Optional[Union[str, os.PathLike]] = None, loss: str = "") -> GraphItem:
    return metagraph.load_meta_graph(path, os.fspath(checkpoint) if checkpoint else None, loss)


_FORMATS: List[Format] = [
    Format("keras", "a Keras 3 .keras file", "a Keras file", keras_file.is_keras_file, _keras, ("imports",)),
    Format("saved-model", "a SavedModel directory", "a SavedModel", savedmodel.is_saved_model_dir, _saved_model,
           ("imports",) + FINE_TUNE_OPTIONS),
    Format("tf1", "a TF1 MetaGraphDef (.meta, or its checkpoint directory) with its checkpoint",
           "a TF1 MetaGraphDef", metagraph.is_meta_graph, _meta_graph, ("checkpoint", "loss")),
    Format("saved-model-text", "a SavedModel in protobuf text form (.pbtxt, no variables)", "a SavedModel",
           savedmodel.is_saved_model_text, savedmodel.load_saved_model_text),
    Format("graph-def", "a frozen GraphDef (.pb, .pbtxt)", "a frozen GraphDef", graphdef.is_graph_def,
           graphdef.load_graph_def, ("outputs",)),
]


def registered() -> Tuple[Format, ...]:
    """The formats vfgraph reads, in the order they are asked."""
    return tuple(_FORMATS)


def register(fmt: Format, before: Optional[str] = None) -> Format:
    """Add ``fmt`` to the formats, last or before the one named ``before``; returns it."""
    names = [f.name for f in _FORMATS]
    if fmt.name in names:
        raise ValueError(f"a format named {fmt.name!r} is registered already")
    if before is not None and before not in names:
        raise ValueError(f"no format named {before!r} (formats: {', '.join(names)})")
    _FORMATS.insert(names.index(before) if before is not None else len(_FORMATS), fmt)
    return fmt


def unregister(name: str) -> None:
    """Take the format named ``name`` off the list."""
    _FORMATS[:] = [f for f in _FORMATS if f.name != name]


def format_of(path: str) -> Optional[Format]:
    """The first format that recognises ``path``, or None."""
    return next((f for f in _FORMATS if f.sniff(path)), None)


def unknown(path: str) -> InputError:
    """The error for a path that no format recognises: the formats, in order."""
    listed = [f.description for f in _FORMATS]
    choices = ", ".join(listed[:-1]) + " or " + listed[-1] if len(listed) > 1 else "".join(listed)
    return InputError(f"{path}: not a model vfgraph can read; give {choices}")


def load(path: str, **options) -> GraphItem:
    """The model at ``path``, read by the format that recognises it (see the module's docstring).
    ``options``: ``outputs``, ``checkpoint``, ``loss``, ``imports``, ``keras_loss``,
    ``keras_optimizer``, ``label`` (:func:`vfgraph.api.load`'s)."""
    files.check_readable(path)
    keras_file.check_fine_tune_options(options.get("keras_loss", ""), options.get("keras_optimizer", ""),
                                       options.get("label", "label"))
    fmt = format_of(path)
    if fmt is None:
        if options.get("keras_loss"):
            raise keras_file.fine_tune_refused(path)
        raise unknown(path)
    return fmt.load(path, **options)

