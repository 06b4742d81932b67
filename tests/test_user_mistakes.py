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
