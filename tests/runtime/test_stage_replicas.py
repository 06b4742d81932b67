"""Replicas of a pipeline whose stages share state, under real ``mpiexec``: ``mpiexec -n K*D``
runs D replicas of K stages (rank r runs stage r mod K of replica r // K). What the stages of a
replica exchange after the virtual-node loop (a shared layer's summed gradient, clipping's
squared norms) is broadcast among the K ranks of that replica only (``VfBroadcast`` with
``stages=K``), so the replicas neither wait for nor read each other's update. They train the
parameters one process trains with the same rewritten model (the unpartitioned step, same V)."""
import subprocess
import sys

import pytest

from test_mpi_train import ENV, MPIEXEC

pytestmark = pytest.mark.mpi

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
print("RANK", rank, *got, "refused" if "not split into stages" in refused else "ran", flush=True)
"""


def _broadcast_on(ranks: int, k: int) -> dict:
    """Each rank's broadcasts of BROADCAST under ``mpiexec -n ranks``: {rank: line}."""
    res = subprocess.run([MPIEXEC, "-n", str(ranks), sys.executable, "-c", BROADCAST, str(k)], capture_output=True,
                         text=True, env=ENV, timeout=180)
    assert res.returncode == 0, res.stderr[-3000:]
    lines = [line.split() for line in res.stdout.splitlines() if line.startswith("RANK ")]
    return {int(w[1]): w[2:] for w in lines}


@pytest.mark.parametrize("ranks,k", [(2, 1), (2, 2), (4, 2)])
def test_a_broadcast_with_stages_spans_one_replica(ranks, k):
    """``VfBroadcast(stages=K)`` hands every rank the value of stage ``root`` of its own replica
    (rank r - r % K + root), the whole communicator's broadcast still rank ``root``'s; without a
    split into stages it is refused, not run over the wrong ranks."""
    got = _broadcast_on(ranks, k)
    assert sorted(got) == list(range(ranks))
    for r, words in got.items():
        expect = [str(r - r % k + root) for root in range(k)] + ["0", "refused"]
        assert words == expect, (r, words)

