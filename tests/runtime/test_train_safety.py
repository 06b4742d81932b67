"""Training runs that end well or stop with one line: a TF1 model trains, saves, serves and
resumes; data a cast would change is refused; a damaged data file, a value an op refuses and a
full disk at the serving export are one line with exit 2; the checkpoint's loss record stays
small; a train prints no warning of TensorFlow's about the model it was given."""
import contextlib
import json
import os
import shutil
import signal
import subprocess
import sys
import time

import numpy as np
import pytest

from vfgraph.testing.cli import ENV, one_error, run_in_process, tree_digest, vf

run = run_in_process


def interrupted(cmd, progress, at_least: int) -> int:
    """Run ``vfgraph CMD`` in a process and stop it (SIGINT) once its checkpoint record
    ``progress`` is at step ``at_least`` or later; returns the step it stopped at."""
    proc = subprocess.Popen([sys.executable, "-m", "vfgraph.cli", *map(str, cmd)], env=ENV,
                            stderr=subprocess.PIPE, text=True)
    deadline = time.time() + 240
    try:
        while proc.poll() is None and time.time() < deadline:
            with contextlib.suppress(OSError, ValueError):
                with open(progress) as f:
                    if json.load(f)["step"] >= at_least:
                        break
            time.sleep(0.02)
        proc.send_signal(signal.SIGINT)
        err = proc.communicate(timeout=120)[1]
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.wait()
    assert proc.returncode == 130, err
    with open(progress) as f:
        return json.load(f)["step"]


def training_record(out):
    with open(os.path.join(out, "assets.extra", "vfgraph.json")) as f:
        return json.load(f)["training"]


def serve_without_vfgraph(path, x, workdir):
    """``serving_default`` of the SavedModel at ``path`` on ``x``, in an isolated Python process
    that never imports vfgraph (plain TensorFlow)."""
    src, dst = os.path.join(workdir, "serve_in.npy"), os.path.join(workdir, "serve_out.npy")
    np.save(src, x)
    code = ("import sys, numpy as np, tensorflow as tf\n"
            f"m = tf.saved_model.load({str(path)!r})\n"
            f"out = m.signatures['serving_default'](x=tf.constant(np.load({src!r})))\n"
            f"np.save({dst!r}, next(iter(out.values())).numpy())\n"
            "assert not any(n.startswith('vfgraph') for n in sys.modules)\n")
    res = subprocess.run([sys.executable, "-I", "-c", code], capture_output=True, text=True, env=ENV, timeout=300)
    assert res.returncode == 0, res.stderr
    return np.load(dst)


@pytest.fixture(scope="module")
def tf1_data(tmp_path_factory):
    rng = np.random.default_rng(3)
    path = tmp_path_factory.mktemp("tf1_data") / "d.npz"
    np.savez(path, x=rng.normal(size=(256, 64)).astype(np.float32), y=rng.integers(0, 10, 256).astype(np.int32))
    return str(path)


# resource and reference variables; the train op in the signature or in the collection (tags serve, train)
@pytest.mark.parametrize("name", ["tf1", "tf1-ref", "tf1-serve-train:ref"])
def test_a_tf1_model_trains_saves_and_serves_in_plain_tensorflow(name, rewritten, models, tf1_data, capsys,
                                                                 tmp_path):
    model = rewritten(name, 2, 4)
    out = tmp_path / "t"
    code, err = run(capsys, "train", model, "--data", tf1_data, "--steps", 6, "--batch-size", 8, "-o", out,
                    "--checkpoint-every", 2, "--no-progress")
    assert code == 0, err
    assert training_record(out)["steps"] == 6 and not (tmp_path / "t.ckpt").exists()
    x = np.random.default_rng(5).normal(size=(5, 64)).astype(np.float32)
    trained = serve_without_vfgraph(out, x, str(tmp_path))
    exported = serve_without_vfgraph(tmp_path / "t.serving" / "1", x, str(tmp_path))
    np.testing.assert_allclose(exported, trained, rtol=1e-5, atol=1e-6)
    import tensorflow as tf

    loaded = tf.saved_model.load(model)
    original = next(iter(loaded.signatures["serving_default"](x=tf.constant(x)).values())).numpy()
    assert not np.allclose(original, trained), "the model did not train"


def test_a_tf1_run_resumes_exactly(rewritten, tf1_data, capsys, tmp_path):
    model = rewritten("tf1-ref", 2, 4)
    cmd = ["train", model, "--data", tf1_data, "--steps", 1000, "--batch-size", 8, "--checkpoint-every", 50,
           "--no-progress"]
    step = interrupted([*cmd, "-o", tmp_path / "a"], tmp_path / "a.ckpt" / "progress.json", 50)
    assert 50 <= step < 1000 and not (tmp_path / "a").exists()
    code, err = run(capsys, *cmd, "-o", tmp_path / "a", "--resume")
    assert code == 0, err
    code, err = run(capsys, *cmd, "-o", tmp_path / "b")
    assert code == 0, err
    assert training_record(tmp_path / "a") == training_record(tmp_path / "b")
    import tensorflow as tf

    held = [tf.saved_model.load(str(tmp_path / k)) for k in "ab"]  # (a signature needs its model alive)
    a, b = (m.signatures["train"] for m in held)
    for va, vb in zip(sorted(a.variables, key=lambda v: v.name), sorted(b.variables, key=lambda v: v.name)):
        np.testing.assert_array_equal(va.numpy(), vb.numpy(), err_msg=va.name)


