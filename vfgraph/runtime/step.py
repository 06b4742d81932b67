"""One training step on a rank (:class:`StepRunner`): its rows of the global batch fed to the
signature it runs (the whole step, or its pipeline stage of it), the loss and metrics read,
what each rank saw exchanged, and a failed step explained in one line."""
from __future__ import annotations

import logging
import math
import re
import time
from typing import Dict, List, Optional, Tuple

import numpy as np

from vfgraph.errors import InputError, Quiet
from vfgraph.io import outputs
from vfgraph.ops import blocked_seconds
from vfgraph.runtime.data import TrainData
from vfgraph.runtime.placement import Share
from vfgraph.runtime.stops import (NONFINITE, STOP, Interrupted, NonFiniteLoss, Stalled, StopRequests, TrainingError,
                                   end_before_finalize)
from vfgraph.runtime.world import resident_bytes

log = logging.getLogger("vfgraph.train")


class StepRunner:
    """Runs the steps of ``fn`` (the training signature, or this rank's pipeline stage of it:
    ``staged``) on ``data``, over the variables ``held``. Keeps the last ``feed``, the last
    step's ``metrics`` (the scalars besides the loss), each step's time on this rank
    (``seconds``: data, step, agreement) and the last step's computing time of every rank
    (``rank_seconds``, from the step's exchange)."""

    def __init__(self, fn, data: TrainData, held: list, allow_nonfinite: bool, staged: bool, b: int):
        self.fn, self.data, self.allow_nonfinite, self.staged, self.b = fn, data, allow_nonfinite, staged, b
        self.variables = [v for v in held if v.dtype.is_floating]
        self.feed: Dict[str, np.ndarray] = {}
        self.metrics: Dict[str, float] = {}
        self.seconds: List[float] = []
        self.rank_seconds: List[float] = []

    def run(self, share: Share, step: int, stop: StopRequests) -> Tuple[float, dict, List[int]]:
        """Run step ``step`` on this rank's rows; the loss (NaN: none), what the signature
        returned, and what each rank saw (STOP, NONFINITE bits), after the balancer (if any)
        took each rank's computing time."""
        fetched = time.perf_counter()
        self.feed = self.data.feed(step, share.lo, share.hi)
        balancer = share.balancer
        began, blocked = time.perf_counter(), blocked_seconds() if balancer else 0.0
        result = self.fn(**self.feed)
        loss = float(result["loss"]) if "loss" in result else float("nan")
        computing = time.perf_counter() - began - ((blocked_seconds() - blocked) if balancer else 0.0)
        bad = "loss" in result and not math.isfinite(loss) and not self.allow_nonfinite
        seen = share.w.gather(((NONFINITE if bad else 0) | (STOP if stop.requested else 0), computing))
        if balancer:
            share.rebalance(step, [t for _, t in seen], self.b)
        flags = [f for f, _ in seen]
        self.rank_seconds = [t for _, t in seen]
        self.seconds.append(time.perf_counter() - fetched)
        return loss, result, flags

    def check_loss(self, w, flags: List[int], step: int, loss: float, kept: str) -> None:
        """Stop the run when a rank's loss was not finite: that rank (the first) says so."""
        if any(f & NONFINITE for f in flags):
            first = next(r for r, f in enumerate(flags) if f & NONFINITE)
            if w.rank != first:
                raise Quiet(NonFiniteLoss.exit_code)
            raise NonFiniteLoss(_nonfinite_message(step, loss, self.feed, kept, w))

    def read_metrics(self, result: dict) -> Dict[str, float]:
        """The scalars the step returned besides the loss (a Keras model's metrics), kept as the last step's."""
        self.metrics = {k: float(v) for k, v in sorted(result.items()) if k != "loss" and v.shape.rank == 0}
        return self.metrics

    def check_parameters(self, w, step: int, kept: str) -> None:
        """Before a checkpoint: stop the run when a parameter is not finite (each stage checks
        its own), unless --allow-nonfinite."""
        import tensorflow as tf

        ok = self.allow_nonfinite or all(bool(tf.reduce_all(tf.math.is_finite(v))) for v in self.variables)
        if self.staged:  # the same on every rank
            ok = all(w.gather(ok))
        if ok:
            return
        if not w.is_root:
            raise Quiet(NonFiniteLoss.exit_code)
        raise NonFiniteLoss(f"step {step}: parameters are not finite after it; training stopped and no model was "
                            f"written{kept}; check the data and the learning rate, or pass --allow-nonfinite to "
                            "train on")

    def failure(self, e, rank: int, where: str, step: Optional[int], share: Share, kept: str) -> Optional[Exception]:
        """The error to raise for TensorFlow's error ``e`` in a step (None: ``e`` itself): a stall
        or a stop request in a wait of vfgraph's ops, a failed collective, the rewritten graph's
        own check of what it was fed, or an op of the model refusing a value fed."""
        import tensorflow as tf

        lines = [x.strip() for x in e.message.splitlines() if x.strip()]
        ours = [x for x in lines if x.startswith("Vf")]
        if ours and isinstance(e, (tf.errors.DeadlineExceededError, tf.errors.CancelledError)):
            end_before_finalize(Stalled.exit_code if isinstance(e, tf.errors.DeadlineExceededError)
                                else Interrupted.exit_code)
        if ours and isinstance(e, tf.errors.DeadlineExceededError):  # the stall watchdog's timeout
            return Stalled(f"rank {rank}, {where}: {ours[0]}; the job ends{kept}")
        if ours and isinstance(e, tf.errors.CancelledError):  # a stop request while the step waited for other ranks
            return Interrupted(f"rank {rank}, {where}: stopped while waiting for other ranks{kept}")
        if ours:  # a failed collective (different graphs on the ranks, an MPI error): one line naming the rank
            return TrainingError(f"rank {rank}, {where}: {ours[0]}")
        mine = [x for x in lines if x.startswith("vfgraph: ")]
        if mine:  # the rewritten graph's own check of what it was fed
            return InputError(f"{where}: {mine[0][len('vfgraph: '):]}")
        if isinstance(e, tf.errors.InvalidArgumentError) and self.feed:  # an op of the model refused a value fed
            rows = self.data.rows(step, share.lo, share.hi)
            return InputError(_refused_batch(lines, self.feed, rows, self.data.path, where))
        return None


