"""Pipeline stages on MPI ranks under real ``mpiexec``: ``mpiexec -n K vfgraph train`` runs stage
k on rank k-1, tensors crossing the cuts sent with VfSend / VfRecv, and trains the parameters
one process trains with the same rewritten model (the unpartitioned step with the same V)."""
import os
import subprocess

import pytest

from test_mpi_train import ENV, assert_same_params, losses, run_train, train_cmd

pytestmark = pytest.mark.mpi

# (model, stages, schedule). The transformer with SGD: under Adam, a parameter whose gradient
# is zero but for rounding (an attention key bias) moves by the learning rate either way.
CASES = [("mlp:adam", 2, "1f1b"), ("mlp:adam", 2, "gpipe"), ("cnn", 2, "1f1b"), ("transformer:sgd", 2, "1f1b"),
         ("mlp:adam", 3, "1f1b")]


@pytest.fixture(scope="module")
def staged(models, tmp_path_factory):
    """Models rewritten with 8 virtual nodes of 8 examples cut into stages on ranks."""
    import vfgraph

    root = tmp_path_factory.mktemp("staged")
    made = {}

    def get(name, k, schedule):
        key = (name, k, schedule)
        if key not in made:
            out = str(root / f"{name.replace(':', '_')}_k{k}_{schedule}")
            vfgraph.save(vfgraph.rewrite(models(name), vnodes=8, vnode_batch=8, stages=k, schedule=schedule), out)
            made[key] = out
        return made[key]

    return get


@pytest.mark.parametrize("name, k, schedule", CASES, ids=[f"{n}-k{k}-{s}" for n, k, s in CASES])
def test_stages_on_ranks_train_what_one_process_trains(staged, digits, tmp_path, name, k, schedule):
    model = staged(name, k, schedule)
    one, ranks = str(tmp_path / "one"), str(tmp_path / "ranks")
    run_train(0, model, digits["train"], one, 3)
    run_train(k, model, digits["train"], ranks, 3)
    assert_same_params(one, ranks, 1e-6)
    for a, b in zip(losses(one), losses(ranks)):
        assert b == pytest.approx(a, rel=1e-6)
    from vfgraph import records
    from vfgraph.records import Stages

    rec = records.read(model, Stages)["train"]
    assert rec.on_ranks and rec.signatures == tuple(f"train_stage_{i + 1}" for i in range(k))
    assert os.path.isdir(ranks + ".serving/1")


def test_a_wrong_number_of_ranks_is_one_line(staged, digits, tmp_path):
    model = staged("mlp:adam", 2, "1f1b")
    res = subprocess.run(train_cmd(3, model, digits["train"], str(tmp_path / "o"), 1), capture_output=True, text=True,
                         env=ENV, timeout=300)
    assert res.returncode == 2, res.stderr[-2000:]
    assert "cut into 2 pipeline stages, one per MPI rank" in res.stderr and "start 2 ranks" in res.stderr
    assert not os.path.exists(tmp_path / "o")
