"""The steps of a training run (:class:`TrainLoop`): each step run and checked, checkpoints when
due or asked for, stop requests and the stall watchdog, and, in an elastic job, the changes of
its ranks at step boundaries and its recovery when it loses some."""
from __future__ import annotations

import logging
import sys
import time
from typing import List, Optional, Tuple

import numpy as np

from vfgraph.errors import Quiet
from vfgraph.ops import set_step, watch
from vfgraph.runtime import elastic as el
from vfgraph.runtime import world as world_module
from vfgraph.runtime.balance import text
from vfgraph.runtime.checkpoints import Checkpoints, LossHistory
from vfgraph.runtime.config import ModelPlan, TrainConfig
from vfgraph.runtime.model import OpenedModel
from vfgraph.runtime.placement import Ranks, Share
from vfgraph.runtime.step import StepRunner
from vfgraph.runtime.stops import STOP, STOP_GRACE, Interrupted, Stalled, StopRequests, WatchedExchanges
from vfgraph.runtime.world import RankLost, World, shares

log = logging.getLogger("vfgraph.train")

DONE, BACK, LEFT = "done", "back", "left"  # how a round of steps ended


def start_elastic(cfg: TrainConfig, plan: ModelPlan, ranks: Ranks, opened: OpenedModel,
                  fingerprint: str) -> Tuple[el.Elastic, Optional[int]]:
    """(an elastic run) The job's control, and for a process the job started, the step it joins
    at: ``ranks`` then holds its world in the job (None: the job ended first) and ``opened`` its
    share, with rank 0's variables."""
    from vfgraph import ops

    e = cfg.elastic
    scheduled = el.Elastic(plan.schedule, e.argv, ops.set_communicator, fingerprint,
                           requests=el.request_path(cfg.output), max_ranks=e.max_ranks, started=e.started,
                           discovery=e.discovery, interval=e.interval)
    if ranks.inter is None:
        w = ranks.w
        w.agree(lambda: scheduled.check_start(w))
        return scheduled, None
    # loaded: join the job at its next step, with rank 0's variables
    ranks.w, joined_at = el.join(ranks.inter, e.started, fingerprint, scheduled)
    if ranks.w is not None:
        opened.loaded.signatures[plan.broadcast]()
        opened.per = shares(cfg.batch_size // plan.b, ranks.w.size)
        ranks.group = ranks.w.rank
    return scheduled, joined_at


class TrainLoop:
    """The steps ``start`` to ``cfg.steps`` of a run on this rank's ``share`` of each batch, each
    run by ``runner``, the losses appended to ``losses``, written by ``checkpoints``;
    ``scheduled``: an elastic job's control (None: a fixed number of ranks), ``joined_at`` the
    step this rank joined it at (None: it started with the job)."""

    def __init__(self, cfg: TrainConfig, plan: ModelPlan, ranks: Ranks, opened: OpenedModel, share: Share,
                 runner: StepRunner, checkpoints: Checkpoints, losses: LossHistory,
                 scheduled: Optional[el.Elastic], joined_at: Optional[int], start: int, reports=None):
        from tqdm import tqdm

        self.cfg, self.plan, self.threads, self.staged = cfg, plan, ranks.threads, ranks.ranked
        self.loaded, self.held = opened.loaded, opened.held
        self.share, self.runner, self.checkpoints, self.losses = share, runner, checkpoints, losses
        self.scheduled, self.joined_at = scheduled, joined_at
        self.where, self.step = "start", None  # (the step in progress, as errors name it)
        self.bar = tqdm(initial=start, total=cfg.steps, disable=not (cfg.progress and share.w.is_root), unit="step")
        # (rank 0 of an elastic job) the last completed step and a copy of the variables after it,
        # kept while the job runs on more than one rank: when it loses ranks, rank 0 goes back to
        # it and on alone
        self.memory: Optional[Tuple[int, list]] = None
        self.keeps = scheduled is not None and share.w.is_root
        self.watching = False
        self.reports = reports  # (a Reports: validations and event files after each step; None: none)

    def run(self, start: int) -> bool:
        """Train from step ``start``; False when this rank left an elastic job that then ended."""
        import tensorflow as tf

        try:
            self._begin()
            with StopRequests() as stop:
                self._watch(stop)
                return self._rounds(start, stop)
        except tf.errors.OpError as e:
            w = self.share.w
            err = self.runner.failure(e, w.rank, self.where, self.step, self.share, self.checkpoints.kept())
            if err is None:
                raise
            if isinstance(err, Stalled) and self.scheduled is not None and w.is_root:  # name the host
                err = Stalled(self.scheduled.name_hosts(str(err)))
            raise err from None
        finally:
            world_module.watcher = None
            self.bar.close()
            w = self.share.w
            if self.scheduled is not None and w.is_root:  # release the ranks that left, and any still to join
                self.scheduled.finish(w, failed=sys.exc_info()[0] is not None)

    def _begin(self) -> None:
        """(ranks that start together) Log the ranks; start them from rank 0's variables."""
        import tensorflow as tf

        w = self.share.w
        if w.size > 1 and self.joined_at is None:
            table = w.describe()
            if w.is_root:
                log.info("%d ranks, %d intra-op and %d inter-op TensorFlow threads each: %s", w.size, self.threads,
                         tf.config.threading.get_inter_op_parallelism_threads(), "; ".join(table))
            if not self.staged:  # (stages read their variables from the same files, checked above)
                self._broadcast()  # same graph everywhere, then rank 0's variables

    def _watch(self, stop: StopRequests) -> None:
        """(several ranks) The stall limits and stop requests for the ops' waits and the World's."""
        cfg = self.cfg
        self.watching = self.share.w.size > 1 or self.scheduled is not None  # (an elastic job may grow)
        if self.watching:  # (after the handlers of StopRequests, which the signals then reach too)
            watch(cfg.stall_warning, cfg.stall_timeout, STOP_GRACE, signals=True)
            world_module.watcher = WatchedExchanges(stop, cfg.stall_warning, cfg.stall_timeout,
                                                    lambda: self.share.w.rank, lambda: self.where,
                                                    self.checkpoints.kept)

    def _rounds(self, start: int, stop: StopRequests) -> bool:
        """Rounds of steps until the last: again from a step a rank came back at, or from the
        last completed step after the job lost ranks."""
        import tensorflow as tf

        from_step = start  # (again after ranks were lost: the last completed step)
        while from_step < self.cfg.steps:
            try:
                ended, from_step = self._round(from_step, stop)
                if ended == LEFT:
                    return False
                if ended == DONE:
                    break  # (every step done; a rank called back goes round again)
            except (tf.errors.AbortedError, RankLost):
                if not (self.scheduled is not None and self.scheduled.lost and (self.memory or not self.keeps)):
                    raise
                from_step = self._recover(from_step)
        return True

    def _round(self, from_step: int, stop: StopRequests) -> Tuple[str, int]:
        """The steps from ``from_step`` on: DONE after the last, BACK (and the step) for a rank
        called back into the job, LEFT for one that left it and was not."""
        for step in range(from_step, self.cfg.steps):
            self.step, self.where = step, f"step {step}"
            if self.scheduled is not None and step != self.joined_at:
                ended = self._boundary(step)
                if ended is not None:
                    return ended
            self._one(step, stop)
        return DONE, self.cfg.steps

    def _one(self, step: int, stop: StopRequests) -> None:
        """Step ``step``: run, checked, recorded, checkpointed when due or stopped."""
        steps = self.cfg.steps
        if self.watching:
            set_step(step)
        loss, result, flags = self.runner.run(self.share, step, stop)
        w = self.share.w
        self.runner.check_loss(w, flags, step, loss, self.checkpoints.kept())
        self.losses.append(loss)
        metrics = self.runner.read_metrics(result)
        self.bar.set_postfix(loss=f"{loss:.4f}", **{k: f"{v:.4g}" for k, v in metrics.items()})
        done = step + 1
        interrupted = any(f & STOP for f in flags) and done < steps
        if interrupted or self.checkpoints.due(done, steps):
            self.runner.check_parameters(w, step, self.checkpoints.kept())
            self.checkpoints.save(w, done, self.losses)
        if interrupted:
            if not w.is_root:
                raise Quiet(Interrupted.exit_code)
            raise Interrupted(f"stopped after {done} of {steps} steps; {self.cfg.ckpt_dir} holds them: run the "
                              "same command with --resume to continue")
        self.bar.update(1)
        if self.keeps and w.size > 1:  # the step is complete: what the job goes back to
            self.memory = self._remember(done)
        if self.reports is not None:
            self.reports.after_step(self, step, loss, metrics)

    def _boundary(self, step: int) -> Optional[Tuple[str, int]]:
        """(an elastic job) The job's change of ranks before ``step``, if any; BACK or LEFT when
        this rank left it (None: on with the step)."""
        new, change = self.scheduled.boundary(self.share.w, step)
        if new is None:  # this rank left the job: idle until it ends, or a growth calls it back
            back = self.scheduled.park(self.share.w)
            if back is None:
                return LEFT, 0
            w, from_step = back
            self.joined_at = from_step
            self.share = self._even(w)
            self._broadcast()  # rank 0's variables, as the others
            log.info("rank %d came back at step %d", w.rank, from_step)
            return BACK, from_step  # (on from that step)
        if change and "refused" in change:
            if self.share.w.is_root:
                log.warning("%s", change["refused"])
        elif change:
            self._resized(new, change, step)
        return None

    def _resized(self, w: World, change: dict, step: int) -> None:
        """The job changed to the ranks of ``w`` before ``step`` (``change``: how)."""
        if self.keeps:  # what the job goes back to if it loses ranks from here on
            self.memory = self._remember(step)
        if change["new"] > change["old"]:  # the new ranks take every variable of rank 0
            self._broadcast()
        self.share = self._even(w)
        if not w.is_root:
            return
        took = time.perf_counter() - change["began"]
        n, per = change["new"] - change["old"], self.share.per
        if "back" in change:
            log.info("resized %d -> %d ranks at step %d: %d rank%s that had left came back, in %.3g s; virtual "
                     "nodes per rank %s", change["old"], change["new"], step, n, "s" if n > 1 else "", took, text(per))
        else:
            started_in = f" (they started in {change['spawn']:.3g} s, beside the training)" if "spawn" in change else ""
            log.info("resized %d -> %d ranks at step %d: %.3g s waiting for new ranks to load the model%s, then "
                     "%.3g s to change; virtual nodes per rank %s", change["old"], change["new"], step,
                     change["waited"], started_in, took, text(per))

    def _recover(self, from_step: int) -> int:
        """(an elastic job that lost ranks) Go on with the ranks left from the last completed
        step (rank 0: with the variables it had then); the step to go on from."""
        scheduled = self.scheduled
        if self.keeps:  # rank 0: back to its last completed step
            from_step, saved = self.memory
            for v, value in zip(self.held, saved):
                v.assign(value)
        lost, failed_at = scheduled.lost, self.step
        w, from_step = scheduled.recover(from_step)  # with the ranks that joined and are left
        self.losses.rollback(from_step)
        self.joined_at = None
        self.share = self._even(w)
        if w.size > 1:  # they take rank 0's variables again
            self._broadcast()
        if w.is_root:
            self.bar.n = from_step
            self.bar.refresh()
            log.warning("%s at step %d; the job goes on %s from step %d, its last completed step, with the "
                        "variables it had then (%.3g s after the loss was seen)", lost, failed_at,
                        "alone" if w.size == 1 else f"with {w.size} ranks", from_step,
                        time.perf_counter() - scheduled.lost_at)
        scheduled.lost = None
        return from_step

    def _even(self, w: World) -> Share:
        """(an elastic job, on the world ``w``) The virtual nodes shared evenly by its ranks."""
        return Share.even(w, self.cfg.batch_size // self.plan.b, self.plan.b, self.cfg.auto)

    def _broadcast(self) -> None:
        """Every rank takes rank 0's variables (the broadcast signature the rewrite recorded)."""
        self.loaded.signatures[self.plan.broadcast]()

    def _remember(self, done: int) -> Tuple[int, List[np.ndarray]]:
        """What rank 0 of an elastic job goes back to if it loses ranks: ``done`` and the variables."""
        return done, [np.array(v.numpy()) for v in self.held]
