"""Training across separate hosts: two hosts made of Linux namespaces (vfgraph.testing.hosts),
each with its own address, host name and /dev/shm, so MPICH's ranks on them talk over TCP, as
across machines; hydra starts them through the hosts' launcher script (as it would by ssh)."""
import contextlib
import json
import os
import re
import signal
import subprocess
import sys
import time

import numpy as np
import pytest

from test_mpi_train import BATCH, ENV, losses, params, rewritten
from vfgraph.testing.hosts import Hosts, missing

pytestmark = pytest.mark.mpi

WHY = missing()


@pytest.fixture(scope="module")
def hosts():
    if WHY:
        pytest.skip(f"separate hosts: {WHY}")
    with Hosts(2) as made:
        yield made


@pytest.fixture(scope="module")
def v8(models, tmp_path_factory):
    return rewritten(models, tmp_path_factory.mktemp("hosts_models"), allreduce="mpi")


@pytest.fixture(scope="module")
def exact(models, tmp_path_factory):
    return rewritten(models, tmp_path_factory.mktemp("hosts_exact"), deterministic=True)


def train_args(model, data, out, steps, *extra):
    return [sys.executable, "-m", "vfgraph.cli", "-v", "train", model, "--data", data, "--steps", str(steps),
            "--batch-size", str(BATCH), "-o", out, "--no-progress", *extra]


def on_hosts(hosts, names, ranks, args, timeout=300):
    """Run ``args`` as ``ranks`` ranks on the hosts ``names``; its stderr (it must succeed)."""
    res = subprocess.run(hosts.mpiexec(names) + ["-n", str(ranks)] + args, capture_output=True, text=True,
                         env=hosts.env(ENV), timeout=timeout)
    assert res.returncode == 0, res.stderr[-3000:]
    return res.stderr


def one_process(model, data, out, steps, *extra):
    res = subprocess.run(train_args(model, data, out, steps, *extra), capture_output=True, text=True, env=ENV,
                         timeout=300)
    assert res.returncode == 0, res.stderr[-3000:]


def gradient_bytes(model, value_bytes):
    """Bytes of the gradient sums one step all-reduces: ``value_bytes`` per trainable value."""
    import tensorflow as tf

    loaded = tf.saved_model.load(model)
    return value_bytes * sum(int(np.prod(v.shape)) for v in loaded.signatures["train"].trainable_variables)


def test_what_a_killed_run_left_is_removed_by_the_next(hosts):
    """A process that made hosts and was killed (SIGKILL, no teardown) leaves its namespaces,
    bridge and processes; the next run removes them before it makes its own."""
    from vfgraph.testing import hosts as harness

    code = ("import os, signal, sys; from vfgraph.testing.hosts import Hosts\n"
            "h = Hosts(1).__enter__(); print(h.namespaces[0], h.bridge, flush=True); sys.stdin.read()")
    proc = subprocess.Popen([sys.executable, "-c", code], stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True)
    ns, bridge = proc.stdout.readline().split()
    proc.kill()
    proc.wait()
    listed = subprocess.run([harness.IP, "netns", "list"], capture_output=True, text=True).stdout
    assert ns in listed
    assert proc.pid in harness.clean_leftovers()
    listed = subprocess.run([harness.IP, "netns", "list"], capture_output=True, text=True).stdout
    links = subprocess.run([harness.IP, "-o", "link", "show"], capture_output=True, text=True).stdout
    assert ns not in listed and f" {bridge}:" not in links
    assert not os.path.exists(os.path.join(harness.RUN_DIR, str(proc.pid)))


