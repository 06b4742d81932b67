"""Names: of the library functions passes add, and of what a reference names.

A reference is a string a graph holds: a GraphDef input (``node``, ``node:k``, ``^node``), a
FunctionDef input (``node:out:k``, ``arg``, ``^node``), a signature's tensor name or a
collection's entry (``node:k``). Every loader reads them through these helpers;
:func:`vfgraph.ir.graph.parse_input` parses a FunctionDef input whole, for the IR.
"""
from __future__ import annotations

import re
from typing import List

_GRAPH_TENSOR = re.compile(r"[^:^]+(:\d+)?")
_GRAPH_TENSOR_INDEXED = re.compile(r"[^:^]+:\d+")


def function_name(*parts: str) -> str:
    """A library function name built from parts (letters, digits and underscores only)."""
    return "__vf_" + "_".join(re.sub(r"[^A-Za-z0-9_]", "_", p).strip("_") for p in parts if p)


def is_control(ref: str) -> bool:
    """Whether ``ref`` is a control input (``^node``)."""
    return ref.startswith("^")


def tensor_node(ref: str) -> str:
    """The node ``ref`` refers to: ``node`` of ``node``, ``node:k``, ``node:out:k`` and ``^node``."""
    return ref.lstrip("^").partition(":")[0]


def tensor_index(name: str) -> int:
    """The output a GraphDef tensor name selects: ``k`` of ``node:k``, 0 of ``node``."""
    _, sep, index = name.partition(":")
    return int(index) if sep else 0


def tensor_name(name: str) -> str:
    """A GraphDef tensor name with its output index: ``node`` is ``node:0``."""
    return name if ":" in name else name + ":0"


def is_tensor_name(name: str, indexed: bool = False) -> bool:
    """Whether ``name`` is a GraphDef tensor name: ``node:k``, or (unless ``indexed``) ``node``
    alone; never a control input or a FunctionDef reference (``node:out:k``)."""
    return (_GRAPH_TENSOR_INDEXED if indexed else _GRAPH_TENSOR).fullmatch(name) is not None


def data_inputs(node) -> List[str]:
    """The data inputs of a NodeDef, in order (its control inputs left out)."""
    return [s for s in node.input if not s.startswith("^")]


def control_inputs(node) -> List[str]:
    """The control inputs of a NodeDef (``^node``), in order."""
    return [s for s in node.input if s.startswith("^")]


_DEVICE = re.compile(r"(?P<prefix>(/job:[A-Za-z0-9_.-]+)?(/replica:\d+)?(/task:\d+)?)"
                     r"/(device:)?(?P<type>[A-Za-z_]+):(?P<index>\d+)")


def canonical_device(text: str) -> str:
    """Device ``text`` as TensorFlow spells it (``/gpu:1`` -> ``/device:GPU:1``, a job, replica
    and task kept); ValueError when it names no single device."""
    m = _DEVICE.fullmatch(text.strip())
    if m is None:
        raise ValueError(f"device {text!r}: give a device type and index, such as /GPU:0 or /CPU:1")
    return f"{m['prefix']}/device:{m['type'].upper()}:{int(m['index'])}"
