"""What a training run reports besides its progress bar: validations (``--eval-data``,
:mod:`.evaluate`) and TensorBoard event files (``--logdir``, :class:`EventLog`).

The event files follow Keras' TensorBoard callback: runs ``LOGDIR/train`` and
``LOGDIR/validation``, at the step count of steps done (1 after the first step). In ``train``,
per step: ``batch_loss``, ``batch_<name>`` for each other scalar the step returns (a Keras
model's metrics), ``examples_per_second`` (the global batch over rank 0's step time),
``step_time/rank_<r>`` (each rank's seconds in the step's signature, the times the ranks
already exchange after each step), ``vnodes/rank_<r>`` (the virtual nodes rank r runs: they
change with --vnodes-per-rank auto and elastic resizes), ``learning_rate`` (when the step's
variables hold one named so, as a Keras optimizer's constant rate), and the rewritten training
graph once. In ``validation``, per validation: ``epoch_loss`` and ``epoch_accuracy`` (integer
labels), as Keras names its per-epoch values. Only rank 0 writes."""
from __future__ import annotations

import os
from typing import Dict, Optional

from vfgraph.runtime.config import TrainConfig
from vfgraph.runtime.evaluate import Validation


class EventLog:
    """TensorBoard event files under ``logdir``: the ``train`` and ``validation`` runs, made at
    their first value (a run refused before its first step leaves none), the graph of the
    concrete function ``fn`` (the rewritten training step) first in ``train``."""

    def __init__(self, logdir: str, fn):
        self.logdir, self.fn = logdir, fn
        self.writers: Dict[str, object] = {}

    def _writer(self, run: str):
        import tensorflow as tf

        if run not in self.writers:
            self.writers[run] = tf.summary.create_file_writer(os.path.join(self.logdir, run))
            if run == "train":
                with self.writers[run].as_default():
                    tf.summary.graph(self.fn.graph.as_graph_def())
        return self.writers[run]

    def scalars(self, run: str, step: int, values: Dict[str, float]) -> None:
        """``values`` (name -> number) at ``step`` in the run ``run`` ("train", "validation")."""
        import tensorflow as tf

        with self._writer(run).as_default(step=step):
            for name, value in values.items():
                tf.summary.scalar(name, value)

    def close(self) -> None:
        for writer in self.writers.values():
            writer.flush()
            writer.close()


class Reports:
    """A run's validations (``validation``, on every rank) and event files (``events``, rank 0;
    None: not asked for), after each step and at the end. ``rate``: the variable holding the
    learning rate (None: the step's variables hold none)."""

    def __init__(self, cfg: TrainConfig, validation: Optional[Validation], events: Optional[EventLog], rate=None):
        self.cfg, self.validation, self.events, self.rate = cfg, validation, events, rate

    @classmethod
    def open(cls, cfg: TrainConfig, loaded, fn, held: list, is_root: bool, ranked: bool) -> "Reports":
        """The reports ``cfg`` asks for of the model ``loaded`` (``fn``: the signature this rank
        trains with, over the variables ``held``); one line when the validation data cannot be."""
        validation = None
        if cfg.eval_data:
            validation = Validation.open(loaded, loaded.signatures[cfg.signature], cfg.model, cfg.eval_data,
                                         cfg.batch_size, ranked, cfg.keras_file, cfg.imports)
        events = None
        if cfg.logdir and is_root:
            events = EventLog(os.path.abspath(cfg.logdir), fn)
        rate = next((v for v in held if v.name.rsplit(":", 1)[0].rsplit("/", 1)[-1] == "learning_rate"
                     and v.shape.rank == 0), None)
        return cls(cfg, validation, events, rate)

    def after_step(self, loop, step: int, loss: float, metrics: Dict[str, float]) -> None:
        """(every rank of the step's world) Step ``step`` is done: its scalars, and a validation when due."""
        done = step + 1
        if self.events is not None:
            self._step_scalars(loop, done, loss, metrics)
        every = self.cfg.eval_every
        if self.validation is not None and (done == self.cfg.steps or (every and done % every == 0)):
            self._validate(loop.share.w, done)

    def finish(self, loop) -> Dict[str, float]:
        """(every rank) After the last step: validate if that step's validation has not run
        (a run resumed at its last step); close the event files. The last metrics."""
        try:
            if self.validation is not None and self.validation.step != self.cfg.steps:
                self._validate(loop.share.w, self.cfg.steps)
        finally:
            if self.events is not None:
                self.events.close()
        return dict(self.validation.last) if self.validation is not None else {}

    def record(self) -> Optional[dict]:
        """The last validation, for the trained model's record (None: no validation)."""
        return self.validation.record() if self.validation is not None else None

    def _validate(self, w, done: int) -> None:
        metrics = self.validation.run(w, done)
        if self.events is not None:
            self.events.scalars("validation", done, {f"epoch_{k}": v for k, v in metrics.items()})

    def _step_scalars(self, loop, done: int, loss: float, metrics: Dict[str, float]) -> None:
        """Rank 0's scalars of a step (the other ranks' times from the step's own exchange)."""
        share, runner = loop.share, loop.runner
        values = {"batch_loss": loss, **{f"batch_{k}": v for k, v in metrics.items()}}
        if runner.seconds and runner.seconds[-1] > 0:
            values["examples_per_second"] = self.cfg.batch_size / runner.seconds[-1]
        for r, seconds in enumerate(runner.rank_seconds):
            values[f"step_time/rank_{r}"] = seconds
        per, size = share.per, share.w.size
        k = max(1, size // len(per))  # (pipeline stages on ranks: the ranks of a replica run its virtual nodes)
        for r in range(size):
            values[f"vnodes/rank_{r}"] = per[min(r // k, len(per) - 1)]
        if self.rate is not None:
            values["learning_rate"] = float(self.rate.numpy())
        self.events.scalars("train", done, values)
