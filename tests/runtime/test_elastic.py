"""Elastic training under real ``mpiexec``: a job started on 1 rank grows to 2 and 4 ranks and
shrinks to 2 on its own schedule (new ranks started by a launcher of their own) and ends
bit-identical, in deterministic mode, to 1 rank throughout, also when a new rank is killed
mid-run; what it cannot do is refused before it starts."""
import os
import re
import subprocess
import time

import numpy as np
import pytest

from test_mpi_train import ENV, losses, params, rewritten, run_train, train_cmd

pytestmark = pytest.mark.mpi

SCHEDULE = "0:1,5:2,10:4,15:2"


@pytest.fixture(scope="module")
def exact(models, tmp_path_factory):
    return rewritten(models, tmp_path_factory.mktemp("elastic"), deterministic=True)


LONG = "15000"  # steps of the runs resized from outside: long enough for a new rank to load the model


@pytest.fixture(scope="module")
def long_reference(exact, digits, tmp_path_factory):
    """The deterministic MLP trained LONG steps on one rank (one thread): what the jobs resized
    from outside must end with."""
    out = str(tmp_path_factory.mktemp("elastic_reference") / "one")
    run_train(0, exact("mlp:adam"), digits["train"], out, int(LONG), "--threads", "1", timeout=600)
    return out


def read_until(stream, lines: list, pattern: str) -> bool:
    """Read ``stream``'s lines into ``lines`` up to and with the first that matches the regular
    expression ``pattern`` (to its end if none does); whether one did."""
    for line in stream:
        lines.append(line)
        if re.search(pattern, line):
            return True
    return False


def test_grow_and_shrink_on_a_schedule_is_bit_identical_to_one_rank(exact, digits, tmp_path):
    model = exact("mlp:adam")
    run_train(0, model, digits["train"], str(tmp_path / "one"), 20, "--threads", "1")
    res = run_train(1, model, digits["train"], str(tmp_path / "elastic"), 20, "--threads", "1", "--max-ranks", "4",
                    "--elastic-schedule", SCHEDULE, timeout=600)
    resized = re.findall(r"resized (\d) -> (\d) ranks at step (\d+)", res.stderr)
    assert resized == [("1", "2", "5"), ("2", "4", "10"), ("4", "2", "15")], res.stderr[-3000:]
    assert len(re.findall(r"rank \d joined at step", res.stderr)) == 3
    assert "virtual nodes per rank 2+2+2+2" in res.stderr
    reference, got = params(str(tmp_path / "one")), params(str(tmp_path / "elastic"))
    differ = [k for k in reference if not np.array_equal(reference[k], got[k])]
    assert not differ, f"{differ[:3]} differ from one rank"
    assert losses(str(tmp_path / "elastic")) == losses(str(tmp_path / "one"))


def test_a_growth_after_a_shrink_calls_back_the_ranks_that_left(exact, digits, tmp_path):
    """1 -> 2 -> 1 -> 2 ranks: the rank that left at the shrink waits, warm, and comes back for
    the second growth (no new process is started for it); bit-identical to one rank."""
    model = exact("mlp:adam")
    run_train(0, model, digits["train"], str(tmp_path / "one"), 12, "--threads", "1")
    res = run_train(1, model, digits["train"], str(tmp_path / "elastic"), 12, "--threads", "1", "--max-ranks", "2",
                    "--elastic-schedule", "0:1,3:2,6:1,9:2", timeout=600)
    resized = re.findall(r"resized (\d) -> (\d) ranks at step (\d+)", res.stderr)
    assert resized == [("1", "2", "3"), ("2", "1", "6"), ("1", "2", "9")], res.stderr[-3000:]
    assert "resized 1 -> 2 ranks at step 9: 1 rank that had left came back" in res.stderr, res.stderr[-3000:]
    assert "rank 1 came back at step 9" in res.stderr
    assert len(re.findall(r"starting \d new ranks? for the next growth", res.stderr)) == 1, res.stderr[-3000:]
    reference, got = params(str(tmp_path / "one")), params(str(tmp_path / "elastic"))
    differ = [k for k in reference if not np.array_equal(reference[k], got[k])]
    assert not differ, f"{differ[:3]} differ from one rank"
    assert losses(str(tmp_path / "elastic")) == losses(str(tmp_path / "one"))


BAD_SCHEDULES = {
    "above-max": (("--max-ranks", "4", "--elastic-schedule", "0:1,5:5"), "5 ranks is outside 1..4"),
    "below-one": (("--max-ranks", "4", "--elastic-schedule", "0:1,5:0"), "0 ranks is outside 1..4"),
    "start-size": (("--max-ranks", "4", "--elastic-schedule", "0:2,5:1"), "starts with 2 ranks at step 0"),
    "order": (("--max-ranks", "4", "--elastic-schedule", "5:2,0:1"), "the steps must increase"),
    "syntax": (("--max-ranks", "4", "--elastic-schedule", "0:1,x"), "give STEP:RANKS pairs"),
    "no-max": (("--elastic-schedule", "0:1,5:2"), "--max-ranks goes with"),
    "fixed-shares": (("--max-ranks", "2", "--elastic-schedule", "0:1,5:2", "--vnodes-per-rank", "1"), "give auto"),
}


