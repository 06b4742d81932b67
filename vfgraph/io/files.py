"""Reading the files vfgraph is given or wrote: every failure is one line naming the file.

Bytes of any file, and GraphDefs (``.pb`` binary, ``.pbtxt`` text) with the mark of one that
:mod:`vfgraph.io.graphdef` wrote. TensorFlow's protobufs are imported when a GraphDef is read,
so this module, and :mod:`vfgraph.io.outputs` which recognises vfgraph's GraphDefs through it,
import without TensorFlow.
"""
from __future__ import annotations

import errno
import os
from typing import TYPE_CHECKING

from vfgraph.errors import InputError

if TYPE_CHECKING:
    from tensorflow.core.framework import graph_pb2

GRAPH_FUNCTION = "__vf_graph"  # the library function a GraphDef's graph becomes
GRAPH_CALL = "vf/graph"  # the node of a GraphDef vfgraph wrote that calls it


def check_readable(path: str, missing_ok: bool = False) -> None:
    """``path`` exists and this process can read it: a file it can open, a directory (a
    SavedModel, a checkpoint's) whose every directory it can list and every file it can open.
    A path that exists but cannot be read, or sits in a directory this process cannot enter,
    is "permission denied" with the path that denies it; one that does not exist is "no such
    file or directory" (unless ``missing_ok``)."""
    try:
        os.stat(path)
    except OSError as e:
        if e.errno in (errno.EACCES, errno.EPERM):
            raise _denied(path, _first_denied_parent(path)) from None
        if missing_ok:
            return
        raise InputError(f"{path}: no such file or directory") from None
    for k, (p, is_dir) in enumerate(_tree(path)):
        if k == _MOST_CHECKED:  # not a model's tree (a home directory given by mistake): the loader says what
            break
        try:
            if is_dir:
                os.listdir(p)
            else:
                os.close(os.open(p, os.O_RDONLY))
        except PermissionError:
            raise _denied(path, p) from None
        except OSError:  # gone meanwhile, a dangling link: the loader names it
            pass


_MOST_CHECKED = 10000  # entries of an input's tree checked for reading


def _tree(path: str):
    """(path, is a directory) of ``path`` and, for a directory, everything under it."""
    yield path, os.path.isdir(path)
    if os.path.isdir(path):
        for root, dirs, files in os.walk(path):
            for d in sorted(dirs):
                yield os.path.join(root, d), True
            for f in sorted(files):
                yield os.path.join(root, f), False


def _first_denied_parent(path: str) -> str:
    """The outermost directory on ``path``'s way this process cannot enter (or ``path``)."""
    parts = os.path.abspath(path).split(os.sep)
    for k in range(2, len(parts) + 1):
        p = os.sep.join(parts[:k])
        try:
            os.stat(p)
        except PermissionError:
            return os.sep.join(parts[:k - 1]) or os.sep
        except OSError:
            break
    return path


def _denied(path: str, where: str) -> InputError:
    inside = "" if where == path else f" ({where} cannot be read)"
    return InputError(f"{path}: permission denied{inside}; give this user read access (e.g. chmod -R a+rX on it), or "
                      "run vfgraph as a user who can read it")


def read_bytes(path: str) -> bytes:
    try:
        with open(path, "rb") as f:
            return f.read()
    except OSError as e:
        raise InputError(f"{path}: cannot read ({e.strerror})") from None


def read_graph_def(path: str) -> "graph_pb2.GraphDef":
    """Parse a GraphDef file: text for ``.pbtxt``, otherwise binary."""
    from google.protobuf import text_format
    from google.protobuf.message import DecodeError
    from tensorflow.core.framework import graph_pb2

    gd = graph_pb2.GraphDef()
    data = read_bytes(path)
    try:
        if path.endswith(".pbtxt"):
            text_format.Parse(data.decode("utf-8"), gd)
        else:
            gd.ParseFromString(data)
    except (DecodeError, text_format.ParseError, UnicodeDecodeError, RuntimeError, ValueError) as e:
        raise InputError(f"{path}: not a GraphDef ({str(e)[:200]}); give a frozen graph (.pb or .pbtxt)") from None
    if not gd.node:
        raise InputError(f"{path}: the GraphDef has no nodes")
    return gd


def emitted_by_vfgraph(path: str) -> bool:
    """Whether the file at ``path`` is a GraphDef ``save_graph_def`` wrote (one call of the
    rewritten graph function, named ``vf/graph``)."""
    try:
        gd = read_graph_def(path)
    except InputError:
        return False
    return any(n.name == GRAPH_CALL and n.attr["f"].func.name == GRAPH_FUNCTION for n in gd.node)
