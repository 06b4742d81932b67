"""Validation during training (``--eval-data``, ``--eval-every``): the model's serving signature
run over the validation data with the variables the training step updates, each rank its
contiguous slice of the examples in micro-batches, the sums gathered over the ranks.

The labels are the arrays of the validation data that the training signature takes and the
serving signature does not (``y``). The metrics (:class:`Validation`):

- integer labels: ``loss``, the mean sparse softmax cross-entropy of the labels against the
  output taken as logits, or, when every output row is non-negative and sums to 1 (within
  1e-3), as probabilities (clipped below at 1e-7, as Keras does); and ``accuracy``, the share of
  examples whose largest output is the label's;
- float labels of the output's per-example shape: ``loss``, the mean squared error.

A model built from a compiled ``.keras`` file is validated with its compiled loss (the
outputs' losses with their weights; regularization terms, which depend on no example, left
out) and compiled metrics, Keras' own objects (:class:`vfgraph.io.keras_file.CompiledMetrics`),
their states added up over the ranks.
"""
from __future__ import annotations

import logging
from dataclasses import dataclass
from typing import Dict, Optional

import numpy as np

from vfgraph.errors import InputError
from vfgraph.runtime.data import check_data, load_data

log = logging.getLogger("vfgraph.train")

SERVING = "serving_default"  # the signature validated (micro-batched when the rewrite made it so)
EPSILON = 1e-7  # probabilities are clipped below at this (Keras' epsilon) before their logarithm


@dataclass
class EvalSet:
    """The validation examples: the serving signature's ``inputs``, the ``labels`` there are (the
    first by name, ``label_key``, is the one the loss of :func:`_loss_kind` takes), ``n``
    examples, read from ``path``."""

    path: str
    inputs: Dict[str, np.ndarray]
    labels: Dict[str, np.ndarray]
    n: int

    @property
    def label_key(self) -> str:
        return sorted(self.labels)[0]

    @property
    def label(self) -> np.ndarray:
        return self.labels[self.label_key]

    @classmethod
    def load(cls, path: str, serving_specs: dict, train_specs: dict, model: str) -> "EvalSet":
        """The data at ``path``, checked: every serving input, and labels."""
        label_specs = {k: s for k, s in sorted(train_specs.items()) if k not in serving_specs}
        if not label_specs:
            raise InputError(f"{model}: the training signature takes no array that the {SERVING!r} signature does "
                             "not (a label), so there is nothing to validate against; leave out --eval-data")
        raw = load_data(path, {**serving_specs, **label_specs})
        inputs = check_data(raw, serving_specs, path, SERVING)
        present = sorted(k for k in label_specs if k in raw)
        if not present:
            raise InputError(f"{path}: no label array {sorted(label_specs)} (the training signature takes it, the "
                             f"{SERVING!r} signature does not); give the validation labels under that name")
        labels = check_data({k: raw[k] for k in present}, {k: label_specs[k] for k in present}, path, "train")
        n = len(labels[present[0]])
        if n == 0 or any(len(v) != n for v in inputs.values()):
            lengths = {k: len(v) for k, v in {**inputs, **labels}.items()}
            raise InputError(f"{path}: validation arrays of different lengths or none: {lengths}")
        return cls(path, inputs, labels, n)


def _loss_kind(label: np.ndarray, output_spec, path: str, key: str) -> str:
    """"sparse" (integer class labels against rows of scores) or "mse" (float labels of the
    output's per-example shape); one line for a label neither fits."""
    shape = output_spec.shape
    if label.dtype.kind in "iu" and label.ndim == 1 and shape.rank == 2:
        classes = shape[-1]
        if len(label) and (label.min() < 0 or (classes is not None and label.max() >= classes)):
            bad = int(np.argmax((label < 0) | (label >= (classes if classes is not None else np.inf))))
            raise InputError(f"{path}: label array {key!r} holds {int(label[bad])} in row {bad}, not a class of the "
                             f"output's {classes} (0 <= label < {classes}); check the validation labels")
        return "sparse"
    if label.dtype.kind == "f" and shape[1:].is_compatible_with(label.shape[1:]) and shape.rank == label.ndim:
        return "mse"
    raise InputError(f"{path}: label array {key!r} of dtype {label.dtype.name} and examples of shape "
                     f"{list(label.shape[1:])} fits no validation loss of an output of shape {shape}: give integer "
                     "class labels for rows of scores, or float labels of the output's shape")


def output_key(fn) -> str:
    """The output validated: the serving signature's only one, else ``logits``, else the first by name."""
    outputs = fn.structured_outputs
    keys = sorted(outputs)
    return keys[0] if len(keys) == 1 or "logits" not in outputs else "logits"


