"""vfgraph: a graph-rewriting compiler that makes exported TensorFlow models hardware-independent.

``import vfgraph`` is light: the API (:func:`load`, :func:`rewrite`, :func:`save`, :func:`verify`,
:func:`export`) imports TensorFlow on first use, and vfgraph's MPI ops are registered as soon as
TensorFlow is imported (now, if it already is), so graphs that contain them load with
``tf.saved_model.load``.
"""
from __future__ import annotations

import importlib.abc
import importlib.util
import sys

from vfgraph.errors import VfgraphError

__version__ = "0.1.0"
__all__ = ["__version__", "load", "rewrite", "save", "verify", "export", "VfgraphError"]
_API = ("load", "rewrite", "save", "verify", "export")


def __getattr__(name: str):
    if name in _API:
        from vfgraph import api

        return getattr(api, name)
    raise AttributeError(f"module 'vfgraph' has no attribute {name!r}")


def _register_ops() -> None:
    from vfgraph import ops

    ops.register_at_import()


class _AfterTensorFlow(importlib.abc.MetaPathFinder):
    """Registers vfgraph's ops right after ``tensorflow`` finishes importing."""

    def find_spec(self, name, path=None, target=None):
        if name != "tensorflow":
            return None
        sys.meta_path.remove(self)
        spec = importlib.util.find_spec(name)
        if spec is None or spec.loader is None or not hasattr(spec.loader, "exec_module"):
            return spec
        run = spec.loader.exec_module

        def exec_module(module):
            run(module)
            _register_ops()

        spec.loader.exec_module = exec_module
        return spec


if "tensorflow" in sys.modules:
    _register_ops()
elif not any(isinstance(f, _AfterTensorFlow) for f in sys.meta_path):
    sys.meta_path.insert(0, _AfterTensorFlow())