@pytest.fixture(scope="module")
def refused(exact, digits, tmp_path_factory):
    """Every bad schedule's run (started together): its exit status, stderr and output path."""
    root = tmp_path_factory.mktemp("bad_schedules")
    procs = {case: subprocess.Popen(train_cmd(1, exact("mlp:adam"), digits["train"], str(root / case), 4, *extra),
                                    stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, text=True, env=ENV)
             for case, (extra, _) in BAD_SCHEDULES.items()}
    done = {case: p.communicate(timeout=300)[1] for case, p in procs.items()}
    return {case: (procs[case].returncode, stderr, root / case) for case, stderr in done.items()}


@pytest.mark.parametrize("case", list(BAD_SCHEDULES))
def test_bad_schedules_are_refused_with_one_line(refused, case):
    code, stderr, out = refused[case]
    errors = [line for line in stderr.splitlines() if line.startswith("vfgraph train")]
    assert code == 2 and len(errors) == 1 and BAD_SCHEDULES[case][1] in errors[0], stderr[-2000:]
    assert "Traceback" not in stderr and not out.exists()


def test_a_new_rank_with_another_model_is_refused_and_the_job_goes_on(exact, digits, tmp_path):
    """The model at the job's path is replaced by another one while the new rank starts: rank 0
    refuses it with one line and trains on with 1 rank, as a run of 1 rank throughout would."""
    import shutil
    import sys

    from test_mpi_train import MPIEXEC

    path = str(tmp_path / "model")
    shutil.copytree(exact("mlp:adam"), path)
    run_train(0, path, digits["train"], str(tmp_path / "one"), 30, "--threads", "1")
    cmd = [MPIEXEC, "-n", "1", sys.executable, "-m", "vfgraph.cli", "-v", "train", path, "--data", digits["train"],
           "--steps", "30", "--batch-size", "64", "-o", str(tmp_path / "elastic"), "--no-progress", "--threads", "1",
           "--max-ranks", "2", "--elastic-schedule", "0:1,10:2"]
    proc = subprocess.Popen(cmd, stderr=subprocess.PIPE, text=True, env=ENV)
    lines = []
    # (the new process imports TensorFlow before it reads the model)
    if read_until(proc.stderr, lines, "starting 1 new rank"):
        shutil.copytree(exact("cnn:momentum"), path + ".new")
        os.rename(path, path + ".old")
        os.rename(path + ".new", path)
    lines.extend(proc.stderr)
    assert proc.wait(timeout=600) == 0, "".join(lines)[-3000:]
    text = "".join(lines)
    refused = [line for line in lines if "refused 1 new rank at step 10" in line]
    assert len(refused) == 1 and "opened another model than rank 0" in refused[0], text[-3000:]
    assert "resized" not in text and "Traceback" not in text
    assert losses(str(tmp_path / "elastic")) == losses(str(tmp_path / "one"))


def test_resize_requests_while_the_job_runs(exact, digits, tmp_path, long_reference):
    """`vfgraph resize`: a request above --max-ranks is refused with one line and the job goes on;
    a request for 2 ranks is taken at the next step and the job grows once the new rank has
    loaded the model, training on meanwhile, and a request for 1 rank shrinks it again; the
    result is the one-rank result, bit for bit."""
    import sys

    from test_mpi_train import MPIEXEC, wait_for_checkpoint
    from vfgraph.runtime.elastic import request

    steps = LONG
    model = exact("mlp:adam")
    out = str(tmp_path / "elastic")
    cli = [sys.executable, "-m", "vfgraph.cli"]
    cmd = [MPIEXEC, "-n", "1", *cli, "-v", "train", model, "--data", digits["train"], "--steps", steps,
           "--batch-size", "64", "-o", out, "--no-progress", "--threads", "1", "--checkpoint-every", "500",
           "--max-ranks", "2", "--elastic-schedule", "0:1"]
    proc = subprocess.Popen(cmd, stderr=subprocess.PIPE, text=True, env=ENV)
    try:
        wait_for_checkpoint(proc, out + ".ckpt/progress.json", 500)
        for ranks in ("5", "2"):
            asked = subprocess.run(cli + ["resize", out, ranks], capture_output=True, text=True, env=ENV, timeout=60)
            assert asked.returncode == 0 and f"for {ranks} ranks" in asked.stdout, asked.stderr
            while os.path.exists(out + ".resize"):  # taken or refused at the job's next step
                assert proc.poll() is None
                time.sleep(0.05)
        bad = subprocess.run(cli + ["resize", out, "0"], capture_output=True, text=True, env=ENV, timeout=60)
        assert bad.returncode == 2 and "give at least 1" in bad.stderr and "Traceback" not in bad.stderr
        lines = []
        if read_until(proc.stderr, lines, "resized 1 -> 2 ranks"):
            request(out, 1)  # and back to 1 rank for the last steps
        text = "".join(lines) + proc.stderr.read()
    finally:
        if proc.poll() is None:
            proc.wait(timeout=600)
    assert proc.returncode == 0, text[-3000:]
    refused = [line for line in text.splitlines() if "refused the request for 5 ranks" in line]
    assert len(refused) == 1 and "outside 1..2" in refused[0], text[-3000:]
    assert re.search(r"request for 2 ranks taken at step \d+", text)
    assert re.search(r"resized 1 -> 2 ranks at step \d+", text), text[-3000:]
    assert re.search(r"resized 2 -> 1 ranks at step \d+", text), text[-3000:]
    assert_one_rank_result(out, long_reference)