class Validation:
    """Validates ``fn`` (the serving signature of the model being trained) on ``data`` in
    micro-batches of ``chunk`` examples, with a ``.keras`` file's ``compiled`` loss and metrics
    (None: those of :func:`_loss_kind`); keeps the ``last`` metrics and the step they are of."""

    def __init__(self, fn, data: EvalSet, chunk: int, compiled=None):
        self.fn, self.data, self.chunk, self.compiled = fn, data, max(1, chunk), compiled
        self.key = output_key(fn)
        self.kind = "compiled" if compiled is not None else _loss_kind(
            data.label, fn.structured_outputs[self.key], data.path, data.label_key)
        self.last: Dict[str, float] = {}
        self.step: Optional[int] = None
        self.as_probabilities = False  # (integer labels) the outputs were probabilities, not logits

    @classmethod
    def open(cls, loaded, train_fn, model: str, path: str, chunk: int, ranked: bool,
             keras_file: Optional[str] = None, imports=()) -> "Validation":
        """The validation of ``loaded`` on the data at ``path`` (``keras_file``: the compiled
        ``.keras`` file ``loaded`` was built from; ``imports`` the modules it needs); one line
        when it cannot be."""
        if ranked:
            raise InputError(f"{model}: its training step is cut into pipeline stages on ranks of their own, so no "
                             f"rank holds the whole {SERVING!r} signature while training; leave out --eval-data (or "
                             "train on one process and validate the trained model)")
        if SERVING not in loaded.signatures:
            raise InputError(f"{model}: no {SERVING!r} signature to validate with (has: "
                             f"{', '.join(sorted(loaded.signatures))}); leave out --eval-data")
        fn = loaded.signatures[SERVING]
        serving_specs, train_specs = fn.structured_input_signature[1], train_fn.structured_input_signature[1]
        data = EvalSet.load(path, serving_specs, train_specs, model)
        compiled = None
        if keras_file:
            from vfgraph.io.keras_file import CompiledMetrics

            compiled = CompiledMetrics(keras_file, imports)
            missing = [k for k in compiled.label_names if k not in data.labels]
            if missing:
                raise InputError(f"{path}: no label array {missing} (the compiled loss of {keras_file} takes "
                                 f"{compiled.label_names}); give the validation labels under those names")
        return cls(fn, data, chunk, compiled)

    def run(self, w, step: int) -> Dict[str, float]:
        """(collective over the world ``w``) The metrics after ``step`` steps, each rank
        computing its slice of the examples; logged on rank 0."""
        lo, hi = self.data.n * w.rank // w.size, self.data.n * (w.rank + 1) // w.size
        if self.compiled is not None:
            self.last = self._compiled(w, lo, hi)
        else:
            sums = np.zeros(6)
            for a in range(lo, hi, self.chunk):
                sums += self._sums(a, min(hi, a + self.chunk))
            self.last = self._metrics(np.sum(w.gather(sums), axis=0))
        self.step = step
        if w.is_root:
            shown = ", ".join(f"{k} {v:.4f}" for k, v in self.last.items())
            log.info("validation after step %d: %s (%d examples of %s)", step, shown, self.data.n, self.data.path)
        return self.last

    def _sums(self, a: int, b: int) -> np.ndarray:
        """Examples ``a:b``: [loss sum as logits, as probabilities, rows that are not
        probabilities, correct, squared-error sum, examples]."""
        out = self.fn(**{k: v[a:b] for k, v in self.data.inputs.items()})[self.key].numpy().astype(np.float64)
        label = self.data.label[a:b]
        if self.kind == "mse":
            err = (out - label.astype(np.float64)) ** 2
            return np.array([0, 0, 0, 0, float(err.reshape(len(err), -1).mean(axis=1).sum()), b - a])
        rows = np.arange(b - a)
        top = out.max(axis=1)
        as_logits = (np.log(np.exp(out - top[:, None]).sum(axis=1)) + top - out[rows, label]).sum()
        as_probs = -np.log(np.clip(out[rows, label], EPSILON, None)).sum()
        not_probs = np.count_nonzero((out < 0).any(axis=1) | (np.abs(out.sum(axis=1) - 1) > 1e-3))
        correct = np.count_nonzero(out.argmax(axis=1) == label)
        return np.array([as_logits, as_probs, not_probs, correct, 0, b - a])

    def _compiled(self, w, lo: int, hi: int) -> Dict[str, float]:
        """(a .keras file's model) The compiled loss, a sum of batch means times their sizes,
        and the metrics, their states summed over the ranks."""
        compiled = self.compiled
        compiled.reset()
        loss = 0.0
        for a in range(lo, hi, self.chunk):
            b = min(hi, a + self.chunk)
            out = self.fn(**{k: v[a:b] for k, v in self.data.inputs.items()})
            outputs = [out[f"output_{i}"] for i in range(len(out))]
            loss += compiled.update(outputs, [self.data.labels[k][a:b] for k in compiled.label_names]) * (b - a)
        seen = w.gather((loss, compiled.state()))
        compiled.set_state([np.sum(parts, axis=0) for parts in zip(*(s for _, s in seen))])
        return {"loss": sum(x for x, _ in seen) / self.data.n, **compiled.result()}

    def _metrics(self, total: np.ndarray) -> Dict[str, float]:
        n = total[5]
        if self.kind == "mse":
            return {"loss": float(total[4] / n)}
        self.as_probabilities = not total[2]
        loss = total[1] if self.as_probabilities else total[0]
        return {"loss": float(loss / n), "accuracy": float(total[3] / n)}

    def record(self) -> dict:
        """What the trained model's record says of the last validation."""
        loss = {"mse": "mean squared error", "compiled": "the compiled loss of the .keras file"}.get(
            self.kind, "sparse softmax cross-entropy of " + ("probabilities" if self.as_probabilities else "logits"))
        return {"data": self.data.path, "examples": self.data.n, "step": self.step, "metrics": dict(self.last),
                "loss": loss}

