"""The stall watchdog and stop requests under real ``mpiexec``: a rank stopped with SIGSTOP
mid-run is named by the other within --stall-warning, the job ends by itself after
--stall-timeout with exit code 75 and a checkpoint --resume continues from, and the waiting rank
does not burn its core meanwhile; SIGTERM to mpiexec while a rank is stopped ends the others
within 10 s (exit 130)."""
import contextlib
import json
import os
import re
import signal
import subprocess
import time

import pytest

from test_mpi_train import ENV, _rank_pid, losses, run_train, train_cmd, wait_for_checkpoint
from vfgraph.testing.cli import one_error, run_in_process

pytestmark = pytest.mark.mpi

WARNING, TIMEOUT = 2, 8


@pytest.fixture(scope="module")
def two_rank_models(models, tmp_path_factory):
    """The MLP as 8 virtual nodes of 8 examples: cut into 2 pipeline stages on ranks (its waits
    are messages), and data-parallel with the all-reduce (its waits are collectives)."""
    import vfgraph

    root = tmp_path_factory.mktemp("watchdog")
    made = {}
    for kind, options in (("stages", dict(stages=2, schedule="1f1b")), ("allreduce", dict(allreduce="mpi"))):
        made[kind] = str(root / kind)
        vfgraph.save(vfgraph.rewrite(models("mlp:adam"), vnodes=8, vnode_batch=8, **options), made[kind])
    return made


def _cpu_seconds(pid: int) -> float:
    with open(f"/proc/{pid}/stat") as f:
        fields = f.read().rsplit(")", 1)[1].split()
    return (int(fields[11]) + int(fields[12])) / os.sysconf("SC_CLK_TCK")


@contextlib.contextmanager
def stopped_run(model, data, out, *extra):
    """A 2-rank run of ``model`` whose rank 1 is stopped (SIGSTOP) once the checkpoint of step 5
    is written: yields (mpiexec's process, the stopped worker's pid, when it was stopped,
    the file stderr goes to). Afterwards the stopped worker is continued and every process of
    the run killed."""
    err_path = out + ".stderr"
    with open(err_path, "w") as err:
        proc = subprocess.Popen(train_cmd(2, model, data, out, 100000, "--checkpoint-every", "5", *extra),
                                stdout=subprocess.DEVNULL, stderr=err, text=True, env=ENV, start_new_session=True)
    victim = None
    try:
        wait_for_checkpoint(proc, out + ".ckpt/progress.json", 5)
        victim = _rank_pid(1, out)
        assert victim is not None
        os.kill(victim, signal.SIGSTOP)
        yield proc, victim, time.monotonic(), err_path
    finally:
        for pid in (victim, _rank_pid(0, out), _rank_pid(1, out)):
            if pid is not None:
                with contextlib.suppress(ProcessLookupError):
                    os.kill(pid, signal.SIGCONT)
                    os.kill(pid, signal.SIGKILL)
        with contextlib.suppress(ProcessLookupError):
            os.killpg(proc.pid, signal.SIGKILL)
        proc.wait()


def _read(path) -> str:
    with open(path) as f:
        return f.read()


def _wait_for_line(proc, err_path, pattern, seconds) -> float:
    """When a line matching ``pattern`` appeared in the run's stderr (time.monotonic())."""
    deadline = time.monotonic() + seconds
    while time.monotonic() < deadline and proc.poll() is None:
        if re.search(pattern, _read(err_path), re.M):
            return time.monotonic()
        time.sleep(0.05)
    raise AssertionError(f"no line matching {pattern!r} within {seconds} s:\n{_read(err_path)[-3000:]}")


# the line of rank 0 naming what it waits in and for: a message from rank 1, or a collective rank 1
# was not seen entering (where a stage rank stops: a message between stages, or a collective of
# the step's end), or the runtime's own exchange between steps, which rank 1 was not seen entering
NAMED = (r"^vfgraph: rank 0: waiting \d+ s in (Vf\w+ \(node '[^']+', step \d+(, collective \d+ of its communicator)?\) "
         r"for (message tag \d+ from rank 1|rank 1 \(not seen entering it\))|the ranks' exchange at step \d+ for rank 1 "
         r"\(not seen entering it\)); the job ends after --stall-timeout 8 s")


@pytest.mark.parametrize("kind", ["stages", "allreduce"])
def test_a_stopped_rank_is_named_and_the_job_ends_after_the_timeout(two_rank_models, digits, tmp_path, kind):
    """Rank 0 names stopped rank 1 within the warning time (one line), waits without burning
    its core, and after the timeout the job ends by itself with exit 75 and one error line; the
    checkpoint it kept is one --resume continues from."""
    model, out = two_rank_models[kind], str(tmp_path / "run")
    with stopped_run(model, digits["train"], out, "--stall-warning", str(WARNING), "--stall-timeout",
                     str(TIMEOUT)) as (proc, victim, stopped, err_path):
        named = _wait_for_line(proc, err_path, NAMED, 60)
        assert named - stopped < WARNING + 3, _read(err_path)[-3000:]  # (the wait may start before the stop)
        waiting = _rank_pid(0, out)
        before, began = _cpu_seconds(waiting), time.monotonic()
        time.sleep(3)
        cpu = _cpu_seconds(waiting) - before
        assert cpu < 0.25 * (time.monotonic() - began), f"rank 0 used {cpu:.2f} s of CPU in 3 s while it waited"
        proc.wait(timeout=60)
        ended = time.monotonic()
        err = _read(err_path)
    assert proc.returncode == 75, err[-3000:]
    assert TIMEOUT <= ended - stopped < TIMEOUT + 20, err[-3000:]
    assert len(re.findall(r"waiting \d+ s in", err)) == 1, err[-3000:]
    stalled = [line for line in err.splitlines() if line.startswith("vfgraph train: ")]
    assert len(stalled) == 1 and "Traceback" not in err, err[-3000:]
    assert re.match(r"vfgraph train: stalled: rank 0, step \d+: (Vf\w+ \(node '[^']+'.*\) waited \d+ s|waited \d+ s in "
                    r"the ranks' exchange at step \d+) for .*rank 1.* without progress \(--stall-timeout 8\); the job "
                    r"ends; the last good checkpoint \(step \d+\) is kept in .*, --resume continues from it",
                    stalled[0]), stalled[0]
    with open(out + ".ckpt/progress.json") as f:
        saved = json.load(f)["step"]
    assert saved >= 5 and f"(step {saved})" in stalled[0]
    run_train(2, model, digits["train"], out, saved + 2, "--checkpoint-every", "5", "--resume")
    assert len(losses(out)) == saved + 2


