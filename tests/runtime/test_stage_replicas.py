"""Replicas of a pipeline whose stages share state, under real ``mpiexec``: ``mpiexec -n K*D``
runs D replicas of K stages (rank r runs stage r mod K of replica r // K). What the stages of a
replica exchange after the virtual-node loop (a shared layer's summed gradient, clipping's
squared norms) is broadcast among the K ranks of that replica only (``VfBroadcast`` with
``stages=K``), so the replicas neither wait for nor read each other's update. They train the
parameters one process trains with the same rewritten model (the unpartitioned step, same V)."""
import os
import subprocess
import sys

import pytest

from test_mpi_train import ENV, MPIEXEC, assert_same_params, losses, params, run_train
from test_stage_shared import _export

pytestmark = pytest.mark.mpi

# clipping over 3 stages: one Dense per stage (the balanced cut leaves the last stage only the loss)
SPLIT = {("clip3", 3): ("functional_1/hidden2_1/MatMul", "functional_1/logits_1/MatMul")}
# every job ends by itself: a wait longer than this is a stall, which ends the job (exit 75)
NO_HANG = ("--stall-warning", "20", "--stall-timeout", "120")

BROADCAST = r"""
import sys
import tensorflow as tf
from mpi4py import MPI
from vfgraph import ops

k = int(sys.argv[1])
comm = MPI.COMM_WORLD
rank = comm.Get_rank()
ops.set_communicator(comm.Dup(), stages=k)
got = []
for root in range(k):  # every stage of the replica in turn, then the whole communicator
    got.append(int(ops.broadcast(tf.constant([rank], tf.int64), root=root, stages=k).numpy()[0]))
got.append(int(ops.broadcast(tf.constant([rank], tf.int64), root=0).numpy()[0]))
ops.set_communicator(MPI.COMM_WORLD)
try:
    ops.broadcast(tf.constant([rank], tf.int64), stages=k)
    refused = ""
except tf.errors.FailedPreconditionError as e:
    refused = e.message
with open(f"{sys.argv[2]}/rank{rank}", "w") as f:  # a file each: ranks' lines on one stdout may interleave
    print(*got, "refused" if "not split into stages" in refused else "ran", file=f)
"""


def _broadcast_on(ranks: int, k: int, out) -> dict:
    """Each rank's broadcasts of BROADCAST under ``mpiexec -n ranks``: {rank: words}."""
    res = subprocess.run([MPIEXEC, "-n", str(ranks), sys.executable, "-c", BROADCAST, str(k), str(out)],
                         capture_output=True, text=True, env=ENV, timeout=180)
    assert res.returncode == 0, res.stderr[-3000:]
    return {int(p.name[4:]): p.read_text().split() for p in out.glob("rank*")}


@pytest.mark.parametrize("ranks,k", [(2, 1), (2, 2), (4, 2)])
def test_a_broadcast_with_stages_spans_one_replica(ranks, k, tmp_path):
    """``VfBroadcast(stages=K)`` hands every rank the value of stage ``root`` of its own replica
    (rank r - r % K + root), the whole communicator's broadcast still rank ``root``'s; without a
    split into stages it is refused, not run over the wrong ranks."""
    got = _broadcast_on(ranks, k, tmp_path)
    assert sorted(got) == list(range(ranks))
    for r, words in got.items():
        expect = [str(r - r % k + root) for root in range(k)] + ["0", "refused"]
        assert words == expect, (r, words)


@pytest.fixture(scope="module")
def replicated(tmp_path_factory):
    """``get(kind, k)``: a model of test_stage_shared's ``kind`` rewritten with 8 virtual nodes
    of 8 examples, cut into ``k`` stages on MPI ranks, with the all-reduce between replicas."""
    import vfgraph

    root = tmp_path_factory.mktemp("stage_replicas")
    made = {}

    def get(kind, k):
        if (kind, k) not in made:
            original, out = str(root / kind), str(root / f"{kind}_k{k}")
            if not os.path.exists(original):
                _export(kind, original)
            vfgraph.save(vfgraph.rewrite(original, vnodes=8, vnode_batch=8, stages=k, allreduce="mpi",
                                         split_at=SPLIT.get((kind, k), ())), out)
            made[kind, k] = out
        return made[kind, k]

    return get


def _update_broadcasts(model: str) -> list:
    """(stage function, node, root, stages) of every VfBroadcast of the stages' update functions."""
    import vfgraph

    item = vfgraph.load(model)
    return [(name, n.name, n.attr["root"].i, n.attr["stages"].i) for name, f in sorted(item.library.items())
            for n in f.node_def if n.op == "VfBroadcast" and n.name.startswith("vf/stage/shared_")]


def _same_as_one_process(model: str, ranks: int, data: str, tmp_path) -> None:
    """``model`` trained 2 steps on ``ranks`` ranks ends where one process's training ends."""
    one, staged = str(tmp_path / "one"), str(tmp_path / "ranks")
    run_train(0, model, data, one, 2, *NO_HANG)
    run_train(ranks, model, data, staged, 2, *NO_HANG)
    assert_same_params(one, staged, 1e-6)
    assert losses(staged) == pytest.approx(losses(one), rel=1e-6)
    before, after = params(model), params(staged)
    trained = [k for k in before if "kernel" in k or "bias" in k]
    assert trained and all((before[k] != after[k]).any() for k in trained)  # every layer trained


@pytest.mark.parametrize("kind", ["shared", "clip"])
def test_replicas_of_stages_sharing_state_train_what_one_process_trains(replicated, digits, tmp_path, kind):
    """2 stages x 2 replicas (4 ranks): a layer applied on both sides of the cut (its summed
    gradient broadcast to both stages), and Adam with ``global_clipnorm`` (each stage's squared
    norms broadcast to both), each within its replica: the parameters equal one process's
    within 1e-6, and the job ends by itself."""
    model = replicated(kind, 2)
    sent = _update_broadcasts(model)
    assert sent and all(stages == 2 for *_, stages in sent), sent
    _same_as_one_process(model, 4, digits["train"], tmp_path)


@pytest.mark.parametrize("kind", ["shared", "clip3"])
def test_three_stages_sharing_state_train_what_one_process_trains(replicated, digits, tmp_path, kind):
    """3 stages on 3 ranks: the shared layer, applied first and last, held by stages 1 and 3 and
    its summed gradient broadcast to both; and clipping by the global norm with a layer on each
    stage, the squared norms of all three added on each in one process's order."""
    from vfgraph import records
    from vfgraph.records import Stages

    model = replicated(kind, 3)
    parts = records.read(model, Stages)["train"].parts
    assert all(p.variables for p in parts), [p.variables for p in parts]
    sent = _update_broadcasts(model)
    assert {(root, stages) for *_, root, stages in sent} == ({(0, 3)} if kind == "shared" else
                                                             {(0, 3), (1, 3), (2, 3)}), sent
    _same_as_one_process(model, 3, digits["train"], tmp_path)
