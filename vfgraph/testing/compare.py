"""Run an original and a rewritten model on the same inputs and compare (numeric checks)."""
from __future__ import annotations

import re
from dataclasses import dataclass, field
from typing import Dict, List, Optional, Tuple

import numpy as np

from vfgraph.errors import InputError


RANDOM_INT_HIGH = 10  # random integer inputs are in [0, RANDOM_INT_HIGH)


def _spec_shape(spec, batch: int) -> List[int]:
    return [batch if d is None else d for d in spec.shape.as_list()]


def make_inputs(fn, batch: int, seed: int = 0) -> Dict[str, np.ndarray]:
    """Random inputs for a signature: floats ~N(0,1), integers in [0, :data:`RANDOM_INT_HIGH`)."""
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
            out[key] = rng.integers(0, RANDOM_INT_HIGH, size=shape).astype(dt)
        elif spec.dtype.is_bool:
            out[key] = rng.integers(0, 2, size=shape).astype(bool)
        else:
            raise InputError(f"signature input {key!r} has dtype {spec.dtype.name}; give inputs with --data")
    return out


def variable_values(fn) -> Dict[str, np.ndarray]:
    return {v.name: v.numpy() for v in fn.variables}


@dataclass(frozen=True)
class NonFinite:
    """Values of one output or parameter of one model that are NaN or infinite."""

    model: str     # the model's path
    what: str      # e.g. "signature 'serving_default' output 'logits'", "parameter dense/kernel:0 after 3 steps"
    count: int     # values that are not finite
    size: int      # values in all

    def __str__(self) -> str:
        return f"{self.model}: {self.what}: {self.count} of {self.size} values are not finite"


@dataclass(frozen=True)
class BatchStatistics:
    """The rewrite's training step runs ``vnodes`` > 1 virtual nodes of ``vnode_batch`` examples and
    normalizes with batch statistics (it has batch-dependent updates, of ``variables``): each
    virtual node uses its own examples' statistics (docs/semantics.md, "Batch normalization"),
    so its parameters differ from the full-batch step of the original by design."""

    vnodes: int
    vnode_batch: int
    variables: Tuple[str, ...] = ()

    def __str__(self) -> str:
        updated = f" (it updates {_listed(self.variables)})" if self.variables else ""
        return (f"the rewrite runs each step as {self.vnodes} virtual nodes of {self.vnode_batch} examples and the "
                f"step normalizes with batch statistics{updated}: each virtual node uses its own examples' "
                "statistics (docs/semantics.md, 'Batch normalization'), so parameters are expected to differ from "
                "the original's full-batch step; compare against a --vnodes 1 rewrite, which must match, or give "
                "a --rtol that accepts the difference")


@dataclass
class Report:
    serving: Dict[str, Optional[float]] = field(default_factory=dict)  # signature -> max abs output error
    # (over its outputs that are finite in both models; None when none is)
    loss: List[tuple] = field(default_factory=list)              # (step, original, rewritten)
    params: Dict[str, float] = field(default_factory=dict)       # variable -> max relative difference (finite ones)
    nonfinite: List[NonFinite] = field(default_factory=list)     # outputs and parameters that are not finite
    batch_statistics: Optional[BatchStatistics] = None           # why parameters differ by design, if they do

    @property
    def worst_param(self) -> float:
        return max(self.params.values(), default=0.0)

    @property
    def worst_output(self) -> float:
        return max((v for v in self.serving.values() if v is not None), default=0.0)


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
_TF_NOISE = re.compile(r"^(?:Graph execution error:|Detected at node|<stack traces unavailable>|\s|$)")


def _tf_line(message: str) -> str:
    """The line of a TensorFlow error that says what is wrong (not where it was detected), cut at 200 characters."""
    lines = [ln for ln in (message or "").splitlines() if not _TF_NOISE.match(ln)]  # a stack trace is indented
    line = re.sub(r"\s*\[Op:[^\]]*\]$", "", lines[0] if lines else "").split("  ")[0].strip()
    return line if len(line) <= 200 else line[:197] + "..."


def _call(fn, inputs: Dict[str, np.ndarray], path: str, key: str, random: bool = False):
    """Run a signature; a check of a rewritten graph that fails (its message has a line starting
    ``vfgraph: ``) is reported as the user's input error, with that line. ``random``: the inputs
    are :func:`make_inputs`' random ones, and an input TensorFlow refuses (a label or an index out
    of the model's range) is the user's to replace with ``--data``."""
    import tensorflow as tf

    try:
        return fn(**inputs)
    except tf.errors.InvalidArgumentError as e:
        m = _VFGRAPH_LINE.search(e.message or "")
        if m:
            raise InputError(f"{path}: signature {key!r}: {m.group(1).strip()}") from None
        if not random:
            raise
        raise InputError(f"{path}: signature {key!r} refuses vfgraph's random inputs, whose integers are in "
                         f"[0, {RANDOM_INT_HIGH}): TensorFlow says {_tf_line(e.message)!r}; give inputs in the "
                         "model's range with --data FILE.npz") from None


