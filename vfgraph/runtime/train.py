"""Training a (rewritten) SavedModel on arrays from an .npz file, on one process or on the ranks of
``mpiexec`` (data parallel: each rank feeds its share of every global batch). :func:`train` runs
the parts: the configuration (:mod:`.config`), the ranks and the threads (:mod:`.placement`),
the model and the data (:mod:`.model`, :mod:`.data`), checkpoints (:mod:`.checkpoints`), the
steps (:mod:`.step`, :mod:`.loop`) and the trained model's writing (:mod:`.save`)."""
from __future__ import annotations

import logging
from dataclasses import dataclass, field
from typing import Callable, Dict, List, Optional, Sequence, Tuple, Union

from vfgraph.errors import InputError
from vfgraph.io import outputs, savedmodel
from vfgraph.runtime.checkpoints import HISTORY, Checkpoints, LossHistory, plan_outputs
from vfgraph.runtime.config import ModelPlan, TrainConfig, broadcast_signature, vnode_layout
from vfgraph.runtime.data import (batches_for, cast_exactly, check_batch, check_data, data_digest, data_fingerprint,
                                  load_data, load_npz)
from vfgraph.runtime.elastic import ElasticOptions
from vfgraph.runtime.loop import TrainLoop, start_elastic
from vfgraph.runtime.model import OpenedModel, open_model
from vfgraph.runtime.placement import Ranks, Share
from vfgraph.runtime.reports import Reports
from vfgraph.runtime.save import collect_stages, save_trained
from vfgraph.runtime.step import StepRunner, log_resources
from vfgraph.runtime.stops import (NONFINITE, STOP, STOP_GRACE, Interrupted, NonFiniteLoss, Stalled, StopRequests,
                                   TrainingError, WatchedExchanges)
from vfgraph.runtime.world import World, launched_world, resident_bytes, same_everywhere

# (names of the parts that were defined here before the runtime was split, still read from here)
__all__ = ["train", "run", "TrainConfig", "TrainResult", "LossHistory", "HISTORY", "load_npz", "load_data",
           "check_data", "cast_exactly", "check_batch", "batches_for", "data_fingerprint", "data_digest",
           "vnode_layout", "broadcast_signature", "TrainingError", "NonFiniteLoss", "Interrupted", "Stalled",
           "STOP", "NONFINITE", "STOP_GRACE"]
_StopRequests, _WatchedExchanges = StopRequests, WatchedExchanges

log = logging.getLogger("vfgraph.train")


@dataclass
class TrainResult:
    out: str
    steps: int
    losses: LossHistory
    metrics: Dict[str, float] = field(default_factory=dict)  # the last step's, besides the loss
    validation: Dict[str, float] = field(default_factory=dict)  # the last validation's (--eval-data)

    def summary(self, serve: str = "") -> str:
        """The closing line: the losses, the last step's metrics, the validation's, what was written."""
        last = "".join(f", {k} {v:.4g}" for k, v in self.metrics.items())
        val = ("; validation " + ", ".join(f"{k} {v:.4f}" for k, v in self.validation.items())
               if self.validation else "")
        return (f"trained {self.steps} steps: loss {self.losses.first:.4f} -> {self.losses.recent[-1]:.4f}{last}{val}; "
                f"wrote {self.out}" + (f" and, to serve, {serve}" if serve else ""))


