"""vfgraph: a graph-rewriting compiler that makes exported TensorFlow models hardware-independent."""
__version__ = "0.1.0"

from vfgraph.api import load, rewrite, save, verify  # noqa: E402
from vfgraph.errors import VfgraphError  # noqa: E402

__all__ = ["__version__", "load", "rewrite", "save", "verify", "VfgraphError"]
