"""Heterogeneous training: how many of a step's V virtual nodes each rank runs
(``vfgraph train --vnodes-per-rank auto``).

Each rank's computing time in a step (its wall time less its time in the collectives, so a
fast rank's wait for a slow one does not count) divided by its ``k_r`` virtual nodes is its
time per virtual node ``a_r``. :func:`plan` gives the integer shares that minimise the slowest
rank's time ``k_r * a_r`` with their sum fixed at V; :class:`Balancer` measures the ranks over
windows of steps and plans again when the speeds it measures make another plan faster by more
than a threshold (the whole machine slowing down changes no plan). Every rank runs it on the same
gathered measurements, so all reach the same plan without another message. The shares never
change what a step computes, only which rank computes which virtual nodes (bit-identical
results in deterministic mode)."""
from __future__ import annotations

import heapq
import statistics
from typing import List, Optional, Sequence, Tuple


def plan(total: int, per_vnode: Sequence[float]) -> List[int]:
    """Shares ``k_r >= 1`` with ``sum(k) == total`` minimising ``max_r k_r * per_vnode_r``, the
    slowest rank's time. Exact: each virtual node after the first of every rank goes to the rank
    that would finish it soonest (the ``total``-th smallest of all ranks' finishing times is a
    lower bound on any plan's slowest rank, and this meets it); ties go to the lower rank."""
    n = len(per_vnode)
    if n < 1 or total < n:
        raise ValueError(f"{total} virtual nodes cannot give each of {n} ranks one")
    if any(not a > 0 for a in per_vnode):
        raise ValueError(f"times per virtual node must be positive: {list(per_vnode)}")
    shares = [1] * n
    heap = [(2 * per_vnode[r], r) for r in range(n)]
    heapq.heapify(heap)
    for _ in range(total - n):
        _, r = heapq.heappop(heap)
        shares[r] += 1
        heapq.heappush(heap, ((shares[r] + 1) * per_vnode[r], r))
    return shares


def slowest(shares: Sequence[int], per_vnode: Sequence[float]) -> float:
    """The slowest rank's modelled computing time under ``shares``."""
    return max(k * a for k, a in zip(shares, per_vnode))


def text(shares: Sequence[int]) -> str:
    return "+".join(map(str, shares))


class Balancer:
    """Shares of ``total`` virtual nodes over ``size`` ranks, starting even (or at ``shares``),
    planned again from the measured computing times. Feed it every step's times with
    :meth:`observe`; it returns a line to log when the plan changes (the new shares are in
    :attr:`shares`). ``skip``: steps not measured at the start and after each change (the
    first steps at new shapes); ``window``: steps per measurement (each rank's median time per
    virtual node over them); ``gain``: a window calls for a new plan when, at the speeds it
    measured, another plan's slowest rank would be faster than the current plan's by at least
    this fraction (the ranks' speeds drifted apart or together); ``confirm`` windows in a row
    must call for it (one disturbed window changes nothing), and the new plan is made from
    their mean. The whole machine slowing down changes no plan."""

    def __init__(self, total: int, size: int, shares: Optional[List[int]] = None, skip: int = 1, window: int = 8,
                 gain: float = 0.05, confirm: int = 2):
        from vfgraph.runtime.world import shares as even

        self.total, self.size, self.skip, self.window, self.gain, self.confirm = total, size, skip, window, gain, confirm
        self.shares = list(shares) if shares is not None else even(total, size)
        self.history: List[Tuple[int, List[int]]] = []  # (first step, shares) of every plan after the first
        self._samples: List[List[float]] = []
        self._skip = skip
        self._calls: List[List[float]] = []  # the latest consecutive windows that called for a new plan

    def _better(self, per_vnode: Sequence[float]) -> Optional[List[int]]:
        """The best plan at these speeds, if it beats the current one by the gain threshold."""
        new = plan(self.total, per_vnode)
        return new if slowest(new, per_vnode) <= (1 - self.gain) * slowest(self.shares, per_vnode) else None

    def observe(self, step: int, computing: Sequence[float]) -> Optional[str]:
        """Step ``step``'s computing time of every rank (seconds). A line describing the new plan
        when it changes from the next step on, else None."""
        if self.size < 2:
            return None
        if self._skip:
            self._skip -= 1
            return None
        self._samples.append([t / k for t, k in zip(computing, self.shares)])
        if len(self._samples) < self.window:
            return None
        # the median over the window: a step disturbed by something else moves it little
        per_vnode = [max(statistics.median(s[r] for s in self._samples), 1e-9) for r in range(self.size)]
        self._samples = []
        if self._better(per_vnode) is None:
            self._calls = []
            return None
        self._calls.append(per_vnode)
        if len(self._calls) < self.confirm:
            return None
        per_vnode = [sum(c[r] for c in self._calls) / len(self._calls) for r in range(self.size)]
        self._calls = []
        new = self._better(per_vnode)
        if new is None:
            return None
        old, self.shares, self._skip = self.shares, new, self.skip
        self.history.append((step + 1, new))
        speeds = ", ".join(f"rank {r} {a * 1e3:.3g} ms" for r, a in enumerate(per_vnode))
        return (f"virtual nodes per rank {text(new)} from step {step + 1}, was {text(old)} (computing per virtual "
                f"node: {speeds}; slowest rank's step {slowest(new, per_vnode) * 1e3:.3g} ms, "
                f"{slowest(old, per_vnode) * 1e3:.3g} ms before)")
