"""Data-parallel training under real ``mpiexec``: the same result on any number of ranks."""
import json
import os
import re
import signal
import subprocess
import sys
import time

import numpy as np
import pytest

BIN = os.path.dirname(sys.executable)
MPIEXEC = os.path.join(BIN, "mpiexec")
ENV = dict(os.environ, TF_CPP_MIN_LOG_LEVEL="2", TF_ENABLE_ONEDNN_OPTS="0", OMP_NUM_THREADS="1")
BATCH, B = 64, 8  # global batch, examples per virtual node: V = 8

pytestmark = pytest.mark.mpi


def train_cmd(ranks, model, data, out, steps, *extra):
    launcher = [MPIEXEC, "-n", str(ranks)] if ranks else []
    return launcher + [sys.executable, "-m", "vfgraph.cli", "-v", "train", model, "--data", data,
                       "--steps", str(steps), "--batch-size", str(BATCH), "-o", out, "--no-progress", *extra]


def run_train(ranks, model, data, out, steps=4, *extra, timeout=300):
    res = subprocess.run(train_cmd(ranks, model, data, out, steps, *extra), capture_output=True, text=True,
                         env=ENV, timeout=timeout)
    assert res.returncode == 0, res.stderr[-3000:]
    return res


def params(path):
    import tensorflow as tf

    loaded = tf.saved_model.load(path)
    return {v.name: v.numpy() for v in loaded.signatures["train"].variables}


def losses(path):
    with open(os.path.join(path, "assets.extra", "vfgraph.json")) as f:
        return json.load(f)["training"]["losses"]


def assert_same_params(a, b, rtol):
    from vfgraph.testing.compare import rel_diff

    pa, pb = params(a), params(b)
    assert sorted(pa) == sorted(pb)
    worst = max((rel_diff(pa[k], pb[k]), k) for k in pa)
    assert worst[0] <= rtol, f"{worst[1]} differs by {worst[0]:.3g} ({a} vs {b})"


def rewritten(models, root, **options):
    """``get(name)``: corpus model ``name`` rewritten with 8 virtual nodes of 8 examples (and
    ``options``) once, saved under ``root``."""
    import vfgraph

    made = {}

    def get(name):
        if name not in made:
            out = str(root / name.replace(":", "_"))
            vfgraph.save(vfgraph.rewrite(models(name), vnodes=8, vnode_batch=B, **options), out)
            made[name] = out
        return made[name]

    return get


def wait_for_checkpoint(proc, state: str, step: int) -> None:
    """Wait until the run ``proc`` has checkpointed ``step`` steps (its ``progress.json`` at
    ``state``); it must still be running then."""
    deadline = time.time() + 180
    while time.time() < deadline and proc.poll() is None:
        if os.path.isfile(state) and json.load(open(state))["step"] >= step:
            break
        time.sleep(0.05)
    assert proc.poll() is None, "training finished before the checkpoint; raise the step count"


@pytest.fixture(scope="module")
def v8(models, tmp_path_factory):
    """Models rewritten with 8 virtual nodes of 8 examples and the all-reduce."""
    return rewritten(models, tmp_path_factory.mktemp("mpi_models"), allreduce="mpi")


@pytest.mark.parametrize("name", ["mlp:momentum", "cnn:momentum", "embedding:adam"])
def test_same_parameters_on_any_number_of_ranks(name, v8, digits, tmp_path):
    """Batch-norm CNN: per-virtual-node statistics, so the split must not matter either (2x4 and
    an uneven 5+3: the MLP covers 4 ranks); Embedding: sparse gradient rows gathered over ranks
    (1x8 and 2x4: the dense models cover the other layouts)."""
    model = v8(name)
    runs = {"1x8": (0, ()), "2x4": (2, ()), "4x2": (4, ()), "2 ranks 5+3": (2, ("--vnodes-per-rank", "5,3"))}
    if not name.startswith("mlp"):  # 4 ranks on these cores: the slowest run
        del runs["4x2"]
    if name.startswith("embedding"):
        del runs["2 ranks 5+3"]
    outs = {}
    for label, (ranks, extra) in runs.items():
        outs[label] = str(tmp_path / label.replace(" ", "_"))
        run_train(ranks, model, digits["train"], outs[label], 4, *extra)
    for label, out in outs.items():
        if label != "1x8":
            assert_same_params(outs["1x8"], out, 1e-6)
            np.testing.assert_allclose(losses(out), losses(outs["1x8"]), rtol=1e-6)