def test_sigterm_to_mpiexec_ends_the_other_ranks_while_one_is_stopped(two_rank_models, digits, tmp_path):
    """No timeout: SIGTERM to mpiexec while rank 1 is stopped and rank 0 waits for its message
    ends rank 0 (and the job) within 10 s, exit 130, the last checkpoint kept."""
    model, out = two_rank_models["stages"], str(tmp_path / "run")
    with stopped_run(model, digits["train"], out, "--stall-warning", str(WARNING), "--stall-timeout", "0") as (
            proc, victim, stopped, err_path):
        _wait_for_line(proc, err_path, r"^vfgraph: rank 0: waiting \d+ s in .* for .*rank 1.*; no --stall-timeout: "
                                        r"waiting on", 60)
        waiting = _rank_pid(0, out)
        proc.send_signal(signal.SIGTERM)
        sent = time.monotonic()
        while time.monotonic() - sent < 10 and _rank_pid(0, out) is not None:
            time.sleep(0.05)
        assert _rank_pid(0, out) is None, _read(err_path)[-3000:]
        proc.wait(timeout=10)
        err = _read(err_path)
    assert waiting is not None and proc.returncode == 130, err[-3000:]
    lines = [line for line in err.splitlines() if line.startswith("vfgraph train: ")]
    assert len(lines) == 1 and re.match(r"vfgraph train: interrupted: rank 0, step \d+: stopped while waiting for "
                                        r"other ranks; the last good checkpoint \(step \d+\) is kept", lines[0]), err
    with open(out + ".ckpt/progress.json") as f:
        assert json.load(f)["step"] >= 5


@pytest.mark.parametrize("option, value", [("--stall-warning", "-1"), ("--stall-timeout", "inf"),
                                           ("--stall-timeout", "nan")])
def test_a_stall_limit_that_is_not_a_number_of_seconds_is_one_line(capsys, two_rank_models, digits, tmp_path,
                                                                   option, value):
    code, err = run_in_process(capsys, "train", two_rank_models["allreduce"], "--data", digits["train"], "--steps",
                               1, "--batch-size", 64, "-o", tmp_path / "o", option, value)
    one_error(code, err, f"{option} {value}: give a number of seconds of at least 0 (0: off)")
    assert not os.path.exists(tmp_path / "o")


EXCHANGE = r"""
import sys, time
from vfgraph.runtime import world, train
from vfgraph.runtime.world import launched_world

w = launched_world()
late = [int(r) for r in sys.argv[1].split(",")]
world.watcher = train._WatchedExchanges(train._StopRequests(), 2.0, 0, lambda: w.rank, lambda: "step 7",
                                        lambda: "")
w.gather(w.rank)  # an exchange every rank joins at once: the next one is number 1 on every rank
if w.rank in late:
    time.sleep(5)
with open(f"{sys.argv[2]}/rank{w.rank}", "w") as f:
    f.write(str(w.gather(w.rank) == list(range(w.size))))
"""


@pytest.mark.parametrize("ranks, late", [(3, "2"), (4, "1,3")])
def test_the_runtime_exchange_names_the_ranks_not_in_it(ranks, late, tmp_path):
    """Of three or four ranks, a rank waiting past --stall-warning in the runtime's own exchange
    between steps names exactly the ranks that have not entered it, numbered alike on every rank
    after earlier exchanges."""
    import sys

    from test_mpi_train import MPIEXEC

    res = subprocess.run([MPIEXEC, "-n", str(ranks), sys.executable, "-c", EXCHANGE, late, str(tmp_path)],
                         capture_output=True, text=True, env=ENV, timeout=120)
    assert res.returncode == 0 and "pending" not in res.stderr, res.stderr[-3000:]  # (no communicator left over)
    assert [(tmp_path / f"rank{r}").read_text() for r in range(ranks)] == ["True"] * ranks
    absent = late.split(",")
    named = "rank" + ("s " if len(absent) > 1 else " ") + ", ".join(absent)
    for r in range(ranks):
        lines = re.findall(rf"^vfgraph: rank {r}: waiting .*$", res.stderr, re.M)
        if str(r) in absent:
            assert not lines, res.stderr
        else:
            assert lines == [f"vfgraph: rank {r}: waiting 2 s in the ranks' exchange at step 7 for {named} (not seen "
                             "entering it); no --stall-timeout: waiting on"], res.stderr
