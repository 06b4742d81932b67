"""A user's mistake with rewrite, inspect, verify and diff ends in one line and exit 2."""
import math
import os

import pytest

import vfgraph
from vfgraph.errors import VfgraphError
from vfgraph.testing.cli import error_line, run_in_process


@pytest.mark.parametrize("argv, want", [
    (["--vnodes", "1e11"], "argument --vnodes: invalid int value: '1e11'"),
    (["--vnodes", 10 ** 11], "--vnodes 100000000000: out of range"),
    (["--vnodes", 0], "--vnodes 0: out of range"),
    (["--vnode-batch", -2], "--vnode-batch -2: out of range"),
    (["--vnode-batch", 2 ** 31], "--vnode-batch 2147483648: out of range"),
    (["--fusion-mb", "nan"], "--fusion-mb nan: give a finite number"),
    (["--fusion-mb", "inf"], "--fusion-mb inf: give a finite number"),
    (["--fusion-mb", 0], "--fusion-mb 0: out of range"),
    (["--stages", 0], "--stages 0: out of range"),
    (["--stages", 10 ** 11], "--stages 100000000000: out of range"),
    (["--stages", 2, "--balance", "profile", "--profile-batch", 0], "--profile-batch 0: out of range"),
])
def test_numeric_rewrite_options_are_one_line(models, tmp_path, capsys, argv, want):
    out = tmp_path / "o"
    code, err = run_in_process(capsys, "rewrite", models("mlp:sgd"), *argv, "-o", out)
    assert code == 2 and want in error_line(err), err
    assert not out.exists()


@pytest.mark.parametrize("kwargs, want", [
    (dict(vnodes=10 ** 11), "option vnodes=100000000000: out of range"),
    (dict(vnodes=2, fusion_mb=math.nan), "option fusion-mb=nan: give a finite number"),
    (dict(vnodes=2, vnode_batch=-1), "option vnode-batch=-1: out of range"),
    (dict(stages=0), "option stages=0: out of range"),
])
def test_python_callers_get_the_same_checks(models, kwargs, want):
    with pytest.raises(VfgraphError, match=want):
        vfgraph.rewrite(models("mlp:sgd"), **kwargs)


@pytest.mark.parametrize("model, argv, want", [
    ("mlp:sgd", ["--vnodes", 2, "--schedule", "gpipe"], "--schedule gpipe without --stages"),
    ("mlp:sgd", ["--vnodes", 2, "--allreduce", "none", "--fusion-mb", 8], "--fusion-mb 8 with --allreduce none"),
    ("mlp:sgd", ["--vnodes", 2, "--outputs", "y:0"], "--outputs names a frozen GraphDef's output tensors, and "
                                                     "this is a SavedModel"),
    ("mlp:sgd", ["--vnodes", 2, "--loss", "loss:0"], "--loss names a TF1 MetaGraphDef's loss tensor"),
    ("mlp:sgd", ["--vnodes", 2, "--checkpoint", "ckpt"], "--checkpoint names a TF1 MetaGraphDef's checkpoint"),
    ("mlp:sgd", ["--pipeline", "split-vnodes{vnodes=2}", "--allreduce", "none"], "--allreduce none with a pipeline"),
    ("tf1ckpt", ["--vnodes", 2, "--allreduce", "mpi"], "--allreduce mpi: the rewritten step of a TF1 or GraphDef"),
    ("tf1ckpt", ["--vnodes", 2, "--fusion-mb", 2], "--fusion-mb 2: the rewritten step of a TF1 or GraphDef"),
    ("keras-export", ["--vnode-batch", 4, "--allreduce", "mpi"], "only the model's serving is rewritten"),
])
def test_an_option_the_rewrite_would_ignore_is_refused(models, tmp_path, capsys, model, argv, want):
    """No option given is silently ignored: one that would change nothing is a mistake, named."""
    out = tmp_path / "o"
    code, err = run_in_process(capsys, "rewrite", models(model), *argv, "-o", out)
    assert code == 2 and want in error_line(err), err
    assert not out.exists()


