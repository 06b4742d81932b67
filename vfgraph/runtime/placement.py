"""Where a training run's work goes: the ranks of the job and this process's threads and
devices (:class:`Ranks`), and this rank's share of each global batch (:class:`Share`), which
balancing and elastic changes move."""
from __future__ import annotations

import logging
import os
from dataclasses import dataclass
from typing import List, Optional

from vfgraph.runtime import elastic as el
from vfgraph.runtime.balance import Balancer, text
from vfgraph.runtime.config import ModelPlan, TrainConfig
from vfgraph.runtime.data import rank_rows
from vfgraph.runtime.devices import prepare_devices
from vfgraph.runtime.world import World, place_threads, shares, world

log = logging.getLogger("vfgraph.train")


@dataclass
class Ranks:
    """This process's place in the job: the world ``w``; ``ranked``: one pipeline stage per rank,
    rank r running stage r % ``k_count`` of replica r // ``k_count`` (``k_count`` 1 otherwise);
    ``groups`` replicas, this rank's ``group``; ``in_process`` stages on this process's devices;
    TensorFlow's intra-op ``threads``; ``inter``, for a process an elastic job started, the
    communicator to the job it joins (None otherwise)."""

    w: World
    ranked: bool
    k_count: int
    groups: int
    group: int
    in_process: int
    threads: int
    inter: object = None

    @classmethod
    def start(cls, cfg: TrainConfig, plan: ModelPlan, first: World) -> "Ranks":
        """The ranks of the run, with MPI (and the ops) started when the step needs them, the
        threads placed and the stages' devices made."""
        ranked = plan.staged_on_ranks
        inter, threads = None, cfg.threads
        if cfg.elastic is not None:
            if threads is None:  # the job may grow to max_ranks ranks on this host
                threads = max(1, (os.cpu_count() or 1) // cfg.elastic.max_ranks)
            if cfg.elastic.join:  # a process the job started: MPI at once, then load while the job trains on
                inter = el.parent()
        w = World() if inter is not None else first.agree(
            lambda: world(need_mpi=plan.reduces or ranked, stages=plan.stages.count if ranked else 0))
        ranked = ranked and w.size > 1
        k_count = plan.stages.count if ranked else 1
        # ranked: rank r runs stage r % K of replica r // K; each replica trains on its share of the batch
        groups, group = (w.size // k_count, w.rank // k_count) if ranked else (w.size, w.rank)
        in_process = plan.in_process
        threads = w.agree(lambda: place_threads(w, threads, in_process))
        prepare_devices(plan.stages)
        return cls(w, ranked, k_count, groups, group, in_process, threads, inter)


@dataclass
class Share:
    """This rank's part of each global batch: the world ``w`` it is a rank of, its replica
    ``group``, the virtual nodes of each replica (``per``), its rows ``lo:hi`` of the batch, and
    the balancer of --vnodes-per-rank auto (None: fixed shares)."""

    w: World
    group: int
    per: List[int]
    lo: int
    hi: int
    balancer: Optional[Balancer] = None

    @classmethod
    def first(cls, ranks: Ranks, per: List[int], b: int, batch_size: int, auto: bool) -> "Share":
        """The share the run starts with (``per`` as the model and the options give it)."""
        w, group = ranks.w, ranks.group
        lo, hi = rank_rows(per, group, b) if len(per) > 1 else (0, batch_size)
        balancer = None
        if auto and w.size > 1:
            balancer = Balancer(sum(per), w.size, per)
            if w.is_root:
                log.info("virtual nodes per rank: %s to start, planned from the ranks' measured speeds (auto)",
                         text(per))
        return cls(w, group, per, lo, hi, balancer)

    @classmethod
    def even(cls, w: World, vnodes: int, b: int, auto: bool) -> "Share":
        """(an elastic job, on a new world) ``vnodes`` virtual nodes shared evenly by its ranks."""
        per = shares(vnodes, w.size)
        return cls(w, w.rank, per, *rank_rows(per, w.rank, b), Balancer(sum(per), w.size, per)
                   if auto and w.size > 1 else None)

    def rebalance(self, step: int, seconds: List[float], b: int) -> None:
        """Give the balancer each rank's computing time of ``step``; take its new plan, if any."""
        change = self.balancer.observe(step, seconds)
        if change:
            self.per = self.balancer.shares
            self.lo, self.hi = rank_rows(self.per, self.group, b)
            if self.w.is_root:
                log.info("%s", change)