@outputs.command()
def train(model: str, data_path: str, steps: int, batch_size: int, out: str, resume: bool = False,
          force: bool = False, signature: str = "train", checkpoint_every: int = 100, seed: int = 0,
          progress: bool = True, vnodes_per_rank: Union[List[int], str, None] = None,
          threads: Optional[int] = None, allow_nonfinite: bool = False,
          elastic: Optional[ElasticOptions] = None, stall_warning: float = 60.0,
          stall_timeout: float = 600.0, eval_data: Optional[str] = None, eval_every: Optional[int] = None,
          logdir: Optional[str] = None, keras_file: Optional[str] = None,
          imports: Sequence[str] = (), input_fn: Union[str, Callable, None] = None) -> Optional[TrainResult]:
    """Train ``model`` for ``steps`` global batches of ``batch_size`` examples. Under ``mpiexec``
    every rank feeds its share of each global batch (whole virtual nodes, from the same global
    order), the step all-reduces, and rank 0 writes checkpoints and the result; other ranks
    return None. ``threads``: TensorFlow intra-op threads per rank (default: this host's CPUs shared
    by the ranks on it).

    Safe to interrupt and to repeat: SIGINT or SIGTERM stops after a whole step with a
    checkpoint in ``OUT.ckpt`` that ``resume`` continues from, refusing a changed configuration
    (batch size, seed, data, model); a checkpoint is never deleted without ``force``; a step
    whose loss is not finite stops the run (keeping the last checkpoint, writing no model)
    unless ``allow_nonfinite``.

    ``vnodes_per_rank``: the virtual nodes of each rank (a list adding up to V), or ``"auto"``:
    shares planned from each rank's measured computing time and planned again when it drifts
    (:mod:`vfgraph.runtime.balance`; each plan is logged).

    ``elastic``: change the number of ranks while training, by a schedule
    (:mod:`vfgraph.runtime.elastic`).

    ``stall_warning``, ``stall_timeout`` (seconds, 0: off): under mpiexec, a wait for other
    ranks longer than the first prints one line naming what it waits for and whom; one longer
    than the second ends the job (:class:`Stalled`, the last checkpoint kept). A stop request
    also ends a step blocked in such a wait (docs/mpi.md, "Stalls and stop requests").

    ``eval_data`` (an .npz file or TFRecord files), ``eval_every``: validate the serving
    signature on that data every that many steps and after the last (:mod:`.evaluate` says
    how and which metrics); the last metrics are the result's ``validation`` and go in the
    trained model's record; ``keras_file``: the compiled ``.keras`` file ``model`` was built
    from (``imports``: the modules it needs), whose compiled loss and metrics validate then.
    ``logdir``: write TensorBoard event files there (:mod:`.reports`).

    ``input_fn``: ``"MODULE:FUNCTION"`` or a callable ``f(features, rng) -> inputs`` that
    decodes and augments each training example in the input workers (:mod:`.preprocess` says
    what it gets and returns; docs/data.md)."""
    return run(TrainConfig(model, data_path, steps, batch_size, out, resume, force, signature, checkpoint_every, seed,
                           progress, vnodes_per_rank, threads, allow_nonfinite, elastic, stall_warning, stall_timeout,
                           eval_data, eval_every, logdir, keras_file, tuple(imports), input_fn))


