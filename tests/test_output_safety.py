"""Outputs vfgraph replaces and outputs it locks: ``--force`` removes only the files vfgraph wrote
(each directory output's manifest lists them), never a file a user put beside them; one command
at a time writes an output (a second one stops at once, naming the first one's pid); ``vfgraph
resize`` asks only a running elastic job. Real processes where processes matter (locks, pids)."""
import json
import os
import shutil
import signal
import subprocess
import sys
import time

import numpy as np
import pytest

from vfgraph.errors import OutputError
from vfgraph.io import outputs
from vfgraph.testing.cli import ENV, error_line, one_error, run_in_process, tree_digest, vf

run = run_in_process


def add_user_files(out):
    """What a user puts into an output directory vfgraph wrote: notes, and photos named like a
    checkpoint's step files."""
    (out / "NOTES.txt").write_text("my notes on this model\n")
    (out / "photos").mkdir()
    (out / "photos" / "step-1.png").write_bytes(bytes(range(256)))


def remove_user_files(out):
    os.remove(out / "NOTES.txt")
    shutil.rmtree(out / "photos")


def refused_with_user_files(capsys, out, *argv):
    """``argv`` (with --force) refuses ``out`` holding the user's files, naming the first, and
    changes nothing in it, byte for byte; then a user's file alone is named by its path."""
    add_user_files(out)
    before = tree_digest(out)
    one_error(*run(capsys, *argv), str(out), "holds NOTES.txt", "not written by vfgraph")
    assert tree_digest(out) == before
    os.remove(out / "NOTES.txt")
    one_error(*run(capsys, *argv), "holds photos/step-1.png")
    assert (out / "photos" / "step-1.png").read_bytes() == bytes(range(256))
    shutil.rmtree(out / "photos")


def manifest(path):
    with open(path / outputs.MANIFEST) as f:
        return json.load(f)


def loads(path):
    import tensorflow as tf

    return tf.saved_model.load(str(path))


@pytest.fixture
def model(models, tmp_path):
    shutil.copytree(models("mlp:adam"), tmp_path / "m")
    return tmp_path / "m"


def test_rewrite_force_keeps_what_the_user_put_in_the_output(model, capsys, tmp_path):
    out = tmp_path / "out"
    assert run(capsys, "rewrite", model, "--vnodes", 2, "-o", out)[0] == 0
    written = manifest(out)["written"]
    assert {"saved_model.pb", "fingerprint.pb", "assets.extra/vfgraph.json", "variables/"} <= set(written)
    assert sorted(written) == written and outputs.MANIFEST not in written
    refused_with_user_files(capsys, out, "rewrite", model, "--vnodes", 2, "-o", out, "--force")
    # without the user's files, vfgraph's own output is replaced, as deterministic as before
    first = tree_digest(out)
    assert run(capsys, "rewrite", model, "--vnodes", 2, "-o", out, "--force")[0] == 0
    assert tree_digest(out) == first and loads(out).signatures
    assert not os.path.exists(outputs.lock_path(out))
    assert not [n for n in os.listdir(tmp_path) if n.startswith(".vfgraph-")]


def test_export_force_keeps_what_the_user_put_in_the_version(model, capsys, c_client, tmp_path):
    from tensorflow.core.protobuf import saved_model_pb2

    from vfgraph.testing import c_api

    base = tmp_path / "serve"
    assert run(capsys, "export", model, "-o", base)[0] == 0
    assert "saved_model.pb" in manifest(base / "1")["written"] and not (base / outputs.MANIFEST).exists()
    refused_with_user_files(capsys, base / "1", "export", model, "-o", base, "--force")
    assert run(capsys, "export", model, "-o", base, "--force")[0] == 0
    assert run(capsys, "export", model, "-o", base, "--version", 2)[0] == 0  # beside the first
    assert "saved_model.pb" in manifest(base / "2")["written"]
    # the manifest is no obstacle to TensorFlow's loaders: Python's and the C API's
    fn = loads(base / "1").signatures["serving_default"]
    (key, spec), = fn.structured_input_signature[1].items()
    x = np.random.default_rng(0).random((4, *spec.shape[1:]), dtype=np.float32)
    want = {k: v.numpy() for k, v in fn(**{key: x}).items()}
    sm = saved_model_pb2.SavedModel()
    sm.ParseFromString((base / "2" / "saved_model.pb").read_bytes())
    (name, _), = sm.meta_graphs[0].signature_def["serving_default"].inputs.items()
    got = c_api.serve(c_client, str(base / "2"), {name: x}, env=ENV)
    assert sorted(got) == sorted(want)
    for k in want:
        np.testing.assert_allclose(got[k], want[k], rtol=0, atol=1e-6)