def test_two_hosts_train_as_one_process_over_tcp(hosts, v8, digits, tmp_path):
    """Default mode, 1 rank on each host: the parameters of one process within 1e-6; the ranks
    run on different hosts (their names in the rank table, resolving to their own addresses),
    each host's link carries at least the gradients' all-reduce volume both ways, and each rank
    takes the CPUs of its host (one rank per host) by default."""
    model, steps = v8("mlp:momentum"), 6
    one, two = str(tmp_path / "one"), str(tmp_path / "two")
    one_process(model, digits["train"], one, steps)
    before = [hosts.bytes(i) for i in range(2)]
    err = on_hosts(hosts, hosts.names, 2, train_args(model, digits["train"], two, steps))
    after = [hosts.bytes(i) for i in range(2)]
    table = dict(re.findall(r"rank (\d): (node\d) pid \d+", err))
    assert table == {"0": "node0", "1": "node1"}, err[-3000:]
    for i, name in enumerate(hosts.names):  # each name is its host's own address there
        got = hosts.run(i, sys.executable, "-c", "import socket; print(socket.gethostbyname(socket.gethostname()))")
        assert got.stdout.strip() == hosts.addresses[i]
    cpus = os.cpu_count()
    assert re.search(rf"2 ranks, {cpus} intra-op and 1 inter-op TensorFlow threads each", err), err[-3000:]
    volume = steps * gradient_bytes(model, 4)
    for i in range(2):
        for way in ("rx", "tx"):
            assert after[i][way] - before[i][way] >= volume, (i, way, before[i], after[i], volume)
    from test_mpi_train import assert_same_params

    assert_same_params(one, two, 1e-6)
    np.testing.assert_allclose(losses(two), losses(one), rtol=1e-6)


def test_deterministic_mode_on_two_hosts_is_bit_identical_to_one_process(hosts, exact, digits, tmp_path):
    model, steps = exact("mlp:adam"), 6
    one, two = str(tmp_path / "one"), str(tmp_path / "two")
    one_process(model, digits["train"], one, steps, "--threads", "1")
    on_hosts(hosts, hosts.names, 2, train_args(model, digits["train"], two, steps, "--threads", "1"))
    want, got = params(one), params(two)
    assert [k for k in want if not np.array_equal(want[k], got[k])] == []
    assert losses(two) == losses(one)


def test_two_pipeline_stages_on_two_hosts_train_as_one_process(hosts, models, digits, tmp_path):
    """The MLP cut into 2 stages (1F1B), stage 1 on node0 and stage 2 on node1: the activations
    and their gradients cross the link (VfSend / VfRecv over TCP), and the parameters are those
    of the unpartitioned step in one process."""
    import vfgraph
    from test_mpi_train import assert_same_params

    model = str(tmp_path / "staged")
    vfgraph.save(vfgraph.rewrite(models("mlp:adam"), vnodes=8, vnode_batch=8, stages=2, schedule="1f1b"), model)
    one, two = str(tmp_path / "one"), str(tmp_path / "two")
    one_process(model, digits["train"], one, 3)
    before = hosts.bytes(1)
    on_hosts(hosts, hosts.names, 2, train_args(model, digits["train"], two, 3))
    after = hosts.bytes(1)
    activations = 3 * BATCH * 32 * 4  # the hidden layer's output, each step, one way (its gradient: the other)
    assert after["rx"] - before["rx"] >= activations and after["tx"] - before["tx"] >= activations
    assert_same_params(one, two, 1e-6)
    for a, b in zip(losses(one), losses(two)):
        assert b == pytest.approx(a, rel=1e-6)


class Lines:
    """The lines of a stream, read on a thread, to wait for with a deadline (a hang fails the
    test instead of stopping it)."""

    def __init__(self, stream):
        import threading

        self.lines, self.stream = [], stream
        self.reader = threading.Thread(target=self._read, daemon=True)
        self.reader.start()

    def _read(self):
        for line in self.stream:
            self.lines.append(line)

    def wait(self, pattern, seconds):
        """The first match of ``pattern`` in the lines within ``seconds`` (None if none)."""
        deadline = time.time() + seconds
        while True:
            found = re.search(pattern, self.text())
            if found or time.time() > deadline or not self.reader.is_alive():
                return found or re.search(pattern, self.text())
            time.sleep(0.05)

    def text(self):
        return "".join(self.lines)


