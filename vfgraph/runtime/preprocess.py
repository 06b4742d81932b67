"""The user's own decoding and augmentation of each training example (``--input-fn
MODULE:FUNCTION``): :class:`InputFn` imports the function, :class:`Preprocessor` runs it on
the examples of a rank's rows, in a small pool of threads (the input workers), and checks what
it returns.

The contract (docs/data.md, "Your own decoding"): ``FUNCTION(features, rng)`` takes one
example's raw features and a ``numpy.random.Generator`` and returns a dict of the training
signature's inputs for that example (name -> value of the input's per-example shape).

- ``features``: for a ``tf.train.Example`` record (TFRecord or ArrayRecord), each of its
  features by name as a 1-D numpy array of its values, of the feature's own kind:
  ``bytes_list`` -> an object array of ``bytes``, ``float_list`` -> float32, ``int64_list``
  -> int64 (an empty feature: an empty float32 array). The records are read as they are, with
  no schema: whatever features a record holds, the function gets. For an .npz file: each
  array's row of the example.
- ``rng``: ``numpy.random.default_rng([seed, step, index])`` for ``--seed``, the step and
  the example's index in the data: the same augmentation of an example at a step on every
  layout of ranks, whichever thread of whichever rank runs it.
"""
from __future__ import annotations

import hashlib
import importlib
import importlib.util
import os
import sys
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass
from typing import Callable, Dict, List, Optional, Union

import numpy as np

from vfgraph.errors import InputError

WORKERS = 4  # input worker threads at most (and the host's CPUs at most)


def example_rng(seed: int, step: int, index: int) -> np.random.Generator:
    """The random generator of example ``index`` at step ``step`` of a run with ``--seed seed``."""
    return np.random.default_rng([seed, step, index])


@dataclass(frozen=True)
class InputFn:
    """The user's function (``fn``) and how it was named (``name``: ``MODULE:FUNCTION``)."""

    fn: Callable
    name: str

    @classmethod
    def resolve(cls, given: Union[str, Callable, None]) -> Optional["InputFn"]:
        """``given`` imported: ``MODULE:FUNCTION`` (``MODULE`` a module importable from the
        working directory or ``sys.path``, or the path of a ``.py`` file) or a callable; one line
        for a name that is not of that form, a module that does not import, a missing function."""
        if given is None or given == "":
            return None
        if callable(given):
            qualname = getattr(given, "__qualname__", None) or type(given).__qualname__  # (not a repr: an address
            return cls(given, f"{getattr(given, '__module__', None) or '?'}:{qualname}")  # differs between ranks)
        if not isinstance(given, str) or given.count(":") != 1 or not all(given.split(":")):
            raise InputError(f"--input-fn {given}: give MODULE:FUNCTION (a module name or a .py file, and the name "
                             "of a function in it), e.g. my_input.py:decode")
        module_name, function = given.split(":")
        module = _import(module_name, given)
        fn = getattr(module, function, None)
        if fn is None or not callable(fn):
            has = sorted(k for k, v in vars(module).items() if callable(v) and not k.startswith("_")
                         and getattr(v, "__module__", None) == module.__name__)
            what = "no function" if fn is None else "a value that is not a function named"
            raise InputError(f"--input-fn {given}: {getattr(module, '__file__', module_name)} has {what} "
                             f"{function!r} (its functions: {', '.join(has) or 'none'})")
        return cls(fn, given)


def _import(module_name: str, given: str):
    """The module ``module_name`` (a dotted name, or a .py file's path) of --input-fn ``given``."""
    try:
        if module_name.endswith(".py") or os.sep in module_name:
            if not os.path.isfile(module_name):
                raise InputError(f"--input-fn {given}: no such file {module_name}")
            path = os.path.abspath(module_name)  # (one module per file, whatever other files are named)
            name = f"vfgraph_input_fn_{hashlib.sha1(path.encode()).hexdigest()[:12]}"
            if name in sys.modules:
                return sys.modules[name]
            spec = importlib.util.spec_from_file_location(name, path)
            module = importlib.util.module_from_spec(spec)
            sys.modules[name] = module
            try:
                spec.loader.exec_module(module)
            except BaseException:
                del sys.modules[name]
                raise
            return module
        if os.getcwd() not in sys.path and "" not in sys.path:  # (as `python -m` would find it)
            sys.path.insert(0, os.getcwd())
        return importlib.import_module(module_name)
    except InputError:
        raise
    except ModuleNotFoundError as e:
        if e.name and module_name.startswith(e.name):
            raise InputError(f"--input-fn {given}: no module named {module_name!r} in the working directory or on "
                             "the Python path; give a module name or the path of a .py file") from None
        raise InputError(f"--input-fn {given}: importing {module_name} failed: {_said(e)}") from None
    except Exception as e:  # (the user's module raised while importing)
        raise InputError(f"--input-fn {given}: importing {module_name} failed: {_said(e)}") from None