def test_train_force_keeps_what_the_user_put_in_its_outputs(rewritten, digits, capsys, tmp_path):
    m = rewritten("mlp:sgd", 2, 16)
    out = tmp_path / "t"
    cmd = ["train", m, "--data", digits["train"], "--steps", 2, "--batch-size", 32, "-o", out, "--no-progress"]
    assert run(capsys, *cmd)[0] == 0
    assert "saved_model.pb" in manifest(out)["written"]
    assert "saved_model.pb" in manifest(tmp_path / "t.serving" / "1")["written"]
    for where in (out, tmp_path / "t.serving" / "1"):
        refused_with_user_files(capsys, where, *cmd, "--force")
    # the checkpoint directory: a user's file in it is never deleted, --force or not
    ckpt = tmp_path / "t.ckpt"
    ckpt.mkdir()
    add_user_files(ckpt)
    before = tree_digest(ckpt)
    one_error(*run(capsys, *cmd, "--force"), "t.ckpt: holds NOTES.txt")
    one_error(*run(capsys, *cmd), "t.ckpt: holds NOTES.txt")
    one_error(*run(capsys, *cmd, "--resume"), "a finished run of 2 steps", "t.ckpt holds no progress record")
    assert tree_digest(ckpt) == before
    remove_user_files(ckpt)
    code, err = run(capsys, *cmd, "--force")
    assert code == 0 and not ckpt.exists(), err
    assert loads(out).signatures and loads(tmp_path / "t.serving" / "1").signatures


def test_a_checkpoint_directory_lists_its_files_and_keeps_a_users(rewritten, digits, capsys, tmp_path):
    """An unfinished run's checkpoint directory has a manifest of its own; --force discards the
    checkpoint, and only it."""
    m = rewritten("mlp:sgd", 2, 16)
    from vfgraph.runtime.train import batches_for, load_npz

    data = load_npz(digits["train"])
    data["x"] = data["x"].astype(np.float32)
    data["x"][batches_for({"i": np.arange(len(data["x"]))}, ["i"], 32, 2)["i"]] = np.nan  # step 2's batch
    np.savez(tmp_path / "nan.npz", **data)
    out, ckpt = tmp_path / "t", tmp_path / "t.ckpt"
    cmd = ["train", m, "--steps", 4, "--batch-size", 32, "-o", out, "--no-progress", "--checkpoint-every", 2]
    one_error(*run(capsys, *cmd, "--data", tmp_path / "nan.npz"), "step 2", "checkpoint (step 2) is kept")
    assert not out.exists()
    listed = manifest(ckpt)
    assert listed["kind"] == outputs.CHECKPOINT and "progress.json" in listed["written"]
    assert set(os.listdir(ckpt)) == set(listed["written"]) | {outputs.MANIFEST}
    (ckpt / "step-notes.txt").write_text("mine\n")
    one_error(*run(capsys, *cmd, "--data", digits["train"], "--force"), "holds step-notes.txt")
    os.remove(ckpt / "step-notes.txt")
    code, err = run(capsys, *cmd, "--data", digits["train"], "--force")
    assert code == 0 and not ckpt.exists(), err


def test_an_output_written_before_manifests(model, capsys, tmp_path):
    """Without a manifest an output is vfgraph's only when every entry is one vfgraph writes by
    name (and, for a SavedModel, its record says vfgraph wrote it)."""
    out = tmp_path / "out"
    assert run(capsys, "rewrite", model, "-o", out)[0] == 0
    os.remove(out / outputs.MANIFEST)
    assert run(capsys, "rewrite", model, "--vnodes", 2, "-o", out, "--force")[0] == 0
    os.remove(out / outputs.MANIFEST)
    (out / "assets.extra" / "mine.txt").write_text("x")
    one_error(*run(capsys, "rewrite", model, "-o", out, "--force"), "holds assets.extra/mine.txt")
    assert (out / "assets.extra" / "mine.txt").read_text() == "x"
    # a SavedModel of the same names that vfgraph did not write (no record of it)
    plain = tmp_path / "plain"
    shutil.copytree(model, plain)
    shutil.rmtree(plain / "assets.extra", ignore_errors=True)
    before = tree_digest(plain)
    one_error(*run(capsys, "rewrite", model, "-o", plain, "--force"), "exists and was not written by vfgraph")
    assert tree_digest(plain) == before
    # a checkpoint directory of vfgraph's names only, and one with another file
    ckpt = tmp_path / "c"
    ckpt.mkdir()
    for name in ("progress.json", "step-4.index", "step-4.data-00000-of-00001", "step-4-stage-2.index"):
        (ckpt / name).write_text("{}")
    assert outputs.written_by_vfgraph(str(ckpt))
    (ckpt / "step-4.png").write_text("x")
    assert outputs.foreign(str(ckpt)) == "step-4.png"
    assert outputs.remove_written(str(ckpt)) == ["step-4.png"] and os.listdir(ckpt) == ["step-4.png"]


