"""Run an original and a rewritten model on the same inputs and compare (numeric checks)."""
from __future__ import annotations

import re
from dataclasses import dataclass, field
from typing import Dict, List, Optional, Tuple

import numpy as np

from vfgraph.errors import InputError


def _spec_shape(spec, batch: int) -> List[int]:
    return [batch if d is None else d for d in spec.shape.as_list()]


def make_inputs(fn, batch: int, seed: int = 0) -> Dict[str, np.ndarray]:
    """Random inputs for a signature: floats ~N(0,1), integers in [0, 10)."""
    rng = np.random.default_rng(seed)
    _, kwargs = fn.structured_input_signature
    out = {}
    for key in sorted(kwargs):
        spec = kwargs[key]
        shape = _spec_shape(spec, batch)
        dt = spec.dtype.as_numpy_dtype
        if spec.dtype.is_floating:
            out[key] = rng.normal(size=shape).astype(dt)
        elif spec.dtype.is_integer:
            out[key] = rng.integers(0, 10, size=shape).astype(dt)
        elif spec.dtype.is_bool:
            out[key] = rng.integers(0, 2, size=shape).astype(bool)
        else:
            raise InputError(f"signature input {key!r} has dtype {spec.dtype.name}; give inputs with --data")
    return out


def variable_values(fn) -> Dict[str, np.ndarray]:
    return {v.name: v.numpy() for v in fn.variables}


@dataclass
class Report:
    serving: Dict[str, float] = field(default_factory=dict)      # signature -> max abs output error
    loss: List[tuple] = field(default_factory=list)              # (step, original, rewritten)
    params: Dict[str, float] = field(default_factory=dict)       # variable -> max relative difference

    @property
    def worst_param(self) -> float:
        return max(self.params.values(), default=0.0)

    @property
    def worst_output(self) -> float:
        return max(self.serving.values(), default=0.0)


SCALE_FLOOR = 1e-3


def rel_diff(a: np.ndarray, b: np.ndarray) -> float:
    """Largest difference relative to the parameter's magnitude, floored at ``SCALE_FLOOR``:
    parameters whose gradient is mathematically zero (an attention key bias stays ~1e-11)
    are compared absolutely instead of amplifying rounding noise."""
    a = np.asarray(a, np.float64)
    b = np.asarray(b, np.float64)
    scale = max(float(np.max(np.abs(a))) if a.size else 0.0, SCALE_FLOOR)
    return float(np.max(np.abs(a - b)) / scale) if a.size else 0.0


def _shape(shape) -> str:
    """A TensorShape as users read it: ``[None, 64]``, or ``unknown`` for an unknown rank."""
    return str(shape.as_list()) if shape.rank is not None else "unknown"


def _spec_text(spec) -> str:
    return f"{spec.dtype.name} {_shape(spec.shape)}"


def _inputs(fn) -> Dict[str, object]:
    """Input name -> TensorSpec of a signature function."""
    return dict(fn.structured_input_signature[1])


def _outputs(fn) -> Dict[str, object]:
    """Output name -> TensorSpec of a signature function (a single unnamed output as ``output_0``)."""
    out = fn.structured_outputs
    return dict(out) if isinstance(out, dict) else {"output_0": out}


def _listed(names, limit: int = 3) -> str:
    names = list(names)
    return ", ".join(names[:limit]) + (f", ... ({len(names) - limit} more)" if len(names) > limit else "")


COUNT_MAX = 2 ** 31 - 1  # steps and examples per step: an int32 in the graphs that run them


def _check_counts(steps: int, batch: int) -> None:
    """The steps and the batch size of a comparison: whole numbers from 1 to :data:`COUNT_MAX`."""
    for flag, n, what in (("--steps", steps, "training steps to compare"),
                          ("--batch-size", batch, "examples per step")):
        if isinstance(n, bool) or not isinstance(n, int) or not 1 <= n <= COUNT_MAX:
            raise InputError(f"{flag} {n}: give the {what}, a whole number from 1 to {COUNT_MAX}")


def _load(path: str):
    from vfgraph.io.savedmodel import is_saved_model_dir, load_to_run

    if not is_saved_model_dir(path):
        raise InputError(f"{path}: not a SavedModel directory")
    return load_to_run(path)


def _compared_signatures(a, b, original: str, rewritten: str, train_signature: str) -> Tuple[List[str], bool]:
    """The serving signatures to compare and whether the training signature is compared. Every
    signature of the original must be in the rewrite (a rewrite adds signatures, it removes none)."""
    missing = sorted(k for k in a.signatures if k not in b.signatures)
    if missing:
        raise InputError(f"{original} and {rewritten} are not the same model: signatures {missing} of {original} "
                         f"are not in {rewritten} (it has: {', '.join(sorted(b.signatures)) or 'none'}); "
                         "give the model and its rewrite")
    serving = sorted(k for k in a.signatures if k != train_signature)
    return serving, train_signature in a.signatures


