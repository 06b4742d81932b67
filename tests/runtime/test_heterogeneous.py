"""Heterogeneous training under real ``mpiexec``: with ``--vnodes-per-rank auto`` a slow rank
(here one given a fifth of the CPU time by vfgraph.testing.throttle) is given fewer virtual
nodes while the job runs, and the result is still the one-process result: bit-identical in
deterministic mode, within rounding otherwise."""
import re
import subprocess
import sys

import numpy as np
import pytest

from test_mpi_train import ENV, MPIEXEC, assert_same_params, losses, params, rewritten, run_train, train_cmd

pytestmark = pytest.mark.mpi

# 40 steps: four measuring windows of 8 after the first step, so two in a row can call for a
# plan even when one is disturbed
STEPS, BATCH = 40, 1024


@pytest.fixture(scope="module")
def wide(tmp_path_factory):
    """``wide(optimizer, deterministic)``: a digits MLP wide enough (4096 hidden units) that a
    virtual node's computing (128 examples) takes milliseconds, longer than the throttle's
    cycle, and outweighs the all-reduce; rewritten with V=8 virtual nodes, the all-reduce and
    (``deterministic``) exact sums."""
    import export

    import vfgraph

    root = tmp_path_factory.mktemp("heterogeneous")
    made = {}

    def get(optimizer, deterministic):
        src = root / optimizer
        if not src.exists():
            export.digits_mlp(str(src), optimizer=optimizer, lr=0.01, hidden=4096)
        key = (optimizer, deterministic)
        if key not in made:
            made[key] = str(root / f"{optimizer}_v8_{deterministic}")
            vfgraph.save(vfgraph.rewrite(str(src), vnodes=8, vnode_batch=BATCH // 8, allreduce="mpi",
                                         deterministic=deterministic), made[key])
        return made[key]

    return get


def one_process(model, data, out):
    """One intra-op thread, like each rank: a kernel split over more threads may add in another order."""
    return run_train(0, model, data, out, STEPS, "--batch-size", str(BATCH), "--threads", "1")


def run_slow_rank(model, data, out, share=0.2):
    """2 ranks, ``--vnodes-per-rank auto``, rank 1 running ``share`` of the time; the plans logged."""
    cmd = train_cmd(0, model, data, out, STEPS, "--batch-size", str(BATCH), "--vnodes-per-rank", "auto")
    throttle = [sys.executable, "-m", "vfgraph.testing.throttle", "--share", str(share), "--"]
    res = subprocess.run([MPIEXEC, "-n", "1", *cmd, ":", "-n", "1", *throttle, *cmd], capture_output=True, text=True,
                         env=ENV, timeout=300)
    assert res.returncode == 0, res.stderr[-3000:]
    assert "virtual nodes per rank: 4+4 to start" in res.stderr, res.stderr[-3000:]
    plans = [tuple(map(int, m.groups())) for m in re.finditer(r"virtual nodes per rank (\d+)\+(\d+) from step",
                                                              res.stderr)]
    assert plans, "no plan after the even start:\n" + "\n".join(
        line for line in res.stderr.splitlines() if line.startswith("vfgraph"))
    return plans


def test_auto_shares_follow_a_slow_rank_and_train_bit_identical_parameters(wide, digits, tmp_path):
    model = wide("adam", True)
    one_process(model, digits["train"], str(tmp_path / "one"))
    plans = run_slow_rank(model, digits["train"], str(tmp_path / "auto"))
    assert plans[-1][0] > plans[-1][1], f"the slow rank kept its share: {plans}"
    reference, got = params(str(tmp_path / "one")), params(str(tmp_path / "auto"))
    differ = [k for k in reference if not np.array_equal(reference[k], got[k])]
    assert not differ, f"{differ[:3]} differ from one process after the plans {plans}"
    assert losses(str(tmp_path / "auto")) == losses(str(tmp_path / "one"))


def test_auto_shares_in_the_default_mode_train_within_rounding(wide, digits, tmp_path):
    # momentum, not Adam: Adam divides by the root of a running mean of squared gradients, so a
    # rounding difference in a gradient element near zero moves its parameter by up to the
    # learning rate, and after 40 steps the parameters differ by far more than rounding
    model = wide("momentum", False)
    one_process(model, digits["train"], str(tmp_path / "one"))
    run_slow_rank(model, digits["train"], str(tmp_path / "auto"))
    assert_same_params(str(tmp_path / "one"), str(tmp_path / "auto"), 1e-6)
    np.testing.assert_allclose(losses(str(tmp_path / "auto")), losses(str(tmp_path / "one")), rtol=1e-6)


def test_auto_on_one_process_and_a_bad_value(models, digits, tmp_path):
    model = rewritten(models, tmp_path, allreduce="mpi")("mlp:momentum")
    res = run_train(0, model, digits["train"], str(tmp_path / "one"), 2, "--vnodes-per-rank", "auto")
    assert "virtual nodes per rank" not in res.stderr
    bad = subprocess.run(train_cmd(0, model, digits["train"], str(tmp_path / "b"), 2,
                                   "--vnodes-per-rank", "fast"), capture_output=True, text=True, env=ENV, timeout=120)
    assert bad.returncode == 2 and "--vnodes-per-rank fast" in bad.stderr and "or auto" in bad.stderr
    assert "Traceback" not in bad.stderr