def test_loss_curve_matches_the_original_at_the_global_batch(models, v8, digits, tmp_path):
    """2 ranks x 4 virtual nodes of 8 against the unmodified model fed all 64 examples at once."""
    original, rewritten = str(tmp_path / "original"), str(tmp_path / "rewritten")
    run_train(0, models("mlp:momentum"), digits["train"], original, 6)
    run_train(2, v8("mlp:momentum"), digits["train"], rewritten, 6)
    np.testing.assert_allclose(losses(rewritten), losses(original), rtol=1e-5)
    assert_same_params(original, rewritten, 1e-5)


def test_tfrecord_data_on_two_ranks_equals_npz_on_one(v8, digits, tmp_path):
    import tensorflow as tf

    with np.load(digits["train"]) as z:
        x, y = z["x"], z["y"]
    records = str(tmp_path / "train.tfrecord")
    with tf.io.TFRecordWriter(records) as f:
        for xi, yi in zip(x, y):
            feat = {"x": tf.train.Feature(float_list=tf.train.FloatList(value=xi.ravel())),
                    "y": tf.train.Feature(int64_list=tf.train.Int64List(value=[int(yi)]))}
            f.write(tf.train.Example(features=tf.train.Features(feature=feat)).SerializeToString())
    a, b = str(tmp_path / "npz"), str(tmp_path / "tfrecord")
    run_train(0, v8("mlp:momentum"), digits["train"], a, 3)
    run_train(2, v8("mlp:momentum"), records, b, 3)
    assert_same_params(a, b, 1e-6)


def test_model_without_allreduce_refuses_several_ranks(models, digits, tmp_path):
    res = subprocess.run(train_cmd(2, models("mlp:momentum"), digits["train"], str(tmp_path / "o"), 2),
                         capture_output=True, text=True, env=ENV, timeout=120)
    assert res.returncode == 2
    assert "no all-reduce" in res.stderr and "Traceback" not in res.stderr
    assert not os.path.exists(tmp_path / "o")


def test_fed_batch_split_model_needs_a_fixed_vnode_batch_on_several_ranks(models, digits, tmp_path):
    import vfgraph

    model = str(tmp_path / "derived_b")
    vfgraph.save(vfgraph.rewrite(models("mlp:momentum"), vnodes=8, allreduce="mpi"), model)
    res = subprocess.run(train_cmd(2, model, digits["train"], str(tmp_path / "o"), 2), capture_output=True,
                         text=True, env=ENV, timeout=120)
    assert res.returncode == 2, res.stderr[-2000:]
    assert "--vnode-batch" in res.stderr and "Traceback" not in res.stderr
    assert not os.path.exists(tmp_path / "o")


def test_bad_vnodes_per_rank_is_a_clear_error_on_every_rank(v8, digits, tmp_path):
    res = subprocess.run(train_cmd(2, v8("mlp:momentum"), digits["train"], str(tmp_path / "o"), 2,
                                   "--vnodes-per-rank", "6,3"), capture_output=True, text=True, env=ENV, timeout=120)
    assert res.returncode == 2
    errors = [line for line in res.stderr.splitlines() if line.startswith("vfgraph train")]
    assert len(errors) == 1 and "--vnodes-per-rank 6,3" in errors[0] and "Traceback" not in res.stderr, res.stderr
    # a mistake only one rank can see is reported by that rank, once
    res = subprocess.run(train_cmd(2, v8("mlp:momentum"), digits["train"], str(tmp_path / "o"), 2,
                                   "--batch-size", "60"), capture_output=True, text=True, env=ENV, timeout=120)
    errors = [line for line in res.stderr.splitlines() if line.startswith("vfgraph train")]
    assert res.returncode == 2 and len(errors) == 1 and "--batch-size 60" in errors[0], res.stderr


