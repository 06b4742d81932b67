"""A user's mistake with rewrite, inspect, verify and diff ends in one line and exit 2."""
import math

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
    code, err = run_in_process(capsys, "rewrite", models("mlp:sgd"), "--train-signature", "nosuch", "-o", tmp_path / "o")
    assert code == 2 and "no training signature 'nosuch' (signatures: serving_default, train)" in error_line(err)
    # serving alone is micro-batched
    assert run_in_process(capsys, "rewrite", serving_only, "--vnode-batch", 4, "-o", tmp_path / "s")[0] == 0