def _said(e: BaseException) -> str:
    first = str(e).strip().splitlines()[0] if str(e).strip() else ""
    return f"{type(e).__name__}: {first[:300]}" if first else type(e).__name__


def raw_features(record: bytes) -> Dict[str, np.ndarray]:
    """The features of a serialized ``tf.train.Example``, by name, as 1-D arrays of their kind."""
    from tensorflow.core.example import example_pb2

    example = example_pb2.Example.FromString(record)
    out = {}
    for name, feature in example.features.feature.items():
        kind = feature.WhichOneof("kind")
        if kind == "bytes_list":
            values = np.empty(len(feature.bytes_list.value), dtype=object)
            values[:] = list(feature.bytes_list.value)
            out[name] = values
        elif kind == "int64_list":
            out[name] = np.asarray(feature.int64_list.value, dtype=np.int64)
        else:
            out[name] = np.asarray(feature.float_list.value if kind else [], dtype=np.float32)
    return out


class Preprocessor:
    """Runs ``input_fn`` on examples for the inputs ``specs`` (name -> TensorSpec) of
    ``signature``, in ``workers`` threads; ``where(index)`` names example ``index`` in the data."""

    def __init__(self, input_fn: InputFn, specs, signature: str, seed: int, where: Callable[[int], str],
                 workers: Optional[int] = None):
        self.input_fn, self.specs, self.signature, self.seed, self.where = input_fn, specs, signature, seed, where
        self.workers = workers or max(1, min(WORKERS, os.cpu_count() or 1))
        self.pool = ThreadPoolExecutor(self.workers, thread_name_prefix="vfgraph-input-fn")

    def examples(self, items: list, indices: np.ndarray, step: int) -> List[Dict[str, np.ndarray]]:
        """The function's output for each of ``items`` (serialized records, or an .npz file's
        rows as dicts), the examples ``indices`` of the data, at ``step``; in order. A failure is
        that of the first example that fails (the same on every run)."""
        chunks = np.array_split(np.arange(len(items)), min(self.workers, max(1, len(items))))

        def run(chunk):
            return [self.one(items[i], int(indices[i]), step) for i in chunk]

        return [out for part in self.pool.map(run, chunks) for out in part]

    def one(self, item, index: int, step: int) -> Dict[str, np.ndarray]:
        """The function's output for example ``index`` (``item``: its record or its row), checked."""
        name = self.input_fn.name
        if isinstance(item, bytes):
            try:
                item = raw_features(item)
            except Exception as e:  # (protobuf's DecodeError)
                raise InputError(f"{self.where(index)}: not a tf.train.Example ({_said(e)}); --input-fn {name} "
                                 "reads tf.train.Example records: write the records as such") from None
        try:
            out = self.input_fn.fn(item, example_rng(self.seed, step, index))
        except Exception as e:
            raise InputError(f"--input-fn {name} raised {_said(e)} on example {index} ({self.where(index)}); fix the "
                             "function (it gets the example's features by name and a numpy Generator)") from None
        return self.checked(out, index)

    def checked(self, out, index: int) -> Dict[str, np.ndarray]:
        """``out`` (example ``index``'s) as arrays: the signature's inputs, of their per-example shapes."""
        name, specs = self.input_fn.name, self.specs
        if not isinstance(out, dict):
            raise InputError(f"--input-fn {name} returned a {type(out).__name__} for example {index} "
                             f"({self.where(index)}); return a dict of the {self.signature!r} signature's inputs "
                             f"{sorted(specs)}")
        missing, extra = sorted(set(specs) - set(out)), sorted(set(out) - set(specs), key=str)
        if missing or extra:
            said = "; ".join(s for s in (f"misses {missing}" if missing else "", f"has {extra}, which the signature "
                                         "does not take" if extra else "") if s)
            raise InputError(f"--input-fn {name} returned {sorted(out, key=str)} for example {index} "
                             f"({self.where(index)}): it {said}; return the {self.signature!r} signature's inputs "
                             f"{sorted(specs)}")
        arrays = {}
        for k in sorted(specs):
            arr, want = np.asarray(out[k]), specs[k].shape[1:]
            if want.rank is not None and (arr.ndim != want.rank or not want.is_compatible_with(arr.shape)):
                shown = [d if d is not None else -1 for d in want.as_list()]
                raise InputError(f"--input-fn {name} returned {k!r} of shape {list(arr.shape)} for example {index} "
                                 f"({self.where(index)}); the {self.signature!r} signature takes examples of shape "
                                 f"{shown} (one example, without the batch dimension)")
            arrays[k] = arr
        return arrays