def grown_onto_node1(hosts, model, digits, out, listed, *extra):
    """An elastic job started on node0 alone, grown by its host-discovery script onto node1 (the
    new rank started by hydra on node0 through the hosts' launcher) and training on 2 ranks:
    the job and its lines (read as they come)."""
    listed.write_text("node0:1\nnode1:1\n")
    args = train_args(model, digits["train"], out, 1000000, "--threads", "1", "--max-ranks", "2",
                      "--host-discovery-script", f"cat {listed}", "--discovery-interval", "0.2", *extra)
    proc = subprocess.Popen(hosts.mpiexec(["node0"]) + ["-n", "1"] + args, stderr=subprocess.PIPE, text=True,
                            env=hosts.env(ENV))
    log = Lines(proc.stderr)
    assert log.wait(r"resized 1 -> 2 ranks at step \d+", 120), log.text()[-3000:]
    assert re.search(r"starting 1 new rank for the next growth on node1:1\n", log.text()), log.text()[-3000:]
    assert hosts.processes(1), "no process runs on node1"
    time.sleep(1)  # training on 2 ranks
    listed.write_text("node0:1\n")
    return proc, log


def stopped(proc, log):
    """Stop the job (SIGTERM; hydra passes it on); its exit status."""
    if proc.poll() is None:
        proc.send_signal(signal.SIGTERM)
    try:
        return proc.wait(timeout=60)
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.wait()
        log.reader.join(10)


def assert_resumes_to_one_process(model, digits, out, tmp_path):
    """The checkpoint the job left in ``out`` resumes, on one process, to the parameters of one
    process trained throughout, bit for bit."""
    with open(out + ".ckpt/progress.json") as f:
        step = json.load(f)["step"]
    one = str(tmp_path / "one")
    one_process(model, digits["train"], out, step + 2, "--threads", "1", "--resume")
    one_process(model, digits["train"], one, step + 2, "--threads", "1")
    want, got = params(one), params(out)
    assert [k for k in want if not np.array_equal(want[k], got[k])] == []


def test_an_elastic_job_grows_onto_a_second_host_and_survives_losing_it(hosts, exact, digits, tmp_path):
    """node1's processes all die: within 60 s rank 0 names the lost host and trains on alone
    from its last completed step; stopped then, it checkpoints the step it stopped after (that
    training on after a loss gives the uninterrupted result, bit for bit, test_elastic.py shows;
    that such a checkpoint resumes to it, the cut-off test below)."""
    model, out = exact("mlp:adam"), str(tmp_path / "elastic")
    proc, log = grown_onto_node1(hosts, model, digits, out, tmp_path / "hosts.txt")
    try:
        hosts.kill(1)
        lost = log.wait(r"1 rank that joined the job on node1:1 \(launcher pid \d+\) ended with status \d+ at step "
                        r"\d+; the job goes on alone from step \d+", 60)
        assert lost, log.text()[-3000:]
        time.sleep(1)  # training on alone
    finally:
        code = stopped(proc, log)
    stop = re.search(r"interrupted: stopped after (\d+) of", log.text())
    assert code == 130 and stop, log.text()[-3000:]
    assert "Traceback" not in log.text()
    with open(out + ".ckpt/progress.json") as f:
        assert json.load(f)["step"] == int(stop.group(1)) > int(re.search(r"goes on alone from step (\d+)",
                                                                           lost.group(0)).group(1))


def test_a_host_cut_off_ends_the_job_in_one_line_naming_it(hosts, exact, digits, tmp_path):
    """node1's link goes down: its processes run on, unreachable, and no connection closes, so
    nothing ends; rank 0's wait for it makes no progress. Within 60 s (--stall-timeout 20) the
    job ends with one line naming node1 and the checkpoint kept, which resumes to the
    uninterrupted one-process result, bit for bit."""
    model, out = exact("mlp:adam"), str(tmp_path / "elastic")
    proc, log = grown_onto_node1(hosts, model, digits, out, tmp_path / "hosts.txt", "--stall-timeout", "20")
    began = time.time()
    try:
        hosts.cut(1)
        ended = log.wait(r"vfgraph train: .*", 60)
        took = time.time() - began
    finally:
        hosts.cut(1, up=True)
        with contextlib.suppress(subprocess.TimeoutExpired):
            proc.wait(timeout=30)  # (it ends by itself after its stall line: stopped() only if it does not)
        code = stopped(proc, log)
    assert ended and took < 60, log.text()[-3000:]
    line = ended.group(0)
    assert code == 75 and line.startswith("vfgraph train: stalled: rank 0"), log.text()[-3000:]
    assert "for rank 1 on node1 (not seen entering it)" in line and "checkpoint" in line, line
    assert "Traceback" not in log.text()
    assert_resumes_to_one_process(model, digits, out, tmp_path)