def test_ranks_share_the_host_cpus_and_threads_is_checked(v8, digits, tmp_path):
    res = run_train(2, v8("mlp:momentum"), digits["train"], str(tmp_path / "o"), 1)
    assert f"2 ranks, {max(1, os.cpu_count() // 2)} intra-op and 1 inter-op TensorFlow threads each" in res.stderr
    bad = subprocess.run(train_cmd(0, v8("mlp:momentum"), digits["train"], str(tmp_path / "b"), 1, "--threads", "0"),
                         capture_output=True, text=True, env=ENV, timeout=120)
    assert bad.returncode == 2 and "--threads 0" in bad.stderr and "Traceback" not in bad.stderr
    assert not os.path.exists(tmp_path / "b")


def test_threads_per_rank():
    from vfgraph.runtime.world import threads_per_rank

    assert threads_per_rank(visible=2, total=2, local_ranks=2) == 1
    assert threads_per_rank(visible=16, total=16, local_ranks=4) == 4
    assert threads_per_rank(visible=2, total=2, local_ranks=4) == 1  # oversubscribed: still one each
    assert threads_per_rank(visible=3, total=16, local_ranks=4) == 3  # bound by the launcher: its CPUs
    assert threads_per_rank(visible=1, total=1, local_ranks=1) == 1


def _rank_pid(rank, marker):
    """The process id of the worker of MPI rank ``rank`` whose command line contains ``marker``."""
    for pid in os.listdir("/proc"):
        if not pid.isdigit():
            continue
        try:
            with open(f"/proc/{pid}/cmdline", "rb") as f:
                cmd = f.read().decode(errors="replace")
            with open(f"/proc/{pid}/environ", "rb") as f:
                env = f.read().decode(errors="replace").split("\0")
        except OSError:
            continue
        ranked = any(f"{k}={rank}" in env for k in ("PMI_RANK", "OMPI_COMM_WORLD_RANK"))  # MPICH, Open MPI
        if marker in cmd and "vfgraph.cli" in cmd and ranked and "VFGRAPH_RANK_WORKER=1" in env:
            return int(pid)
    return None


def _left_behind(proc, marker) -> str:
    """The processes of a job that did not end: the launcher's and those whose command line
    holds ``marker`` (state, kernel wait, parent), and every process that holds its output
    pipes open (which the test's wait for the job reads to their end)."""
    pipes = {f"pipe:[{os.fstat(f.fileno()).st_ino}]" for f in (proc.stdout, proc.stderr)}
    lines = []
    for pid in sorted((p for p in os.listdir("/proc") if p.isdigit() and int(p) != os.getpid()), key=int):
        try:
            with open(f"/proc/{pid}/cmdline", "rb") as f:
                cmd = f.read().replace(b"\0", b" ").decode(errors="replace").strip()
            with open(f"/proc/{pid}/stat") as f:
                fields = f.read().rsplit(")", 1)[1].split()
            with open(f"/proc/{pid}/wchan") as f:
                wchan = f.read().strip()
            fds = os.listdir(f"/proc/{pid}/fd")
            holds = any(os.readlink(f"/proc/{pid}/fd/{fd}") in pipes for fd in fds)
        except OSError:
            continue
        if holds or marker in cmd or int(pid) == proc.pid:
            lines.append(f"pid {pid} ppid {fields[1]} state {fields[0]} wchan {wchan} threads {fields[17]}"
                         f"{' holds the output' if holds else ''}: {cmd[:160]}")
    return "\n".join(lines)