def test_python_options_without_effect_are_refused(models):
    with pytest.raises(VfgraphError, match="--vnodes 4, --allreduce none with a pipeline"):
        vfgraph.rewrite(models("mlp:sgd"), vnodes=4, allreduce="none", pipeline="microbatch-inference")
    with pytest.raises(VfgraphError, match="--schedule gpipe without --stages"):
        vfgraph.rewrite(models("mlp:sgd"), vnodes=4, schedule="gpipe")


@pytest.mark.parametrize("argv, want", [
    (["--steps", 10 ** 11], "--steps 100000000000: give the training steps"),
    (["--steps", 0], "--steps 0: give the training steps"),
    (["--batch-size", -1], "--batch-size -1: give the examples per step"),
    (["--rtol", "nan"], "--rtol nan: give a finite"),
    (["--rtol", "inf"], "--rtol inf: give a finite"),
    (["--steps", "3.5"], "argument --steps: invalid int value"),
])
def test_numeric_verify_options_are_one_line(models, capsys, argv, want):
    m = models("mlp:sgd")
    code, err = run_in_process(capsys, "verify", m, m, *argv)
    assert code == 2 and want in error_line(err), err


def test_inspect_stages_checked_by_the_pass(models, capsys):
    code, err = run_in_process(capsys, "inspect", models("mlp:sgd"), "--stages", 10 ** 11)
    assert code == 2 and "--stages 100000000000: out of range" in error_line(err), err


def test_a_second_rewrite_with_other_options_is_refused(models, tmp_path, capsys):
    from vfgraph import records
    from vfgraph.records import VirtualNodes
    from vfgraph.testing.cli import tree_digest

    m8 = tmp_path / "m8"
    assert run_in_process(capsys, "rewrite", models("mlp:sgd"), "--vnodes", 8, "--allreduce", "none", "-o", m8)[0] == 0
    before = tree_digest(m8)
    for argv, given in [(["--vnodes", 2], "vnodes=2 given, 8 recorded"), ([], "vnodes=1 given, 8 recorded"),
                        (["--vnodes", 8, "--deterministic"], "deterministic=true given, false recorded")]:
        code, err = run_in_process(capsys, "rewrite", m8, *argv, "-o", tmp_path / "m82")
        line = error_line(err)
        assert code == 2 and "signature 'train'" in line and "rewritten by split-vnodes already" in line, err
        assert given in line and "rewrite the original model" in line, err
        assert not (tmp_path / "m82").exists() and tree_digest(m8) == before
    with pytest.raises(VfgraphError, match="vnodes=2 given, 8 recorded"):
        vfgraph.rewrite(str(m8), vnodes=2)
    # the same options again: nothing to redo, and what was left out (the all-reduce) is added
    item = vfgraph.rewrite(str(m8), vnodes=8, allreduce="none")
    assert records.get(item, VirtualNodes)["train"].vnodes == 8
    assert any("split-vnodes rewrote it already" in n for n in item.metadata["notes"])
    code, err = run_in_process(capsys, "inspect", m8, "--json")
    assert code == 0


def test_a_second_microbatch_with_another_slice_is_refused(models):
    once = vfgraph.rewrite(models("mlp:sgd"), pipeline="microbatch-inference{vnode-batch=8}")
    with pytest.raises(VfgraphError, match="vnode-batch=4 given, 8 recorded"):
        vfgraph.rewrite(once, pipeline="microbatch-inference{vnode-batch=4}")
    again = vfgraph.rewrite(once, pipeline="microbatch-inference{vnode-batch=8}")
    assert "rewrote it already" in " ".join(again.metadata["notes"])


def test_no_training_signature_is_one_line(models, tmp_path, capsys):
    serving_only = models("keras-export")
    for argv, want in [(["--vnodes", 2], "no training signature (signatures: serve, serving_default"),
                       ([], "no training signature (signatures: serve, serving_default"),
                       (["--vnodes", 2, "--train-signature", "nosuch"], "no training signature 'nosuch'")]:
        code, err = run_in_process(capsys, "rewrite", serving_only, *argv, "-o", tmp_path / "o")
        assert code == 2 and want in error_line(err) and "--train-signature NAME" in error_line(err), err
        assert not (tmp_path / "o").exists()
    code, err = run_in_process(capsys, "rewrite", models("mlp:sgd"), "--train-signature", "nosuch",
                               "-o", tmp_path / "o")
    assert code == 2 and "no training signature 'nosuch' (signatures: serving_default, train)" in error_line(err)
    # serving alone is micro-batched
    assert run_in_process(capsys, "rewrite", serving_only, "--vnode-batch", 4, "-o", tmp_path / "s")[0] == 0


