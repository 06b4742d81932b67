"""The ranks of a real ``mpiexec`` job agree on their configuration before step 1, and a
mistake is printed once: by rank 0, or by the one rank that knows it."""
import os
import re
import shutil
import subprocess

import numpy as np
import pytest

from test_mpi_train import BATCH, ENV, MPIEXEC, rewritten, train_cmd

pytestmark = pytest.mark.mpi


@pytest.fixture(scope="module")
def v8(models, tmp_path_factory):
    return rewritten(models, tmp_path_factory.mktemp("agreement_models"), allreduce="mpi")


def ranks(rank0, rank1, timeout=180):
    """Run a job of two ranks started with the command lines ``rank0`` and ``rank1``."""
    return subprocess.run([MPIEXEC, "-n", "1", *rank0, ":", "-n", "1", *rank1], capture_output=True, text=True,
                          env=ENV, timeout=timeout)


def errors(res) -> list:
    """The job's error lines: what vfgraph prints for a mistake, one line each."""
    return [line for line in (res.stdout + res.stderr).splitlines() if re.match(r"vfgraph( \w+)?( \(rank \d+\))?: "
                                                                                r"(error|internal error)", line)]


def refused_once(res) -> str:
    """The job exited 2 with one error line and no traceback; that line."""
    lines = errors(res)
    assert res.returncode == 2 and len(lines) == 1, (res.returncode, res.stdout[-2000:], res.stderr[-3000:])
    assert "Traceback" not in res.stderr
    return lines[0]


def test_ranks_with_different_options_are_refused_before_step_1(v8, digits, tmp_path):
    """Different --steps would leave the rank with more of them waiting at the end for ever;
    the others would train differently (or write elsewhere) in silence."""
    model, out = v8("mlp:momentum"), str(tmp_path / "o")
    line = refused_once(ranks(train_cmd(0, model, digits["train"], out, 2),
                              train_cmd(0, model, digits["train"], str(tmp_path / "p"), 3, "--seed", "5",
                                        "--resume")))
    assert line.startswith("vfgraph train: error: the ranks were started with different options: ")
    for differ in ("--steps 2 on rank 0, 3 on rank 1", "--seed 0 on rank 0, 5 on rank 1",
                   "--resume False on rank 0, True on rank 1", f"-o {out} on rank 0, {tmp_path / 'p'} on rank 1"):
        assert differ in line, line
    assert "--batch-size" not in line and "--data" not in line and "the model" not in line
    assert not os.listdir(tmp_path)  # nothing written, no checkpoint


def test_different_data_is_refused_and_the_same_data_elsewhere_is_not(v8, digits, tmp_path):
    model = v8("mlp:momentum")
    with np.load(digits["train"]) as z:
        x, y = z["x"].copy(), z["y"]
    copy, changed = str(tmp_path / "copy.npz"), str(tmp_path / "changed.npz")
    shutil.copy(digits["train"], copy)
    x[-1] += 1  # the last example: one the digest samples
    np.savez(changed, x=x, y=y)
    res = ranks(train_cmd(0, model, digits["train"], str(tmp_path / "o"), 2),
                train_cmd(0, model, changed, str(tmp_path / "o"), 2, "--checkpoint-every", "1", "--allow-nonfinite"))
    line = refused_once(res)
    assert re.search(r"--data \d+ examples of digest \w{12} on rank 0, \d+ examples of digest \w{12} on rank 1", line)
    assert "--checkpoint-every 100 on rank 0, 1 on rank 1" in line and "--allow-nonfinite False on rank 0" in line
    assert not os.path.exists(tmp_path / "o")
    # a copy of the data at another path, and what may differ by design (threads, progress, -v)
    rank1 = train_cmd(0, model, copy, str(tmp_path / "o"), 2, "--threads", "1")
    rank1.remove("-v")
    res = ranks(train_cmd(0, model, digits["train"], str(tmp_path / "o"), 2), rank1)
    assert res.returncode == 0 and not errors(res), res.stderr[-3000:]
    assert os.path.isdir(tmp_path / "o")


def test_another_model_on_one_rank_is_refused(v8, models, digits, tmp_path):
    import vfgraph

    other = str(tmp_path / "other")
    vfgraph.save(vfgraph.rewrite(models("mlp:momentum"), vnodes=4, vnode_batch=16, allreduce="mpi"), other)
    line = refused_once(ranks(train_cmd(0, v8("mlp:momentum"), digits["train"], str(tmp_path / "o"), 2),
                              train_cmd(0, other, digits["train"], str(tmp_path / "o"), 2)))
    assert re.search(r"the model fingerprint \w{12} on rank 0, fingerprint \w{12} on rank 1", line), line


@pytest.mark.parametrize("case", ["every rank", "rank 1 only"])
def test_a_mistake_before_training_is_printed_once(case, v8, models, digits, tmp_path):
    """Every rank sees it (a bad option, one argparse refuses, a model without the all-reduce):
    rank 0 says it; one rank sees it (a missing data file, a missing model, an unreadable
    option): that rank."""
    model, data, out = v8("mlp:momentum"), digits["train"], str(tmp_path / "o")
    good = train_cmd(0, model, data, out, 2)
    if case == "every rank":
        for cmd, said in ((train_cmd(0, model, data, out, 0), "--steps 0: give an integer of at least 1"),
                          (train_cmd(0, models("mlp:momentum"), data, out, 2), "no all-reduce"),
                          (train_cmd(0, model, data, out, 2, "--seed", "x"), "--seed: invalid int value")):
            line = refused_once(ranks(cmd, cmd))
            assert line.startswith("vfgraph train: error: ") and said in line, line
    else:
        for cmd, said in ((train_cmd(0, model, str(tmp_path / "none.npz"), out, 2), "none.npz: no such data file"),
                          (train_cmd(0, str(tmp_path / "gone"), data, out, 2), "gone: no such file or directory"),
                          (train_cmd(0, model, data, out, 2, "--vnodes-per-rank", "4;4"), "--vnodes-per-rank 4;4")):
            line = refused_once(ranks(good, cmd))
            assert line.startswith("vfgraph train (rank 1): error: ") and said in line, line
    assert not os.path.exists(out)


def test_a_failure_during_training_is_printed_once(v8, digits, tmp_path):
    """A non-finite loss from rank 1's share of the first batch only: the loss is the job's, so
    every rank sees it; rank 0 says it, once, and nothing is written."""
    from vfgraph.runtime.train import batches_for, load_npz

    data = load_npz(digits["train"])
    order = np.random.default_rng(0).permutation(len(data["x"]))
    rows = np.sort(order[:BATCH])[BATCH // 2:]  # the second half of step 0's batch: rank 1's
    data["x"] = data["x"].astype(np.float32)
    data["x"][rows] = np.nan
    assert np.isnan(batches_for(data, ["x"], BATCH, 0)["x"][BATCH // 2:]).all()
    bad = str(tmp_path / "nan.npz")
    np.savez(bad, **data)
    cmd = train_cmd(0, v8("mlp:momentum"), bad, str(tmp_path / "o"), 2)
    line = refused_once(ranks(cmd, cmd))
    assert "error: rank 0, step 0: the loss is nan" in line, line
    assert not os.path.exists(tmp_path / "o")