def wait_for_lock(out, pid, proc, timeout=240):
    deadline = time.time() + timeout
    while time.time() < deadline and proc.poll() is None:
        job = outputs.holder(str(out))
        if job and job.get("pid") == pid:
            return job
        time.sleep(0.05)
    raise AssertionError(f"no lock on {out} by pid {pid}: {proc.poll()}, {proc.stderr.read() if proc.stderr else ''}")


def test_two_trainings_of_one_output(rewritten, digits, tmp_path):
    """The second of two runs on one output stops at once, naming the first; ``resize`` refuses
    a job that is not elastic; the first run completes and its output loads."""
    m = rewritten("mlp:sgd", 2, 16)
    out = tmp_path / "t"
    cmd = ["train", m, "--data", digits["train"], "--steps", 40, "--batch-size", 32, "-o", out, "--no-progress"]
    first = subprocess.Popen([sys.executable, "-m", "vfgraph.cli", *map(str, cmd)], env=ENV, text=True,
                             stderr=subprocess.PIPE, stdout=subprocess.PIPE)
    try:
        job = wait_for_lock(out, first.pid, first)
        first.send_signal(signal.SIGSTOP)  # holding the lock, while the others run
        assert job["elastic"] is False and "vfgraph train" in job["command"] and str(out) in job["command"]
        with open(outputs.lock_path(out)) as f:
            assert json.load(f)["pid"] == first.pid
        for extra in ([], ["--force"], ["--resume"]):
            start = time.monotonic()
            res = vf(*cmd, *extra)
            line = error_line(res)
            assert res.returncode == 2 and f"pid {first.pid}" in line and "another vfgraph command" in line, line
            assert time.monotonic() - start < 120
        res = vf("resize", out, 2)
        assert res.returncode == 2 and "not elastic" in error_line(res) and str(first.pid) in error_line(res)
        assert not os.path.exists(str(out) + ".resize")
    finally:
        first.send_signal(signal.SIGCONT)
        stdout, stderr = first.communicate(timeout=300)
    assert first.returncode == 0, stderr
    assert "trained 40 steps" in stdout and loads(out).signatures
    assert sorted(os.listdir(tmp_path)) == ["t", "t.serving"]  # no lock, no checkpoint, no request left


def test_a_lock_of_a_dead_command_is_taken_over(model, capsys, tmp_path):
    """A command killed while it wrote leaves its lock file, unlocked: the next run takes it
    over. A file of that name that is not vfgraph's lock is never taken or removed."""
    out = tmp_path / "out"
    holder = subprocess.Popen([sys.executable, "-c", "import sys, time; from vfgraph.io import outputs\n"
                               "with outputs.command('held'):\n outputs.lock(sys.argv[1]); print('ok', flush=True)\n"
                               " time.sleep(600)", str(out)], env=ENV, stdout=subprocess.PIPE, text=True)
    try:
        assert holder.stdout.readline() == "ok\n"
        one_error(*run(capsys, "rewrite", model, "-o", out), f"pid {holder.pid}: held")
    finally:
        holder.kill()
        holder.wait()
    assert os.path.exists(outputs.lock_path(out)) and outputs.holder(str(out)) is None
    assert run(capsys, "rewrite", model, "-o", out)[0] == 0
    assert not os.path.exists(outputs.lock_path(out))
    other = tmp_path / "o2"
    with open(outputs.lock_path(other), "w") as f:
        f.write("a file of the user's\n")
    one_error(*run(capsys, "rewrite", model, "-o", other), "is not a vfgraph lock file")
    with open(outputs.lock_path(other)) as f:
        assert f.read() == "a file of the user's\n"
    assert not other.exists()


def test_resize_needs_a_running_elastic_job(rewritten, digits, capsys, tmp_path):
    out = tmp_path / "t"
    for _ in range(2):  # no job ever ran there; then a job that finished
        res = vf("resize", out, 2)
        assert res.returncode == 2 and "no training job is running" in error_line(res), res.stderr
        assert sorted(os.listdir(tmp_path)) == ([] if not out.exists() else ["t", "t.serving"])
        cmd = ["train", rewritten("mlp:sgd", 2, 16), "--data", digits["train"], "--steps", 2, "--batch-size", 32,
               "-o", out, "--no-progress", "--force"]
        assert run(capsys, *cmd)[0] == 0


def test_the_free_space_need_reads_more_than_the_free_space():
    mib = 1 << 20
    for free, need in ((mib // 10 + 5, mib // 10 + 6), (0, 1), (mib, mib + 1), (int(1.96 * mib), int(1.96 * mib) + 1)):
        assert float(outputs._mib(free).split()[0]) < float(outputs._mib(need, up=True).split()[0]), (free, need)
    assert outputs._mib(mib // 10 + 6, up=True) == "0.2 MiB" and outputs._mib(mib // 10 + 5) == "0.1 MiB"
    with pytest.raises(OutputError, match="MiB free, the output needs at least"):
        outputs.check_parent("/", shutil.disk_usage("/").free + (1 << 40))