def _check_signature(key: str, fa, fb, original: str, rewritten: str, outputs: bool) -> None:
    """Both models' ``key`` take the same inputs (names, dtypes, compatible shapes) and, for a
    serving signature (``outputs``), return outputs of the same names, dtypes and compatible shapes."""
    head = f"{original} and {rewritten} are not the same model: signature {key!r}"
    tail = "; give the model and its rewrite"
    checks = [("input", _inputs(fa), _inputs(fb))]
    if outputs:
        checks.append(("output", _outputs(fa), _outputs(fb)))
    for what, sa, sb in checks:
        if set(sa) != set(sb):
            raise InputError(f"{head} has {what}s {sorted(sa)} in {original} but {sorted(sb)} in {rewritten}{tail}")
        for name in sorted(sa):
            x, y = sa[name], sb[name]
            if x.dtype != y.dtype or not x.shape.is_compatible_with(y.shape):
                raise InputError(f"{head} {what} {name!r} is {_spec_text(x)} in {original} but {_spec_text(y)} "
                                 f"in {rewritten}{tail}")


def _variables(fns) -> Dict[str, List[object]]:
    """Variable name -> the shapes of the variables of that name captured by ``fns``."""
    seen, out = set(), {}
    for fn in fns:
        for v in fn.variables:
            if id(v) not in seen:
                seen.add(id(v))
                out.setdefault(v.name, []).append(v.shape)
    return out


def _check_variables(va: Dict[str, List[object]], vb: Dict[str, List[object]], original: str, rewritten: str) -> None:
    """Every variable of the original is in the rewrite, by name, with a compatible shape. The
    rewrite may hold more (gradient accumulators)."""
    only_a = [n for n in sorted(va) if n not in vb]
    differ = [f"{n} {_shape(va[n][0])} vs {', '.join(_shape(s) for s in vb[n])}" for n in sorted(va)
              if n in vb and not all(any(x.is_compatible_with(y) for y in vb[n]) for x in va[n])]
    if not only_a and not differ:
        return
    parts = differ[:3] + ([f"... ({len(differ) - 3} more of other shapes)"] if len(differ) > 3 else [])
    if only_a:
        only_b = sum(1 for n in vb if n not in va)
        parts.append(f"{len(only_a)} only in {original}: {_listed(only_a)}")
        if only_b:
            parts.append(f"{only_b} only in {rewritten}")
    raise InputError(f"{original} and {rewritten} are not the same model: variables differ ({'; '.join(parts)}); "
                     "give the model and its rewrite")


def _rows(spec, batch: int) -> Optional[int]:
    """Examples one call feeds for an input: its static leading dimension, else ``batch``; None
    for a scalar input (fed whole)."""
    dims = spec.shape.as_list() if spec.shape.rank is not None else [None]
    if not dims:
        return None
    return dims[0] if dims[0] is not None else batch


def _fed_batch(fn, batch: int) -> int:
    return next((r for r in (_rows(s, batch) for _, s in sorted(_inputs(fn).items())) if r is not None), batch)


def _check_vnode_batch(path: str, signature: str, fed: int, batch: int) -> None:
    """The fed batch splits into whole virtual nodes of ``path``'s ``signature`` (a rewrite
    checks it at run time, deep inside TensorFlow; this names the option to change instead)."""
    from vfgraph.runtime.train import check_batch

    what = f"--batch-size {fed}" if fed == batch else f"the static batch {fed} of signature {signature!r}"
    check_batch(path, signature, fed, what)


def _check_data(data: Dict[str, np.ndarray], key: str, fn, batch: int) -> None:
    """``data`` holds every input of signature ``key`` with its dtype and feature shape, one row
    per example in each array and at least one batch of rows."""
    specs = _inputs(fn)
    takes = ", ".join(f"{k} {_spec_text(s)}" for k, s in sorted(specs.items()))
    where = f"signature {key!r} takes {takes}"
    lengths = {}
    for k, spec in sorted(specs.items()):
        if k not in data:
            raise InputError(f"--data: no array {k!r}; {where} (the data has: {', '.join(sorted(data)) or 'nothing'})")
        arr = np.asarray(data[k])
        want = spec.dtype.as_numpy_dtype
        if not np.can_cast(arr.dtype, want, casting="same_kind"):
            raise InputError(f"--data: array {k!r} holds {arr.dtype}; {where}: give {k} as {np.dtype(want).name}")
        rows = _rows(spec, batch)
        features = spec.shape[1:] if spec.shape.rank else spec.shape
        if rows is None:
            ok = arr.ndim == 0
        else:
            ok = arr.ndim >= 1 and features.is_compatible_with(arr.shape[1:])
        if not ok:
            shape = _shape(spec.shape).replace("None", "N", 1) if rows is not None else "[]"
            raise InputError(f"--data: array {k!r} has shape {list(arr.shape)}; {where}: give an array of shape "
                             f"{shape}")
        if rows is None:
            continue
        if len(arr) < rows:
            per = f"--batch-size {batch}" if rows == batch else f"its static batch of {rows}"
            raise InputError(f"--data: array {k!r} has {len(arr)} rows; signature {key!r} takes {rows} per call "
                             f"({per}): give at least {rows} rows, or a smaller --batch-size")
        lengths[k] = len(arr)
    if len(set(lengths.values())) > 1:
        raise InputError(f"--data: arrays have different numbers of rows "
                         f"({', '.join(f'{k} {n}' for k, n in lengths.items())}); give one row per example in each")