def run(cfg: TrainConfig) -> Optional[TrainResult]:
    """Train as ``cfg`` says (:func:`train`, which runs it inside :func:`vfgraph.io.outputs.command`):
    the result on rank 0, None on the other ranks."""
    # under mpiexec the ranks agree from the first check on: a mistake is printed once, by rank 0
    # or by the one rank that sees it (a process an elastic job started reports to the job instead)
    first = World() if cfg.elastic is not None and cfg.elastic.join else launched_world()
    plan = first.agree(lambda: ModelPlan.checked(cfg))
    plan.broadcast = broadcast_signature(cfg.model, cfg.signature)  # its key in the Allreduce record (None: not added)
    ranks = Ranks.start(cfg, plan, first)
    w = ranks.w
    state = w.agree(lambda: plan_outputs(cfg.output, cfg.ckpt_dir, [cfg.model, *cfg.data_files], cfg.force,
                                         cfg.resume, outputs.tree_bytes(cfg.model), cfg.elastic is not None)
                    if w.is_root and ranks.inter is None else None)
    import tensorflow  # noqa: F401 (counted in the memory the process has before the model)
    import tqdm  # noqa: F401

    resident_at_start = resident_bytes("VmRSS")  # Python and TensorFlow, before the model
    opened = w.agree(lambda: open_model(cfg, plan, ranks))
    writes = w.is_root and ranks.inter is None  # (rank 0 of the job writes the event files)
    reports = w.agree(lambda: Reports.open(cfg, opened.loaded, opened.fn, opened.held, writes, ranks.ranked))
    fingerprint = savedmodel.source_fingerprint(cfg.model, None)
    if w.size > 1 and ranks.inter is None:  # before anything the ranks must call alike as often
        same_everywhere(w, cfg.agreed(fingerprint, opened.data))
    scheduled, joined_at = None, None
    if cfg.elastic is not None:
        scheduled, joined_at = start_elastic(cfg, plan, ranks, opened, fingerprint)
        if ranks.w is None:  # the job ended before this process joined it
            return None
    share = Share.first(ranks, opened.per, plan.b, cfg.batch_size, cfg.auto)
    w = ranks.w
    config = cfg.resumable(fingerprint, opened.data) if w.is_root else None
    checkpoints = Checkpoints(opened.held, cfg.ckpt_dir, cfg.checkpoint_every, config,
                              ranks.k_count if ranks.ranked else 0)
    start, losses = _start_step(cfg, ranks, checkpoints, state, joined_at)
    runner = StepRunner(opened.fn, opened.data, opened.held, cfg.allow_nonfinite, ranks.ranked, plan.b)
    loop = TrainLoop(cfg, plan, ranks, opened, share, runner, checkpoints, losses, scheduled, joined_at, start,
                     reports)
    if not loop.run(start):
        return None
    return _finish(cfg, plan, ranks, opened, loop, resident_at_start)


def _start_step(cfg: TrainConfig, ranks: Ranks, checkpoints: Checkpoints, state: Optional[dict],
                joined_at: Optional[int]) -> Tuple[int, LossHistory]:
    """The step the run starts at and the losses before it: those of the checkpoint ``state``
    (rank 0's progress record) restored, or the step a process joined an elastic job at."""
    w = ranks.w
    if ranks.ranked:  # each stage restores its own part of the checkpoint
        state = w.bcast(state)
    if joined_at is not None:
        start, losses = joined_at, LossHistory()
    else:
        got = w.agree(lambda: checkpoints.restore(w, state, cfg.resume) if w.is_root or ranks.ranked else None)
        start, losses = w.bcast(got or (0, LossHistory()))

    def enough_steps() -> None:
        if start > cfg.steps:
            raise InputError(f"--steps {cfg.steps}: the checkpoint in {cfg.ckpt_dir} is at step {start} already; "
                             "give more steps")

    if joined_at is None:
        w.agree(enough_steps)  # (alike on every rank: printed once)
    else:
        enough_steps()
    return start, losses


def _finish(cfg: TrainConfig, plan: ModelPlan, ranks: Ranks, opened: OpenedModel, loop: TrainLoop,
            resident_at_start: int) -> Optional[TrainResult]:
    """After the last step: log the time and memory; rank 0 gathers every stage's variables and
    writes the trained model (the result; None on the other ranks)."""
    w = loop.share.w
    validation = loop.reports.finish(loop)
    log_resources(w, loop.runner.seconds, resident_at_start)
    opened.data.log_reads(w)
    if ranks.ranked:  # rank 0 takes each stage's variables from the rank that updates them
        collect_stages(w, opened.loaded, opened.held, plan.stages, cfg.model, cfg.signature)
    if not w.is_root:
        return None
    save_trained(opened.loaded, cfg.model, cfg.output, loop.losses, variable_devices=ranks.in_process > 1,
                 ckpt_dir=cfg.ckpt_dir, validation=loop.reports.record())
    # OUT holds all the checkpoint held (every variable, the optimizer's state among them, and
    # the losses): the checkpoint goes once OUT and its serving export are whole (docs/semantics.md)
    outputs.remove_written(cfg.ckpt_dir)
    return TrainResult(cfg.output, cfg.steps, loop.losses, loop.runner.metrics, validation)
