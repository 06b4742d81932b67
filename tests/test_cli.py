"""The command line, run as users run it (subprocesses), bad input included."""
import os
import re
import shutil
import subprocess
import sys

import numpy as np
import pytest

from vfgraph.testing.cli import ENV, error_line, run_in_process, tree_digest, vf


def test_version_and_help():
    assert vf("--version").stdout.startswith("vfgraph ")
    for cmd in ("rewrite", "inspect", "diff", "verify", "train", "export", "build-ops"):
        assert vf(cmd, "--help").returncode == 0
    assert "default mpi" in vf("rewrite", "--help").stdout.replace("\n", " ").replace("  ", " ")


def test_the_output_depends_on_the_input_and_options_only(models, tmp_path):
    """The default all-reduce is the same on every machine, and the summary line says which."""
    src = models("mlp:sgd")
    a = vf("rewrite", src, "--vnodes", 2, "-o", tmp_path / "a")
    b = vf("rewrite", src, "--vnodes", 2, "--allreduce", "none", "-o", tmp_path / "b")
    assert a.returncode == 0 and b.returncode == 0, a.stderr + b.stderr
    assert "all-reduce: mpi" in a.stdout and "all-reduce: none" in b.stdout
    assert "all-reduce over MPI ranks" in vf("inspect", tmp_path / "a").stdout
    assert "all-reduce: none" in vf("inspect", tmp_path / "b").stdout


def test_rewrite_inspect_diff_verify(models, tmp_path):
    src = models("mlp:adam")
    before = tree_digest(src)
    out = tmp_path / "v8"
    res = vf("rewrite", src, "--vnodes", 8, "--vnode-batch", 4, "-o", out)
    assert res.returncode == 0, res.stderr
    assert tree_digest(src) == before
    ins = vf("inspect", out)
    assert ins.returncode == 0 and "V=8 b=4" in ins.stdout
    ins = vf("inspect", src)
    # Keras numbers layer names per process: match the pattern, not the number
    assert re.search(r"\S+ \[64, 32\] -> sequential(_\d+)?/dense(_\d+)?/kernel", ins.stdout), ins.stdout
    assert re.search(r"optimizer state: adam(_\d+)?/iteration", ins.stdout), ins.stdout
    assert vf("diff", src, src).returncode == 0
    d = vf("diff", src, out)
    assert d.returncode == 1 and "+++" in d.stdout and "While" in d.stdout
    ver = vf("verify", src, out, "--batch-size", 32)
    assert ver.returncode == 0 and "OK" in ver.stdout, ver.stdout + ver.stderr


def run(capsys, *argv):
    """The command in this process, for mistakes whose answer does not depend on the process:
    (exit code, the one error line)."""
    code, err = run_in_process(capsys, *argv)
    return code, (error_line(err) if code else "")


def test_output_exists_needs_force(models, tmp_path, capsys):
    out = tmp_path / "o"
    out.mkdir()
    code, line = run(capsys, "rewrite", models("mlp:sgd"), "--vnodes", 2, "-o", out)
    assert code == 2 and "--force" in line
    assert list(out.iterdir()) == []
    assert run(capsys, "rewrite", models("mlp:sgd"), "--vnodes", 2, "-o", out, "--force")[0] == 0