def test_data_a_cast_would_change_is_refused(rewritten, digits, capsys, tmp_path):
    model = rewritten("mlp:sgd", 2, 16)
    with np.load(digits["train"]) as z:
        x, y = z["x"], z["y"]
    assert x.dtype == np.float32 and y.dtype == np.int32  # what the model takes (examples/export.py)

    def train(name, **arrays):
        path = tmp_path / f"{name}.npz"
        np.savez(path, **{"x": x, "y": y, **arrays})
        return run(capsys, "train", model, "--data", path, "--steps", 2, "--batch-size", 32, "-o",
                   tmp_path / f"o_{name}", "--no-progress")

    wide = y.astype(np.int64)
    wide[7] = 2 ** 40
    one_error(*train("wide", y=wide), "'y'", "int64", "int32", "row 7", str(2 ** 40), "cannot hold")
    frac = y.astype(np.float64)
    frac[3] = 2.5
    one_error(*train("frac", y=frac), "'y'", "float64", "int32", "row 3", "2.5", "not a whole number")
    fine = x.astype(np.float64)
    fine[9, 4] = 0.1
    one_error(*train("fine", x=fine), "'x'", "float64", "float32", "row 9", "0.1", "x.astype('float32')")
    # casts that change no value train
    for name, arrays in {"int64": {"y": y.astype(np.int64)}, "whole": {"y": y.astype(np.float64)},
                         "exact": {"x": x.astype(np.float64)}}.items():
        code, err = train(name, **arrays)
        assert code == 0, err
    assert sorted(p.name for p in tmp_path.iterdir() if p.name.startswith("o_")) == [
        "o_exact", "o_exact.serving", "o_int64", "o_int64.serving", "o_whole", "o_whole.serving"]


def test_tfrecord_data_is_checked_the_same_way(rewritten, digits, capsys, tmp_path):
    import tensorflow as tf

    model = rewritten("mlp:sgd", 2, 16)
    with np.load(digits["train"]) as z:
        x, y = z["x"][:64], z["y"][:64].astype(np.int64)
    y[11] = 2 ** 33
    path = tmp_path / "d.tfrecord"
    with tf.io.TFRecordWriter(str(path)) as w:
        for xi, yi in zip(x, y):
            w.write(tf.train.Example(features=tf.train.Features(feature={
                "x": tf.train.Feature(float_list=tf.train.FloatList(value=xi)),
                "y": tf.train.Feature(int64_list=tf.train.Int64List(value=[yi]))})).SerializeToString())
    one_error(*run(capsys, "train", model, "--data", path, "--steps", 1, "--batch-size", 32, "-o", tmp_path / "o",
                   "--no-progress"), "'y'", "int64", "int32", "row 11", str(2 ** 33))
    assert not (tmp_path / "o").exists()


def test_a_truncated_npz_is_one_line(rewritten, digits, capsys, tmp_path):
    model = rewritten("mlp:sgd", 2, 16)
    with open(digits["train"], "rb") as f:
        head = f.read(2000)
    for name, content in {"cut.npz": head, "empty.npz": b""}.items():
        (tmp_path / name).write_bytes(content)
        one_error(*run(capsys, "train", model, "--data", tmp_path / name, "--steps", 1, "--batch-size", 32, "-o",
                       tmp_path / "o", "--no-progress"), name, "not a readable .npz file")
    assert sorted(os.listdir(tmp_path)) == ["cut.npz", "empty.npz"]


@pytest.mark.parametrize("name,vnode_batch,batch", [("mlp:sgd", 16, 32), ("tf1", 4, 8)])
def test_a_label_out_of_range_is_one_whole_line(name, vnode_batch, batch, rewritten, digits, capsys, tmp_path):
    model = rewritten(name, 2, vnode_batch)
    with np.load(digits["train"]) as z:
        data = dict(z)
    data["y"] = data["y"].copy()
    data["y"][::5] = 12
    path = tmp_path / "labels.npz"
    np.savez(path, **data)
    line = one_error(*run(capsys, "train", model, "--data", path, "--steps", 3, "--batch-size", batch, "-o",
                          tmp_path / "o", "--no-progress"),
                     "step 0", "label value of 12", "outside the valid range of [0, 10)", "input 'y' holds 12 in row",
                     "labels.npz", "no model was written")
    row = int(line.split("in row ")[1].split()[0])
    assert data["y"][row] == 12 and line.endswith("no model was written"), line
    assert sorted(os.listdir(tmp_path)) == ["labels.npz"]


