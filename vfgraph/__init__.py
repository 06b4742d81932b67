"""vfgraph: a graph-rewriting compiler that makes exported TensorFlow models hardware-independent.

``import vfgraph`` does exactly this (it never imports TensorFlow itself):

1. It imports :mod:`vfgraph.errors` and :mod:`vfgraph.version` (``__version__``).
2. It makes the API available without importing it: :func:`load`, :func:`rewrite`,
   :func:`save`, :func:`verify` and :func:`export` come from :mod:`vfgraph.api`, which is
   imported (and with it TensorFlow) the first time one of them is looked up.
3. It arranges for vfgraph's MPI ops to be registered with TensorFlow, so that a model
   rewritten with the all-reduce loads with ``tf.saved_model.load``: at once when TensorFlow
   is imported already, else right after ``import tensorflow`` finishes, through a finder on
   ``sys.meta_path`` that takes itself off when TensorFlow is imported (and does nothing for
   any other module). Registering (:func:`vfgraph.ops.register_at_import`) loads the op
   library only if it is already built for this TensorFlow and MPI, which starts MPI through
   ``mpi4py``; it never compiles it, and does nothing when mpi4py is missing or no library is
   built. ``vfgraph build-ops`` builds the library, and so does every vfgraph command or pass
   that needs the ops (``vfgraph rewrite`` with the all-reduce, ``vfgraph train`` under MPI,
   :func:`vfgraph.ops.load`).
"""
from __future__ import annotations

import importlib.abc
import importlib.util
import sys

from vfgraph.errors import VfgraphError
from vfgraph.version import __version__

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
    """Registers vfgraph's ops right after ``tensorflow`` finishes importing.

    It finds nothing itself: for ``tensorflow`` it returns the spec the other finders give,
    whose loader runs the registration after the module; it leaves ``sys.meta_path`` when
    that module is executed (a spec only asked for, as ``importlib.util.find_spec`` does to
    see whether TensorFlow is installed, leaves it in place)."""

    _finding = False

    def find_spec(self, name, path=None, target=None):
        if name != "tensorflow" or self._finding:
            return None
        self._finding = True
        try:
            spec = importlib.util.find_spec(name)
        finally:
            self._finding = False
        if spec is None or spec.loader is None or not hasattr(spec.loader, "exec_module"):
            return spec
        run = spec.loader.exec_module

        def exec_module(module):
            if self in sys.meta_path:
                sys.meta_path.remove(self)
            run(module)
            _register_ops()

        spec.loader.exec_module = exec_module
        return spec


if "tensorflow" in sys.modules:
    _register_ops()
elif not any(isinstance(f, _AfterTensorFlow) for f in sys.meta_path):
    sys.meta_path.insert(0, _AfterTensorFlow())
