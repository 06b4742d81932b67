"""The graph IR: a mutable view over GraphDef / FunctionDef bodies."""
from vfgraph.ir.graph import FunctionGraph, TensorRef, parse_input

__all__ = ["FunctionGraph", "TensorRef", "parse_input"]