@pytest.fixture
def broken(models, tmp_path):
    def make(kind):
        d = tmp_path / kind
        shutil.copytree(models("mlp:sgd"), d)
        pb = d / "saved_model.pb"
        data = pb.read_bytes()
        if kind == "truncated":
            pb.write_bytes(data[: len(data) // 3])
        elif kind == "corrupt":
            pb.write_bytes(b"\x00\xff" * 100 + data[200:])
        elif kind == "novars":
            shutil.rmtree(d / "variables")
        return d
    return make


def test_bad_models_fail_cleanly(broken, tmp_path, capsys):
    made = {}
    for kind, needle in [("truncated", "saved_model.pb"), ("corrupt", "saved_model.pb"), ("novars", "variables")]:
        d = made[kind] = broken(kind)
        before = tree_digest(d)
        out = tmp_path / "out"
        code, line = run(capsys, "rewrite", d, "--vnodes", 2, "-o", out)
        assert code == 2 and needle in line, (kind, line)
        assert not out.exists() and tree_digest(d) == before
        assert not [p for p in tmp_path.iterdir() if p.name.startswith(".vfgraph")]
    res = vf("rewrite", made["truncated"], "--vnodes", 2, "-o", out)  # and in a process of its own
    assert res.returncode == 2 and "saved_model.pb" in error_line(res) and not out.exists()


def test_not_a_model(tmp_path, capsys):
    (tmp_path / "x.txt").write_text("hello")
    for target in (tmp_path, tmp_path / "x.txt", tmp_path / "missing"):
        code, line = run(capsys, "rewrite", target, "--vnodes", 2, "-o", tmp_path / "out")
        assert code == 2 and str(target) in line


def test_no_training_signature_when_asked(models, tmp_path, capsys):
    code, line = run(capsys, "rewrite", models("keras-export"), "--vnodes", 2, "--train-signature", "train", "-o",
                     tmp_path / "o")
    assert code == 2 and "no training signature" in line
    assert not (tmp_path / "o").exists()


def test_bad_pipeline_and_vnodes(models, tmp_path, capsys):
    code, line = run(capsys, "rewrite", models("mlp:sgd"), "--pipeline", "split-vnodes{vnodez=2}", "-o", tmp_path / "o")
    assert code == 2 and "no option 'vnodez'" in line
    code, line = run(capsys, "rewrite", models("mlp:sgd"), "--pipeline", "nonsense", "-o", tmp_path / "o")
    assert code == 2 and "unknown pass" in line
    code, line = run(capsys, "rewrite", models("mlp:sgd"), "--vnodes", 0, "-o", tmp_path / "o")
    assert code == 2 and "--vnodes" in line


def test_saved_model_cli_shows_rewritten_model(rewritten):
    out = rewritten("mlp:sgd", 4, 8)
    cli = shutil.which("saved_model_cli", path=os.path.dirname(sys.executable)) or "saved_model_cli"
    show = subprocess.run([cli, "show", "--dir", out, "--all"], capture_output=True, text=True, env=ENV)
    assert show.returncode == 0 and "signature_def['train']" in show.stdout
    for key in ("train_accumulate", "train_apply"):  # the step-wise pair is in the signature_def map too
        assert f"signature_def['{key}']" in show.stdout, show.stdout[-3000:]
    acc = show.stdout.split("signature_def['train_accumulate']")[1].split("signature_def[")[0]
    assert "inputs['x']" in acc and "outputs['loss']" in acc
    # loaded again, the step-wise pair is the runtime's, not one of the model's signatures
    import vfgraph

    assert sorted(vfgraph.load(out).signatures) == ["serving_default", "train"]
    res = vf("inspect", out)
    assert res.returncode == 0 and "step-wise: signatures 'train_accumulate' (repeat) and 'train_apply'" in res.stdout
    assert "signature 'train_accumulate'" not in res.stdout
    # `saved_model_cli run` cannot restore the variables of a TF2 tf.Module export (the
    # original fails the same way), so running is checked with tf.saved_model.load below.


def test_fresh_process_loads_rewritten_model(rewritten):
    out = rewritten("mlp:adam", 4, 8)
    code = ("import vfgraph, tensorflow as tf, numpy as np; m = tf.saved_model.load(%r); "
            "r = m.signatures['train'](x=np.zeros((16, 64), np.float32), y=np.zeros(16, np.int32)); "
            "print(float(r['loss']))" % out)
    res = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, env=ENV, timeout=120)
    assert res.returncode == 0, res.stderr
    # zero inputs and zero-initialised biases give uniform logits: the loss is ln(10)
    assert abs(float(res.stdout.split()[-1]) - np.log(10)) < 1e-5


def test_train_resume_and_result(rewritten, digits, tmp_path, capsys):
    out = rewritten("mlp:sgd", 4, 8)
    full = vf("train", out, "--data", digits["train"], "--steps", 6, "--batch-size", 32, "-o", tmp_path / "full",
              "--no-progress")
    assert full.returncode == 0, full.stderr
    code, _ = run(capsys, "train", out, "--data", digits["train"], "--steps", 6, "--batch-size", 32, "-o",
                  tmp_path / "part", "--no-progress", "--checkpoint-every", 3)
    assert code == 0
    code, line = run(capsys, "train", out, "--data", digits["train"], "--steps", 2, "--batch-size", 30, "-o",
                     tmp_path / "bad", "--no-progress")
    assert code == 2 and "b=8" in line and not (tmp_path / "bad").exists()
    code, line = run(capsys, "train", out, "--data", tmp_path / "nope.npz", "--steps", 2, "--batch-size", 32, "-o",
                     tmp_path / "m")
    assert code == 2 and "nope.npz" in line


def test_killed_training_resumes_to_the_same_parameters(rewritten, digits, tmp_path):
    import signal
    import time

    import tensorflow as tf

    model = rewritten("mlp:sgd", 4, 8)
    common = ["--data", digits["train"], "--steps", 400, "--batch-size", 32, "--no-progress"]
    assert vf("train", model, *common, "-o", tmp_path / "straight").returncode == 0
    out = tmp_path / "resumed"
    cmd = [sys.executable, "-m", "vfgraph.cli", "train", model, *map(str, common), "-o", str(out),
           "--checkpoint-every", "20"]
    proc = subprocess.Popen(cmd, env=ENV, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    progress = tmp_path / "resumed.ckpt" / "progress.json"
    deadline = time.time() + 120
    while not progress.exists() and proc.poll() is None and time.time() < deadline:
        time.sleep(0.05)
    proc.send_signal(signal.SIGKILL)
    proc.wait()
    assert progress.exists() and not out.exists(), "the run was not interrupted mid-training"
    res = vf("train", model, *common, "-o", out, "--resume", "--checkpoint-every", "20")
    assert res.returncode == 0, res.stderr
    a = tf.saved_model.load(str(tmp_path / "straight"))
    b = tf.saved_model.load(str(out))
    va = {v.name: v.numpy() for v in a.signatures["train"].variables}
    vb = {v.name: v.numpy() for v in b.signatures["train"].variables}
    assert va.keys() == vb.keys()
    for k in va:
        np.testing.assert_array_equal(va[k], vb[k], err_msg=k)


def test_print_after_all_and_json_inspect(models, tmp_path):
    import json

    res = vf("rewrite", models("mlp:sgd"), "--pipeline", "split-vnodes{vnodes=2},microbatch-inference{vnode-batch=4}",
             "--print-after-all", "-o", tmp_path / "o")
    assert res.returncode == 0, res.stderr
    assert "// ----- after split-vnodes{vnodes=2}" in res.stdout
    assert "// ----- after microbatch-inference{vnode-batch=4}" in res.stdout
    assert res.stdout.count('op: "While"') >= 2
    info = json.loads(vf("inspect", models("mlp:adam"), "--json").stdout)
    grads = info["signatures"]["train"]["training"]["gradients"]
    assert len(grads) == 4 and all(g["role"] == "gradient" for g in grads)


def test_inspect_names_every_gradient_with_batch_norm(models):
    import json

    info = json.loads(vf("inspect", models("cnn:momentum"), "--json").stdout)["signatures"]["train"]["training"]
    # Keras numbers layers per process ("sequential_3/dense_2/kernel"): compare without numbers
    named = {re.sub(r"_\d+", "", "/".join(g["variable"].split("/")[-2:])) for g in info["gradients"] if g["variable"]}
    assert named == {"batch_normalization/gamma", "batch_normalization/beta", "dense/kernel", "dense/bias",
                     "conv2d/kernel"}
    assert sorted(v.split("/")[-1] for v in info["batch_dependent_updates"]) == ["moving_mean", "moving_variance"]


def test_the_command_line_imports_no_tensorflow_until_it_works():
    """Under mpiexec, ``vfgraph train`` is a light supervisor of its rank's worker: a supervisor
    that had loaded TensorFlow's libraries broke the worker's MPI start-up (UCX addresses that
    the ranks could not exchange). Importing the command line loads no TensorFlow module."""
    code = "import sys, vfgraph.cli\nprint(sorted(m for m in sys.modules if m.split('.')[0] == 'tensorflow')[:3])\n"
    res = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, env=ENV)
    assert res.stdout.strip() == "[]", res.stdout + res.stderr


def test_a_missing_input_is_named_before_tensorflow_is_imported(tmp_path):
    """Every command with an input path refuses a missing one in one line, exit 2, without
    importing TensorFlow (which takes seconds)."""
    gone = str(tmp_path / "gone")
    commands = [["rewrite", gone], ["inspect", gone], ["diff", gone, gone], ["verify", gone, gone],
                ["export", gone, "-o", str(tmp_path / "s")],
                ["train", gone, "--data", "d.npz", "--steps", "1", "--batch-size", "1", "-o", str(tmp_path / "t")]]
    code = ("import sys\nfrom vfgraph.cli import main\n"
            f"codes = [main(c) for c in {commands!r}]\n"
            "print(codes, any(m.split('.')[0] == 'tensorflow' for m in sys.modules))\n")
    res = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, env=ENV)
    assert res.stdout.split() == ["[2,", "2,", "2,", "2,", "2,", "2]", "False"], res.stdout + res.stderr
    lines = [l for l in res.stderr.splitlines() if l.startswith("vfgraph")]
    assert lines == [f"vfgraph {c[0]}: error: {gone}: no such file or directory" for c in commands]
