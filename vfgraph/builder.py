"""The names passes wrote functions with before the function IR (vfgraph.ir) held them:
references as strings."""
from __future__ import annotations

from vfgraph.ir.attrs import func_attr, shape_proto, shapes_attr, tensor_attr, type_attr, types_attr  # noqa: F401
from vfgraph.ir.blocks import I32, batch_size, check, list_concat, slice_rows, zeros  # noqa: F401
from vfgraph.ir.graph import FunctionGraph
from vfgraph.ir.graph import Node as _Node
from vfgraph.ir.tracing import annotate_shapes, arg_specs, tf_dtype  # noqa: F401


class Node(_Node):
    __slots__ = ("_strs",)

    def __getitem__(self, k):
        return self.outputs()[k]

    def outputs(self):
        try:
            return self._strs
        except AttributeError:
            self._strs = [str(r) for r in super().outputs()]
            return self._strs


class _StrGraph(FunctionGraph):
    _node_class = Node

    def arg(self, *a, **k):
        return str(super().arg(*a, **k))

    def args_of(self, fdef):
        return [str(r) for r in super().args_of(fdef)]


class FunctionBuilder:
    def __new__(cls, name, library=None, into=None):
        return _StrGraph.new(name, library, into)

    like = staticmethod(_StrGraph.like)


def extract_function(g, name, outputs, new_args=(), keep_args=None, drop=frozenset(), side_effects=False, into=None):
    return g.outline(name, outputs, new_args, keep_args, drop, side_effects, into)
