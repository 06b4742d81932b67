"""vfgraph: a graph-rewriting compiler that makes exported TensorFlow models hardware-independent."""
__version__ = "0.1.0"

from vfgraph.api import load, rewrite, save, verify  # noqa: E402
from vfgraph.errors import VfgraphError  # noqa: E402

__all__ = ["__version__", "load", "rewrite", "save", "verify", "VfgraphError"]

from vfgraph import ops as _ops  # noqa: E402

_ops.register_at_import()  # graphs with vfgraph's MPI ops load once vfgraph is imported
