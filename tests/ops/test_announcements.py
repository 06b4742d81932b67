"""A rank that waits long in a collective announces it to the others (so a stalled job's
warning names the ranks not in it). Announcements nobody had to read must not outlive the job
on its communicator: MPICH's finalization tripped over them left on ``MPI_COMM_WORLD`` and
killed the job at its very end (exit 9, about one run in four) after it had trained. Three
ranks under the venv's mpiexec, the ops on ``MPI_COMM_WORLD`` (no communicator chosen), one
rank 3 s late to an all-reduce."""
from __future__ import annotations

import re

import pytest

from test_mpi_ops import MPIEXEC, _run

pytest.importorskip("mpi4py")
pytestmark = pytest.mark.mpi

LATE = r"""
import sys, time
import tensorflow as tf
from mpi4py import MPI
from vfgraph import ops

rank = MPI.COMM_WORLD.Get_rank()
ops.watch(2.0, 0)
ops.allreduce(tf.constant([1.0]))
if rank == 2:
    time.sleep(3.5)
got = float(ops.allreduce(tf.constant([float(rank)])).numpy()[0])
with open(f"{sys.argv[1]}/rank{rank}", "w") as f:
    f.write(str(got))
"""


def test_a_late_rank_is_named_and_the_job_still_ends_cleanly(tmp_path):
    """Three runs: each ends with exit 0, every rank's sum right, no communicator left behind
    at finalization; the two waiting ranks name rank 2 in their one warning line."""
    for run in range(3):
        out = tmp_path / str(run)
        out.mkdir()
        code, text = _run([MPIEXEC, "-n", "3", "python", "-c", LATE, str(out)], timeout=120)
        assert code == 0, text[-3000:]
        assert [(out / f"rank{r}").read_text() for r in range(3)] == ["3.0"] * 3, text[-3000:]
        assert "pending" not in text, text[-3000:]
        named = re.findall(r"^vfgraph: rank (\d): waiting \d+ s in VfAllreduce .* for rank 2 \(not seen entering it\)",
                           text, re.M)
        assert sorted(named) == ["0", "1"], text[-3000:]