def test_a_host_discovery_script_grows_and_shrinks_the_job(exact, digits, tmp_path, long_reference):
    """The production path: the job runs a script that lists the hosts available (HOST:SLOTS)
    and follows them, starting new ranks on free slots; output it cannot read is logged once
    and the last hosts kept; a new rank on a host its launcher cannot reach is refused and the
    job goes on."""
    import socket
    import sys

    from test_mpi_train import MPIEXEC, wait_for_checkpoint

    steps = LONG
    model = exact("mlp:adam")
    out = str(tmp_path / "elastic")
    hosts = tmp_path / "hosts.txt"
    hosts.write_text("localhost:1\n")
    cmd = [MPIEXEC, "-n", "1", sys.executable, "-m", "vfgraph.cli", "-v", "train", model, "--data", digits["train"],
           "--steps", steps, "--batch-size", "64", "-o", out, "--no-progress", "--threads", "1", "--checkpoint-every",
           "500", "--max-ranks", "2", "--host-discovery-script", f"cat {hosts}", "--discovery-interval", "0.2"]
    proc = subprocess.Popen(cmd, stderr=subprocess.PIPE, text=True, env=ENV)
    lines = []
    try:
        wait_for_checkpoint(proc, out + ".ckpt/progress.json", 500)
        hosts.write_text("localhost:one\n")  # unreadable: logged, the job goes on
        time.sleep(1)
        hosts.write_text("localhost:1\nnohost.invalid:1\n")  # the free slot: where no launcher reaches
        read_until(proc.stderr, lines, "refused 1 new rank")
        hosts.write_text("localhost:2\n")
        if read_until(proc.stderr, lines, "resized 1 -> 2"):
            hosts.write_text("localhost\n")  # one slot again
        lines.extend(proc.stderr)
    finally:
        proc.wait(timeout=600)
    text = "".join(lines)
    assert proc.returncode == 0, text[-3000:]
    assert len(re.findall(r"host discovery script .*'localhost:one' is not HOST or HOST:SLOTS", text)) == 1, text
    assert re.search(r"host discovery: 2 slots at step \d+; resizing to 2 ranks", text)
    assert re.search(r"starting 1 new rank for the next growth on nohost.invalid:1\n", text), text[-3000:]
    assert re.search(r"refused 1 new rank at step \d+: new process 0 failed to start: its launcher ended \(status "
                     r"\d+\) before it connected; the job goes on with 1 rank\n", text), text[-3000:]
    assert re.search(rf"starting 1 new rank for the next growth on {re.escape(socket.gethostname())}:1\n", text)
    assert re.search(r"resized 2 -> 1 ranks at step \d+", text), text[-3000:]
    assert_one_rank_result(out, long_reference)


def assert_one_rank_result(out, reference):
    """The model trained into ``out`` has the parameters and losses of ``reference``, bit for bit."""
    want, got = params(reference), params(out)
    assert all(np.array_equal(want[k], got[k]) for k in want)
    assert losses(out) == losses(reference)


def processes():
    """(pid, command line) of every process."""
    found = []
    for entry in os.listdir("/proc"):
        try:
            with open(f"/proc/{entry}/cmdline", "rb") as f:
                found.append((int(entry), f.read().decode(errors="replace").split("\0")))
        except (ValueError, OSError):
            pass
    return found


def environment(pid):
    """The environment variables of process ``pid``."""
    with open(f"/proc/{pid}/environ", "rb") as f:
        return dict(e.decode(errors="replace").partition("=")[::2] for e in f.read().split(b"\0") if e)


