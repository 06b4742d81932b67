"""Run an original and a rewritten model on the same inputs and compare (numeric checks)."""
from __future__ import annotations

import os
from dataclasses import dataclass, field
from typing import Dict, List, Optional

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


def compare_models(original: str, rewritten: str, steps: int = 3, batch: int = 32,
                   data: Optional[Dict[str, np.ndarray]] = None, train_signature: str = "train") -> Report:
    """Serving outputs on the same inputs; for training, ``steps`` steps on the same batches."""
    import tensorflow as tf

    for p in (original, rewritten):
        if not os.path.isdir(p):
            raise InputError(f"{p}: not a SavedModel directory")
    a = tf.saved_model.load(original)
    b = tf.saved_model.load(rewritten)
    report = Report()
    for key in sorted(a.signatures):
        if key == train_signature or key not in b.signatures:
            continue
        inputs = data or make_inputs(a.signatures[key], batch)
        ra, rb = a.signatures[key](**inputs), b.signatures[key](**inputs)
        report.serving[key] = max((float(np.max(np.abs(ra[k].numpy() - rb[k].numpy()))) if ra[k].shape.num_elements() else 0.0)
                                  for k in ra)
    if train_signature in a.signatures and train_signature in b.signatures:
        fa, fb = a.signatures[train_signature], b.signatures[train_signature]
        for step in range(steps):
            inputs = data or make_inputs(fa, batch, seed=step)
            la, lb = fa(**inputs), fb(**inputs)
            report.loss.append((step, float(la["loss"]) if "loss" in la else None,
                                float(lb["loss"]) if "loss" in lb else None))
        va, vb = variable_values(fa), variable_values(fb)
        for name in sorted(va):
            if name in vb and va[name].dtype.kind == "f":
                report.params[name] = rel_diff(va[name], vb[name])
    return report