def test_killed_rank_stops_the_job_and_resume_reaches_the_same_parameters(v8, digits, tmp_path):
    model, steps = v8("mlp:momentum"), 1500
    out = str(tmp_path / "killed")
    state = out + ".ckpt/progress.json"
    proc = subprocess.Popen(train_cmd(2, model, digits["train"], out, steps, "--checkpoint-every", "50"),
                            stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, env=ENV)
    try:
        wait_for_checkpoint(proc, state, 200)
        victim = _rank_pid(1, out)
        assert victim is not None
        os.kill(victim, signal.SIGKILL)
        killed_at = time.time()
        try:
            out_text, err_text = proc.communicate(timeout=60)
        except subprocess.TimeoutExpired as e:
            raise AssertionError(f"the job did not end within 60 s of the kill; what is left of it:\n"
                                 f"{_left_behind(proc, out)}\n{(e.stderr or b'')[-2000:]!r}") from None
        err = out_text + err_text
    finally:
        if proc.poll() is None:
            proc.kill()
    assert time.time() - killed_at < 60
    assert proc.returncode != 0
    assert re.search(rf"rank 1 \(\S+ pid {victim}\) was killed by SIGKILL", err), err[-2000:]
    assert re.search(rf"rank 1: \S+ pid {victim}\b", err), err[-2000:]  # the rank table (-v) agrees
    assert not os.path.exists(out)
    assert _rank_pid(0, out) is None and _rank_pid(1, out) is None  # no worker left behind
    with open(state) as f:
        saved = json.load(f)
    assert saved["step"] >= 200 and saved["step"] % 50 == 0
    run_train(2, model, digits["train"], out, steps, "--checkpoint-every", "50", "--resume")
    reference = str(tmp_path / "uninterrupted")
    run_train(2, model, digits["train"], reference, steps, "--checkpoint-every", "50")
    assert_same_params(reference, out, 1e-6)
    assert losses(out) == pytest.approx(losses(reference), rel=1e-6)


CHECK = """
import sys
import vfgraph
import tensorflow as tf
from mpi4py import MPI
from vfgraph.runtime.world import world
w = world(need_mpi=True)
loaded = tf.saved_model.load(sys.argv[1 + w.rank])
try:
    loaded.signatures["train_broadcast"]()
except tf.errors.OpError as e:
    print(f"rank {w.rank}: {e.message}")
    sys.exit(3)
print(f"rank {w.rank}: ok")
"""


def test_ranks_with_different_graphs_fail_at_start_instead_of_deadlocking(v8, models, tmp_path):
    import vfgraph

    other = str(tmp_path / "fused_differently")
    vfgraph.save(vfgraph.rewrite(models("mlp:momentum"), vnodes=8, vnode_batch=B, allreduce="mpi", fusion_mb=1e-5),
                 other)
    same = subprocess.run([MPIEXEC, "-n", "2", sys.executable, "-c", CHECK, v8("mlp:momentum"), v8("mlp:momentum")],
                          capture_output=True, text=True, env=ENV, timeout=120)
    assert same.returncode == 0 and "rank 1: ok" in same.stdout, same.stderr[-2000:]
    res = subprocess.run([MPIEXEC, "-n", "2", sys.executable, "-c", CHECK, v8("mlp:momentum"), other],
                         capture_output=True, text=True, env=ENV, timeout=120)
    assert res.returncode != 0
    for r in (0, 1):
        assert f"rank {r}: " in res.stdout and "different graphs" in res.stdout, res.stdout + res.stderr[-2000:]


