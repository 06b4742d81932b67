"""Reading the files vfgraph is given or wrote: every failure is one line naming the file.

Bytes of any file, and GraphDefs (``.pb`` binary, ``.pbtxt`` text) with the mark of one that
:mod:`vfgraph.io.graphdef` wrote. TensorFlow's protobufs are imported when a GraphDef is read,
so this module, and :mod:`vfgraph.io.outputs` which recognises vfgraph's GraphDefs through it,
import without TensorFlow.
"""
from __future__ import annotations

from typing import TYPE_CHECKING

from vfgraph.errors import InputError

if TYPE_CHECKING:
    from tensorflow.core.framework import graph_pb2

GRAPH_FUNCTION = "__vf_graph"  # the library function a GraphDef's graph becomes
GRAPH_CALL = "vf/graph"  # the node of a GraphDef vfgraph wrote that calls it


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