def _unprivileged():
    """The argv prefix that runs a command as a user who cannot read what others cannot: user
    nobody, or root without the capabilities that pass over file modes; None when neither works."""
    import subprocess
    import sys

    from vfgraph.testing.cli import ENV

    env = dict(ENV, PYTHONPATH=os.pathsep.join(p for p in sys.path if p))
    for prefix in (["setpriv", "--reuid=65534", "--regid=65534", "--clear-groups"],
                   ["setpriv", "--inh-caps=-all", "--bounding-set=-dac_override,-dac_read_search"]):
        try:
            ok = subprocess.run(prefix + [sys.executable, "-c", "import vfgraph.cli"], env=env, capture_output=True,
                                timeout=120).returncode == 0
        except (OSError, subprocess.SubprocessError):
            ok = False
        if ok:
            return prefix, env
    return None, env


def test_permission_denied_is_named_for_every_input(models, tmp_path):
    import shutil
    import stat
    import subprocess
    import sys
    import tempfile

    import numpy as np

    prefix, env = _unprivileged()
    if prefix is None:
        pytest.skip("neither setpriv to user nobody nor dropping the DAC capabilities works here")
    root = tempfile.mkdtemp(prefix="vf-perm-", dir="/tmp")  # a place user nobody can enter
    try:
        os.chmod(root, 0o755)
        ok, closed_file, closed_dir = (os.path.join(root, n) for n in ("ok", "file", "dir"))
        for p in (ok, closed_file, closed_dir):
            shutil.copytree(models("mlp:sgd"), p)
            subprocess.run(["chmod", "-R", "a+rX", p], check=True)
        os.chmod(os.path.join(closed_file, "variables", "variables.index"), 0)
        os.chmod(closed_dir, 0)
        data = os.path.join(root, "d.npz")
        np.savez(data, x=np.zeros((4, 64), "float32"), y=np.zeros(4, "int64"))
        os.chmod(data, 0)
        out = os.path.join(root, "out")
        cases = [(["rewrite", closed_file, "--vnodes", 2, "-o", out], closed_file),
                 (["rewrite", closed_dir, "-o", out], closed_dir),
                 (["inspect", os.path.join(closed_dir, "saved_model.pb")], closed_dir),
                 (["diff", ok, closed_file], closed_file),
                 (["verify", ok, closed_dir], closed_dir),
                 (["verify", ok, ok, "--data", data], data),
                 (["train", closed_file, "--data", data, "--steps", 1, "--batch-size", 4, "-o", out], closed_file),
                 (["train", ok, "--data", data, "--steps", 1, "--batch-size", 4, "-o", out], data),
                 (["export", closed_dir, "-o", out], closed_dir)]
        for argv, where in cases:
            res = subprocess.run(prefix + [sys.executable, "-m", "vfgraph.cli", *map(str, argv)], env=env,
                                 capture_output=True, text=True, timeout=300)
            line = error_line(res)
            assert res.returncode == 2 and "permission denied" in line and where in line, (argv, res.stderr)
            assert "no such file" not in line and not os.path.exists(out)
        assert stat.S_IMODE(os.stat(closed_dir).st_mode) == 0  # inputs untouched
    finally:
        subprocess.run(["chmod", "-R", "u+rwX", root])
        shutil.rmtree(root)


def test_inspect_stages_need_a_training_step_not_yet_rewritten(models, tmp_path, capsys):
    code, err = run_in_process(capsys, "inspect", models("keras-export"), "--split-at", "Relu")
    assert code == 2 and "--split-at: " in error_line(err) and "has no training signature 'train'" in error_line(err)
    out = tmp_path / "m2"
    vfgraph.save(vfgraph.rewrite(models("mlp:sgd"), vnodes=2, allreduce="none"), str(out))
    code, err = run_in_process(capsys, "inspect", out, "--stages", 2)
    assert code == 2 and "was rewritten with virtual nodes already" in error_line(err), err