def _feed(fn, batch: int, step: int, data: Optional[Dict[str, np.ndarray]]) -> Dict[str, np.ndarray]:
    """The inputs of call ``step``: random ones (seeded by the step), or the ``step``-th block of
    rows of ``data``, cycling when the data holds fewer blocks than steps."""
    if data is None:
        return make_inputs(fn, batch, seed=step)
    specs = _inputs(fn)
    rows = {k: _rows(s, batch) for k, s in specs.items()}
    blocks = min((len(data[k]) // r for k, r in rows.items() if r), default=1)
    out = {}
    for k, spec in specs.items():
        arr = np.asarray(data[k]).astype(spec.dtype.as_numpy_dtype, copy=False)
        r = rows[k]
        out[k] = arr if r is None else arr[(step % blocks) * r:(step % blocks + 1) * r]
    return out


_VFGRAPH_LINE = re.compile(r"^(?:\s*assertion failed: \[)?(vfgraph: [^\]\n]*)", re.MULTILINE)


def _call(fn, inputs: Dict[str, np.ndarray], path: str, key: str):
    """Run a signature; a check of a rewritten graph that fails (its message has a line starting
    ``vfgraph: ``) is reported as the user's input error, with that line."""
    import tensorflow as tf

    try:
        return fn(**inputs)
    except tf.errors.InvalidArgumentError as e:
        m = _VFGRAPH_LINE.search(e.message or "")
        if not m:
            raise
        raise InputError(f"{path}: signature {key!r}: {m.group(1).strip()}") from None


def _max_abs_diff(key: str, ra, rb, original: str, rewritten: str) -> float:
    worst = 0.0
    for k in ra:
        x, y = ra[k].numpy(), rb[k].numpy()
        if x.shape != y.shape:
            raise InputError(f"{original} and {rewritten} are not the same model: signature {key!r} output {k!r} has "
                             f"shape {list(x.shape)} from {original} but {list(y.shape)} from {rewritten}; "
                             "give the model and its rewrite")
        if x.size:  # numbers: the largest difference; anything else (strings, booleans): 1 if any differs
            worst = max(worst, float(np.max(np.abs(x - y))) if x.dtype.kind in "fiuc" else float(np.any(x != y)))
    return worst


def compare_models(original: str, rewritten: str, steps: int = 3, batch: int = 32,
                   data: Optional[Dict[str, np.ndarray]] = None, train_signature: str = "train") -> Report:
    """Serving outputs on the same inputs; for training, ``steps`` steps on the same batches.

    Inputs are random (seeded), or blocks of ``batch`` rows of ``data`` (arrays named like the
    signatures' inputs). What cannot be compared is refused up front with an :class:`InputError`
    naming it: models whose signatures or variables differ, a batch that does not split into the
    rewrite's virtual nodes, data that does not fit the signatures."""
    _check_counts(steps, batch)
    a, b = _load(original), _load(rewritten)
    serving, train = _compared_signatures(a, b, original, rewritten, train_signature)
    for key in serving + ([train_signature] if train else []):
        _check_signature(key, a.signatures[key], b.signatures[key], original, rewritten, outputs=key in serving)
    compared = [a.signatures[k] for k in serving + ([train_signature] if train else [])]
    _check_variables(_variables(compared), _variables(b.signatures.values()), original, rewritten)
    if train:
        fed = _fed_batch(a.signatures[train_signature], batch)
        for path in (original, rewritten):
            _check_vnode_batch(path, train_signature, fed, batch)
    if data is not None:
        for key in serving + ([train_signature] if train else []):
            _check_data(data, key, a.signatures[key], batch)

    report = Report()
    for key in serving:
        inputs = _feed(a.signatures[key], batch, 0, data)
        ra = _call(a.signatures[key], inputs, original, key)
        rb = _call(b.signatures[key], inputs, rewritten, key)
        report.serving[key] = _max_abs_diff(key, ra, rb, original, rewritten)
    if train:
        fa, fb = a.signatures[train_signature], b.signatures[train_signature]
        for step in range(steps):
            inputs = _feed(fa, batch, step, data)
            la = _call(fa, inputs, original, train_signature)
            lb = _call(fb, inputs, rewritten, train_signature)
            report.loss.append((step, float(la["loss"]) if "loss" in la else None,
                                float(lb["loss"]) if "loss" in lb else None))
        va, vb = variable_values(fa), variable_values(fb)
        for name in sorted(va):
            if name in vb and va[name].dtype.kind == "f":
                report.params[name] = rel_diff(va[name], vb[name])
    return report
