"""Heterogeneous training's planner: exact integer shares, and plans that follow measured speeds
(the runtime's side is under real mpiexec in test_heterogeneous.py)."""
import itertools
import random

import pytest

from vfgraph.runtime.balance import Balancer, plan, slowest


def brute_force(total, per_vnode):
    n = len(per_vnode)
    return min(slowest(k, per_vnode) for k in itertools.product(range(1, total + 1), repeat=n)
               if sum(k) == total)


def test_plan_minimises_the_slowest_rank_exactly():
    rng = random.Random(0)
    for _ in range(300):
        n = rng.randint(1, 4)
        total = rng.randint(n, 12)
        per_vnode = [rng.uniform(0.5, 3) for _ in range(n)]
        shares = plan(total, per_vnode)
        assert sum(shares) == total and min(shares) >= 1
        assert slowest(shares, per_vnode) == pytest.approx(brute_force(total, per_vnode), abs=1e-12)


def test_plan_for_a_two_to_one_speed_difference():
    assert plan(12, [1.0, 2.0]) == [8, 4]
    assert plan(16, [1.0, 2.0]) == [11, 5]  # 11 and 10 units: the best integer split
    assert slowest(plan(8, [1.0, 2.0]), [1.0, 2.0]) == 6  # 6+2 and 5+3 both take 6
    assert plan(8, [1.0, 1.0, 1.0]) == [3, 3, 2]  # even speeds: ties to the lower ranks
    assert plan(8, [1.0, 100.0]) == [7, 1]  # every rank keeps at least one virtual node


@pytest.mark.parametrize("bad", [(1, [1.0, 1.0]), (4, [1.0, 0.0]), (4, [])])
def test_plan_refuses_what_it_cannot_do(bad):
    with pytest.raises(ValueError):
        plan(*bad)


def run(balancer, speeds, steps, start=0, noise=0.0, rng=None):
    """Feed ``balancer`` ``steps`` steps of ranks whose computing takes ``c + k * a`` (``speeds``: (c, a)
    per rank), each time off by up to ``noise`` (relative); returns the lines it logged."""
    lines = []
    for step in range(start, start + steps):
        times = [(c + k * a) * (1 + (rng.uniform(-noise, noise) if noise else 0.0))
                 for k, (c, a) in zip(balancer.shares, speeds)]
        line = balancer.observe(step, times)
        if line:
            lines.append(line)
    return lines


def test_balancer_reaches_the_best_plan_and_keeps_it():
    b = Balancer(16, 2)
    assert b.shares == [8, 8]
    lines = run(b, [(0.0, 0.002), (0.0, 0.004)], 60)  # rank 1 half as fast
    assert b.shares == [11, 5] and len(lines) == 1 and "virtual nodes per rank 11+5" in lines[0]
    assert "was 8+8" in lines[0] and b.history == [(17, [11, 5])]  # after 1 skipped step and 2 windows of 8


def test_fixed_costs_and_the_whole_machine_slowing_down():
    """A fixed cost per step makes a rank's time per virtual node depend on its share: the
    plans settle anyway; the whole machine twice as slow changes no plan."""
    b = Balancer(16, 2)
    lines = run(b, [(0.004, 0.002), (0.008, 0.004)], 80)
    assert 1 <= len(lines) <= 3 and b.shares[0] > b.shares[1]
    settled = list(b.shares)
    assert not run(b, [(0.008, 0.004), (0.016, 0.008)], 40, start=80) and b.shares == settled


def test_balancer_ignores_noise_under_the_threshold_and_follows_a_real_change():
    rng = random.Random(1)
    b = Balancer(12, 2)
    run(b, [(0.0, 0.002), (0.0, 0.004)], 30, noise=0.1, rng=rng)
    assert b.shares == [8, 4]
    planned = len(b.history)
    run(b, [(0.0, 0.002), (0.0, 0.004)], 60, start=30, noise=0.1, rng=rng)
    assert len(b.history) == planned, "re-planned on noise"
    lines = run(b, [(0.0, 0.002), (0.0, 0.002)], 40, start=90)  # rank 1 becomes as fast as rank 0
    assert b.shares == [6, 6] and lines and "from step" in lines[-1]


def test_one_rank_has_nothing_to_balance():
    b = Balancer(8, 1)
    assert run(b, [(0.0, 0.001)], 20) == [] and b.shares == [8]


def test_one_disturbed_window_changes_no_plan():
    b = Balancer(12, 2)
    run(b, [(0.0, 0.002), (0.0, 0.004)], 40)
    assert b.shares == [8, 4]
    planned = len(b.history)
    run(b, [(0.0, 0.006), (0.0, 0.004)], 8, start=40)  # rank 0 disturbed for one window
    run(b, [(0.0, 0.002), (0.0, 0.004)], 40, start=48)
    assert len(b.history) == planned and b.shares == [8, 4]