def _not_finite(x: np.ndarray) -> int:
    """How many values of ``x`` are NaN or infinite (0 for a tensor that is not floating point)."""
    return int(np.count_nonzero(~np.isfinite(x))) if x.dtype.kind in "fc" else 0


def _finite_pair(what: str, x: np.ndarray, y: np.ndarray, original: str, rewritten: str,
                 nonfinite: List[NonFinite]) -> bool:
    """Whether ``x`` (of ``original``) and ``y`` (of ``rewritten``) are both finite; if not,
    what is not is appended to ``nonfinite``."""
    bad = [NonFinite(path, what, n, v.size) for path, v in ((original, x), (rewritten, y)) if (n := _not_finite(v))]
    nonfinite.extend(bad)
    return not bad


def _max_abs_diff(key: str, ra, rb, original: str, rewritten: str, nonfinite: List[NonFinite]) -> Optional[float]:
    """Largest absolute difference over the outputs finite in both models (None when no output
    is); outputs that are not are appended to ``nonfinite``."""
    worst, compared = 0.0, 0
    for k in sorted(ra):
        x, y = ra[k].numpy(), rb[k].numpy()
        if x.shape != y.shape:
            raise InputError(f"{original} and {rewritten} are not the same model: signature {key!r} output {k!r} has "
                             f"shape {list(x.shape)} from {original} but {list(y.shape)} from {rewritten}; "
                             "give the model and its rewrite")
        if not _finite_pair(f"signature {key!r} output {k!r}", x, y, original, rewritten, nonfinite):
            continue
        compared += 1
        if x.size:  # numbers: the largest difference; anything else (strings, booleans): 1 if any differs
            numeric = x.dtype.kind in "fiuc"
            d = np.max(np.abs(x.astype(np.complex128 if x.dtype.kind == "c" else np.float64) - y)) if numeric else 0.0
            worst = max(worst, float(d) if numeric else float(np.any(x != y)))
    return worst if compared or not ra else None


def _batch_statistics(original: str, rewritten: str, signature: str, fed: int) -> Optional[BatchStatistics]:
    """What :class:`BatchStatistics` says, when it holds for ``rewritten``'s ``signature`` fed
    ``fed`` examples a step: more than one virtual node, and statistics at its cut (the
    rewrite's record); the variables they update from the analysis of ``original``'s step."""
    from vfgraph import records

    rec = records.read(rewritten, records.VirtualNodes).get(signature)
    if rec is None or not any(g.role == "statistic" for g in rec.gradients):
        return None
    v = fed // rec.vnode_batch if rec.vnode_batch else rec.vnodes
    if v <= 1:
        return None
    return BatchStatistics(v, fed // v, tuple(_batch_updated(original, signature)))


def _batch_updated(path: str, signature: str) -> List[str]:
    """Names of the variables the training step of ``path`` updates from its batch (batch
    norm's moving averages): :attr:`TrainStep.batch_updated`; none when it cannot be told."""
    import vfgraph
    from vfgraph.analysis.train_step import analyze_train_step
    from vfgraph.errors import VfgraphError
    from vfgraph.ir.graph import FunctionGraph

    try:
        item = vfgraph.load(path)
        sig = item.signatures[signature]
        step = analyze_train_step(FunctionGraph(item.library[sig.function], item.library), sig)
    except (VfgraphError, KeyError):
        return []
    return [sig.variables[r].name for r in step.batch_updated if r in sig.variables]


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
        ra = _call(a.signatures[key], inputs, original, key, random=data is None)
        rb = _call(b.signatures[key], inputs, rewritten, key, random=data is None)
        report.serving[key] = _max_abs_diff(key, ra, rb, original, rewritten, report.nonfinite)
    if train:
        _compare_training(report, a.signatures[train_signature], b.signatures[train_signature], original, rewritten,
                          train_signature, steps, batch, data)
        report.batch_statistics = _batch_statistics(original, rewritten, train_signature,
                                                    _fed_batch(a.signatures[train_signature], batch))
    return report


def _compare_training(report: Report, fa, fb, original: str, rewritten: str, key: str, steps: int, batch: int,
                      data: Optional[Dict[str, np.ndarray]]) -> None:
    """``steps`` training steps of both models on the same batches into ``report``: the losses,
    the parameters' differences, and what is not finite (an output at the first step it is, a
    parameter after the last step)."""
    seen = set()
    for step in range(steps):
        inputs = _feed(fa, batch, step, data)
        la = _call(fa, inputs, original, key, random=data is None)
        lb = _call(fb, inputs, rewritten, key, random=data is None)
        report.loss.append((step, float(la["loss"]) if "loss" in la else None,
                            float(lb["loss"]) if "loss" in lb else None))
        for k in sorted(set(la) & set(lb) - seen):
            if not _finite_pair(f"signature {key!r} output {k!r} at step {step}", la[k].numpy(), lb[k].numpy(),
                                original, rewritten, report.nonfinite):
                seen.add(k)
    va, vb = variable_values(fa), variable_values(fb)
    for name in sorted(va):
        if name in vb and va[name].dtype.kind == "f":
            if _finite_pair(f"parameter {name} after {steps} steps", va[name], vb[name], original, rewritten,
                            report.nonfinite):
                report.params[name] = rel_diff(va[name], vb[name])
