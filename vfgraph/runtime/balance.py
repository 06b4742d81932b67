"""Heterogeneous training: how many of a step's V virtual nodes each rank runs
(``vfgraph train --vnodes-per-rank auto``).

Each rank's computing time in a step (its wall time less its time in the collectives, so a
fast rank's wait for a slow one does not count) is modelled as ``c_r + k_r * a_r`` for ``k_r``
virtual nodes: a fixed cost and a cost per virtual node. :func:`plan` gives the integer shares
that minimise the slowest rank's time with their sum fixed at V; :class:`Balancer` measures
the ranks over windows of steps, fits the model, and plans again when a rank's measured time
departs from the model by more than the drift threshold. Every rank runs it on the same
gathered measurements, so all reach the same plan without another message. The shares never
change what a step computes, only which rank computes which virtual nodes (bit-identical
results in deterministic mode)."""
from __future__ import annotations

import heapq
import statistics
from dataclasses import dataclass, field
from typing import Dict, List, Optional, Sequence, Tuple


def plan(total: int, per_vnode: Sequence[float], fixed: Optional[Sequence[float]] = None) -> List[int]:
    """Shares ``k_r >= 1`` with ``sum(k) == total`` minimising ``max_r fixed_r + k_r *
    per_vnode_r``. Exact: each virtual node after the first of every rank goes to the rank
    that would finish it soonest (the ``total``-th smallest of all ranks' finishing times is
    a lower bound on any plan's slowest rank, and this meets it); ties go to the lower rank."""
    n = len(per_vnode)
    fixed = list(fixed) if fixed is not None else [0.0] * n
    if n < 1 or total < n:
        raise ValueError(f"{total} virtual nodes cannot give each of {n} ranks one")
    if any(not a > 0 for a in per_vnode) or any(c < 0 for c in fixed):
        raise ValueError(f"times per virtual node must be positive and fixed costs not negative: "
                         f"{list(per_vnode)}, {fixed}")
    shares = [1] * n
    heap = [(fixed[r] + 2 * per_vnode[r], r) for r in range(n)]
    heapq.heapify(heap)
    for _ in range(total - n):
        _, r = heapq.heappop(heap)
        shares[r] += 1
        heapq.heappush(heap, (fixed[r] + (shares[r] + 1) * per_vnode[r], r))
    return shares


def slowest(shares: Sequence[int], per_vnode: Sequence[float], fixed: Sequence[float]) -> float:
    """The slowest rank's modelled computing time under ``shares``."""
    return max(c + k * a for k, a, c in zip(shares, per_vnode, fixed))


def text(shares: Sequence[int]) -> str:
    return "+".join(map(str, shares))


@dataclass
class _Rank:
    """What is known of one rank: its median computing time at each share it ran (the latest
    window at that share), and the fitted model."""

    seen: Dict[int, float] = field(default_factory=dict)
    per_vnode: float = 0.0
    fixed: float = 0.0

    def fit(self) -> None:
        """The model through the two latest shares seen (a fixed cost and a slope), or, with one
        share (or a fit that is not a positive slope and a cost of at least 0), through the
        origin."""
        points = list(self.seen.items())[-2:]
        if len(points) == 2:
            (k1, t1), (k2, t2) = points
            a = (t2 - t1) / (k2 - k1)
            c = t1 - a * k1
            if a > 0 and c >= 0:
                self.per_vnode, self.fixed = a, c
                return
        k, t = points[-1]
        self.per_vnode, self.fixed = max(t, 1e-9) / k, 0.0

    def predict(self, k: int) -> float:
        return self.fixed + k * self.per_vnode


class Balancer:
    """Shares of ``total`` virtual nodes over ``size`` ranks, starting even (or at ``shares``),
    planned again from the measured computing times. Feed it every step's times with
    :meth:`observe`; it returns a line to log when the plan changes (the new shares are in
    :attr:`shares`). ``skip``: steps not measured at the start and after each change (the
    first steps at new shapes); ``window``: steps per measurement (their median); ``drift``:
    the relative departure of a rank's measured time from the model that makes it plan again."""

    GAIN = 0.03  # the least modelled gain in the slowest rank's time worth a new plan

    def __init__(self, total: int, size: int, shares: Optional[List[int]] = None, skip: int = 1, window: int = 5,
                 drift: float = 0.10):
        from vfgraph.runtime.world import shares as even

        self.total, self.size, self.skip, self.window, self.drift = total, size, skip, window, drift
        self.shares = list(shares) if shares is not None else even(total, size)
        self.first = list(self.shares)
        self.ranks = [_Rank() for _ in range(size)]
        self.fitted = False
        self.history: List[Tuple[int, List[int]]] = []  # (step, shares) of every plan after the first
        self._samples: List[List[float]] = []
        self._skip = skip

    def observe(self, step: int, computing: Sequence[float]) -> Optional[str]:
        """Step ``step``'s computing time of every rank (seconds). A line describing the new plan
        when it changes from the next step on, else None."""
        if self.size < 2:
            return None
        if self._skip:
            self._skip -= 1
            return None
        self._samples.append(list(computing))
        if len(self._samples) < self.window:
            return None
        medians = [statistics.median(s[r] for s in self._samples) for r in range(self.size)]
        self._samples = []
        departed = not self.fitted
        for rank, k, m in zip(self.ranks, self.shares, medians):
            if self.fitted and abs(m - rank.predict(k)) > self.drift * rank.predict(k):
                departed = True
                if k in rank.seen:  # its share did not change: its speed did; forget the old points
                    rank.seen.clear()
            rank.seen.pop(k, None)
            rank.seen[k] = m
        if not departed:
            return None
        for rank in self.ranks:
            rank.fit()
        self.fitted = True
        per_vnode = [r.per_vnode for r in self.ranks]
        fixed = [r.fixed for r in self.ranks]
        new = plan(self.total, per_vnode, fixed)
        if slowest(new, per_vnode, fixed) > (1 - self.GAIN) * slowest(self.shares, per_vnode, fixed):
            return None  # (no better, or within noise of it: plans of equal time must not take turns)
        old, self.shares, self._skip = self.shares, new, self.skip
        self.history.append((step + 1, new))
        speeds = ", ".join(f"rank {r} {a * 1e3:.3g} ms" for r, a in enumerate(per_vnode))
        return (f"virtual nodes per rank {text(new)} from step {step + 1}, was {text(old)} (computing per virtual "
                f"node: {speeds}; slowest rank's step {slowest(new, per_vnode, fixed) * 1e3:.3g} ms, "
                f"{slowest(old, per_vnode, fixed) * 1e3:.3g} ms before)")