STEPWISE = """
import sys
import numpy as np
import tensorflow as tf
import vfgraph
from vfgraph.runtime.world import world
from vfgraph.testing.compare import make_inputs
w = world(need_mpi=True)
m = tf.saved_model.load(sys.argv[1])
m.signatures["train_broadcast"]()
for step in range(2):
    x = make_inputs(m.signatures["train"], 64, seed=step)
    share = 64 // w.size
    for lo in range(w.rank * share, (w.rank + 1) * share, 16):  # 16 examples (2 virtual nodes) a call
        m.signatures["train_accumulate"](**{k: v[lo:lo + 16] for k, v in x.items()})
    m.signatures["train_apply"]()
if w.rank == 0:
    np.savez(sys.argv[2], **{v.name: v.numpy() for v in m.signatures["train"].variables})
"""


def test_stepwise_signatures_on_two_ranks_equal_the_looped_step(v8, tmp_path):
    """train_accumulate twice per rank on 2 ranks, then train_apply: the accumulators (dense
    sums, sparse rows, count) are reduced over ranks, giving one looped step over all 64."""
    import tensorflow as tf

    from vfgraph.testing.compare import make_inputs, rel_diff

    model, out = v8("embedding:adam"), str(tmp_path / "stepwise.npz")
    res = subprocess.run([MPIEXEC, "-n", "2", sys.executable, "-c", STEPWISE, model, out],
                         capture_output=True, text=True, env=ENV, timeout=180)
    assert res.returncode == 0, res.stderr[-3000:]
    looped = tf.saved_model.load(model)
    for step in range(2):
        looped.signatures["train"](**make_inputs(looped.signatures["train"], 64, seed=step))
    got = dict(np.load(out))
    want = {v.name: v.numpy() for v in looped.signatures["train"].variables}
    assert sorted(got) == sorted(want)
    worst = max((rel_diff(got[k], want[k]), k) for k in want)
    assert worst[0] <= 1e-6, f"{worst[1]} differs by {worst[0]:.3g}"


BROADCAST = """
import sys
import numpy as np
import tensorflow as tf
import vfgraph
from vfgraph.runtime.world import world
w = world(need_mpi=True)
m = tf.saved_model.load(sys.argv[1])
variables = m.signatures["train"].variables
if w.rank == 1:  # rank 1 starts from other values: zeros and ones, and a changed step count
    for v in variables:
        v.assign(tf.cast(tf.fill(tf.shape(v), 1 if v.dtype.is_floating else 7), v.dtype))
held = [v.read_value() for v in variables]  # reads taken before keep what they read
m.signatures["train_broadcast"]()
np.savez(sys.argv[2 + w.rank], **{v.name: v.numpy() for v in variables})
np.savez(sys.argv[4 + w.rank], **{v.name: h.numpy() for v, h in zip(variables, held)})
"""


def test_broadcast_signature_gives_every_rank_the_variables_of_rank_0(v8, tmp_path):
    """train_broadcast copies every variable the step uses (parameters, optimizer slots, step
    count, accumulators) from rank 0 in place; tensors read before keep their values."""
    import tensorflow as tf

    model = v8("embedding:adam")
    outs = [str(tmp_path / f"{kind}{r}.npz") for kind in ("after", "held") for r in (0, 1)]
    res = subprocess.run([MPIEXEC, "-n", "2", sys.executable, "-c", BROADCAST, model, *outs],
                         capture_output=True, text=True, env=ENV, timeout=180)
    assert res.returncode == 0, res.stderr[-3000:]
    loaded = tf.saved_model.load(model)
    original = {v.name: v.numpy() for v in loaded.signatures["train"].variables}
    after0, after1, held0, held1 = (dict(np.load(p)) for p in outs)
    assert sorted(after1) == sorted(original)
    for name, want in original.items():
        np.testing.assert_array_equal(after0[name], want, err_msg=name)
        np.testing.assert_array_equal(after1[name], want, err_msg=name)
        np.testing.assert_array_equal(held0[name], want, err_msg=name)
        np.testing.assert_array_equal(held1[name], np.full_like(want, 1 if want.dtype.kind == "f" else 7),
                                      err_msg=name)