def log_resources(w, seconds: List[float], resident_at_start: int) -> None:
    """Log the steps' median time (rank 0) and this rank's peak resident memory."""
    if w.is_root and len(seconds) > 1:  # the first step traces and optimizes the graph
        typical = float(np.median(seconds[1:]))
        log.info("%d steps after the first took %.4g ms each (median), %.4g steps/s", len(seconds) - 1,
                 typical * 1e3, 1 / typical)
    peak = resident_bytes("VmHWM")
    if peak:
        log.info("%speak resident memory %s, %s of it above the process before the model loaded (%d bytes)",
                 f"rank {w.rank}: " if w.size > 1 else "", outputs.size_text(peak),
                 outputs.size_text(peak - resident_at_start), peak - resident_at_start)


def _nonfinite_message(step: int, loss: float, feed: Dict[str, np.ndarray], kept: str, w) -> str:
    """One line for a loss that is not finite: where, whether the batch's inputs are, and what to do."""
    counts = {k: int(np.count_nonzero(~np.isfinite(v))) for k, v in feed.items() if v.dtype.kind == "f"}
    bad = [f"{k!r} has {n} non-finite values" for k, n in sorted(counts.items()) if n]
    where = f"rank {w.rank}, " if w.size > 1 else ""
    hint = (f"the batch's input {', '.join(bad)}: check the data" if bad
            else "the batch's inputs are finite: lower the learning rate or check the model")
    return (f"{where}step {step}: the loss is {loss} (not finite); training stopped and no model was written"
            f"{kept}; {hint}, or pass --allow-nonfinite to train on")


def _refused_batch(lines: List[str], feed: Dict[str, np.ndarray], rows: np.ndarray, data_path: str,
                   where: str) -> str:
    """One line for an op of the model refusing the values of a batch (TensorFlow's
    InvalidArgumentError, ``lines`` its message): what the op said, at which node, and the
    input and first row of ``data_path`` holding a value it names (``rows``: the data's row of
    each example fed)."""
    skip = ("Graph execution error", "Detected at node", "<stack traces", "[[")
    said = next((x for x in lines if not x.startswith(skip)), lines[0] if lines else "no message")
    node = next(iter(re.findall(r"\{\{node ([^}]+)\}\}", " ".join(lines))), "")
    said = re.split(r"\s{2,}", said)[0].rstrip(". ")  # (the values TensorFlow lists after it)
    culprit = ""
    for number in re.findall(r"value of (-?\d+)", said)[:1]:
        hits = {k: np.argwhere(v == int(number)) for k, v in sorted(feed.items()) if v.dtype.kind in "iu"}
        hits = {k: h for k, h in hits.items() if len(h)}
        if hits:
            k, h = next(iter(hits.items()))
            culprit = f"; input {k!r} holds {number} in row {int(rows[h[0][0]])} of {data_path}"
    op = f" (node {node.rsplit('/', 1)[-1]})" if node else ""
    return (f"{where}: the model refused the batch's values: {said}{op}{culprit}; check the data against what the "
            "model takes (for class labels: 0 <= label < classes); no model was written")