def elastic_cmd(model, digits, out, max_ranks, schedule):
    """An elastic job of LONG steps on the deterministic MLP, one thread per rank."""
    import sys

    from test_mpi_train import MPIEXEC

    return [MPIEXEC, "-n", "1", sys.executable, "-m", "vfgraph.cli", "-v", "train", model, "--data", digits["train"],
            "--steps", LONG, "--batch-size", "64", "-o", out, "--no-progress", "--threads", "1", "--max-ranks",
            str(max_ranks), "--elastic-schedule", schedule]


def run_and_kill(cmd, out, after, group, regrown, delay=1.0):
    """Run the elastic job ``cmd`` (writing ``out``); ``delay`` seconds after it logs ``after``,
    kill (SIGKILL) its rank of the ``group``-th start of new ranks; once it logs ``regrown``
    after that (the growth that replaces the rank), ask it for 1 rank, so that it trains its
    last steps alone. Its exit status and log; no process of the job may be left behind."""
    import signal

    from vfgraph.runtime.elastic import request

    proc = subprocess.Popen(cmd, stderr=subprocess.PIPE, text=True, env=ENV)
    lines = []
    try:
        read_until(proc.stderr, lines, re.escape(after))
        time.sleep(delay)  # training on the new layout
        ranks = [pid for pid, args in processes() if "--elastic-join" in args and out in args
                 and "vfgraph.cli" in args[1:3]  # (the rank, not its launcher)
                 and environment(pid).get("VFGRAPH_ELASTIC_GROUP") == str(group)]
        assert len(ranks) == 1, "".join(lines)[-3000:]
        os.kill(ranks[0], signal.SIGKILL)
        if read_until(proc.stderr, lines, regrown):
            request(out, 1)
        lines.extend(proc.stderr)
    finally:
        proc.wait(timeout=600)
    assert not [pid for pid, args in processes() if out in " ".join(args)], "processes of the job were left behind"
    text = "".join(lines)
    assert re.search(r"request for 1 ranks taken at step \d+", text), text[-3000:]
    assert re.search(r"resized \d -> 1 ranks at step \d+", text), text[-3000:]
    return proc.returncode, text


def test_a_rank_killed_mid_run_is_survived_with_the_uninterrupted_result(exact, digits, tmp_path, long_reference):
    """A new rank killed (SIGKILL) while the job trains on 2 ranks: rank 0's wait for it gives
    up, rank 0 goes back to its last completed step in memory, trains on alone and grows again
    on the schedule (a new rank), and the result is the uninterrupted one-rank result, bit for
    bit."""
    out = str(tmp_path / "elastic")
    code, text = run_and_kill(elastic_cmd(exact("mlp:adam"), digits, out, 2, "0:1,2:2"), out,
                              "resized 1 -> 2 ranks at step 2", 1, r"resized 1 -> 2 ranks at step \d+")
    assert code == 0, text[-3000:]
    lost = re.findall(r"1 rank that joined the job \(launcher pid \d+\) ended with status \d+ at step (\d+); the job "
                      r"goes on alone from step (\d+), .* \(([0-9.e+-]+) s after the loss was seen\)", text)
    assert len(lost) == 1, text[-3000:]
    assert int(lost[0][1]) in (int(lost[0][0]), int(lost[0][0]) - 1)  # the step it was on, or the one before
    assert float(lost[0][2]) < 30, lost  # giving up the wait
    assert re.search(r"resized 1 -> 2 ranks at step \d+", text[text.index("goes on alone"):]), text[-3000:]
    assert_one_rank_result(out, long_reference)


def test_a_lost_rank_leaves_the_ranks_that_joined_before_it_in_the_job(exact, digits, tmp_path, long_reference):
    """Grown to 3 ranks by two starts of new processes; the rank of the second start is killed
    (SIGKILL). Rank 0 tells the rank of the first start, both go back to rank 0's last
    completed step and on together on 2 ranks (the survivor takes rank 0's variables again),
    a new rank replaces the lost one, and the result is the uninterrupted one-rank result, bit
    for bit."""
    out = str(tmp_path / "elastic")
    code, text = run_and_kill(elastic_cmd(exact("mlp:adam"), digits, out, 3, "0:1,2:2,4:3"), out,
                              "resized 2 -> 3 ranks at step 4", 2, r"resized 2 -> 3 ranks at step \d+")
    assert code == 0, text[-3000:]
    lost = re.findall(r"1 rank that joined the job \(launcher pid \d+\) ended with status \d+ at step (\d+); the job "
                      r"goes on with 2 ranks from step (\d+)", text)
    assert len(lost) == 1, text[-3000:]
    assert re.search(r"resized 2 -> 3 ranks at step \d+", text[text.index("goes on with 2 ranks"):]), text[-3000:]
    assert_one_rank_result(out, long_reference)