def test_training_prints_no_warning_about_unsaved_custom_gradients(rewritten, digits, tmp_path):
    # the digits MLP's Keras optimizer step has a custom gradient whose own gradient function
    # holds another, which TensorFlow's save does not keep
    model = rewritten("mlp:sgd", 2, 16)
    res = vf("train", model, "--data", digits["train"], "--steps", 2, "--batch-size", 32, "-o", tmp_path / "t",
             "--no-progress")
    assert res.returncode == 0, res.stderr
    assert "custom gradient" not in res.stderr, res.stderr
    code = f"import tensorflow as tf, vfgraph; tf.saved_model.load({str(tmp_path / 't')!r})"
    load = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, env=ENV, timeout=300)
    assert load.returncode == 0 and "custom gradient" not in load.stderr, load.stderr


def test_the_loss_record_is_bounded_and_resumes_exactly(rewritten, digits, capsys, tmp_path):
    from vfgraph.runtime.train import HISTORY

    model = rewritten("mlp:sgd", 2, 16)
    steps = HISTORY + 400
    cmd = ["train", model, "--data", digits["train"], "--steps", steps, "--batch-size", 32, "--checkpoint-every",
           100, "--no-progress"]
    progress = tmp_path / "a.ckpt" / "progress.json"
    step = interrupted([*cmd, "-o", tmp_path / "a"], progress, HISTORY + 100)
    with open(progress) as f:
        state = json.load(f)
    assert len(state["losses"]) == HISTORY and state["losses_from"] == step - HISTORY, {
        k: v for k, v in state.items() if k != "losses"}
    code, err = run(capsys, *cmd, "-o", tmp_path / "a", "--resume")
    assert code == 0, err
    code, err = run(capsys, *cmd, "-o", tmp_path / "b")
    assert code == 0, err
    a, b = training_record(tmp_path / "a"), training_record(tmp_path / "b")
    assert a == b and a["steps"] == steps and len(a["losses"]) == HISTORY and a["losses_from"] == steps - HISTORY
    assert a["first_loss"] == state["first_loss"]
    # a finished run's checkpoint goes: the output holds what it held
    assert not progress.parent.exists() and not (tmp_path / "b.ckpt").exists()


@contextlib.contextmanager
def tmpfs(path, size):
    """A real tmpfs of ``size`` bytes at ``path`` (root only: skipped elsewhere)."""
    os.makedirs(path, exist_ok=True)
    if os.geteuid() != 0:
        pytest.skip("mounting a small tmpfs needs root")
    res = subprocess.run(["mount", "-t", "tmpfs", "-o", f"size={size}", "tmpfs", str(path)], capture_output=True,
                         text=True)
    if res.returncode:
        pytest.skip(f"mounting a small tmpfs is not permitted here: {res.stderr.strip()}")
    try:
        yield path
    finally:
        subprocess.run(["umount", "-l", str(path)], capture_output=True)


def pages(path) -> int:
    """The 4 KiB pages the files under ``path`` take on a tmpfs."""
    return sum((os.path.getsize(os.path.join(r, f)) + 4095) // 4096 for r, _, fs in os.walk(path) for f in fs)


def test_a_full_disk_at_the_serving_export_is_an_error_and_keeps_the_work(rewritten, digits, capsys, tmp_path):
    model = rewritten("mlp:sgd", 2, 16)
    cmd = ["train", model, "--data", digits["train"], "--steps", 4, "--batch-size", 32, "--checkpoint-every", 2,
           "--no-progress"]
    code, err = run(capsys, *cmd, "-o", tmp_path / "ref")
    assert code == 0, err
    out_pages, serve_pages = pages(tmp_path / "ref"), pages(tmp_path / "ref.serving")
    ckpt_pages = pages(tmp_path / "ref" / "variables") + 1  # the step-2 checkpoint and progress.json
    assert serve_pages >= 6, serve_pages
    small = tmp_path / "small"
    with tmpfs(small, (out_pages + ckpt_pages + serve_pages // 2) * 4096):
        line = one_error(*run(capsys, *cmd, "-o", small / "t"), "writing the serving export failed",
                         f"{small / 't'} was written whole", "is kept",
                         f"vfgraph export {small / 't'} -o {small / 't.serving'}")
        assert "Traceback" not in line
        assert sorted(os.listdir(small)) == ["t", "t.ckpt"], os.listdir(small)
        assert training_record(small / "t")["steps"] == 4
        with open(small / "t.ckpt" / "progress.json") as f:
            assert json.load(f)["step"] == 2
        kept = tree_digest(small / "t")
        # what the message says to do, once there is room, makes the export
        shutil.rmtree(small / "t.ckpt")
        res = vf("export", small / "t", "-o", small / "t.serving")
        assert res.returncode == 0, res.stderr
        assert os.path.isdir(small / "t.serving" / "1") and tree_digest(small / "t") == kept
