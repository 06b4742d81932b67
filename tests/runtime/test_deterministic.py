"""Deterministic mode under real ``mpiexec``: a model rewritten with ``deterministic=True``
trains bit-identical parameters whatever the layout of its V=8 virtual nodes over ranks (1x8,
2x4, 4x2, 5+3), where the default mode agrees only to rounding."""
import numpy as np
import pytest

from test_mpi_train import B, losses, params, rewritten, run_train

pytestmark = pytest.mark.mpi


@pytest.fixture(scope="module")
def exact(models, tmp_path_factory):
    """Models rewritten with 8 virtual nodes of 8 examples, the all-reduce and exact sums."""
    return rewritten(models, tmp_path_factory.mktemp("deterministic"), deterministic=True)


LAYOUTS = {"1x8": (0, ()), "2x4": (2, ()), "4x2": (4, ()), "5+3": (2, ("--vnodes-per-rank", "5,3")),
           "7+1": (2, ("--vnodes-per-rank", "7,1"))}


@pytest.mark.parametrize("name, layouts", [("mlp:adam", ["2x4", "4x2", "5+3"]), ("cnn:momentum", ["2x4", "7+1"])],
                         ids=["mlp-adam", "cnn-momentum"])
def test_any_layout_trains_bit_identical_parameters(exact, digits, tmp_path, name, layouts):
    """Adam (which magnifies rounding in small gradients) and batch norm (statistics of small
    virtual nodes) are where the default mode's layouts drift apart."""
    model = exact(name)
    outs = {}
    for label in ["1x8"] + layouts:
        ranks, extra = LAYOUTS[label]
        outs[label] = str(tmp_path / label.replace("+", "_"))
        run_train(ranks, model, digits["train"], outs[label], 4, *extra)
    reference = params(outs["1x8"])
    for label in layouts:
        got = params(outs[label])
        differ = [k for k in reference if not np.array_equal(reference[k], got[k])]
        assert not differ, f"{label}: {differ[:3]} differ from 1x8"
        assert losses(outs[label]) == losses(outs["1x8"])


def test_exact_sums_train_what_the_default_mode_trains(exact, models, digits, tmp_path):
    """The fixed-point sums change only what lies below 2^-60: the same training within rounding."""
    import vfgraph

    default = str(tmp_path / "default_model")
    vfgraph.save(vfgraph.rewrite(models("mlp:momentum"), vnodes=8, vnode_batch=B), default)
    run_train(0, default, digits["train"], str(tmp_path / "default"), 4)
    run_train(0, exact("mlp:momentum"), digits["train"], str(tmp_path / "exact"), 4)
    a, b = params(str(tmp_path / "default")), params(str(tmp_path / "exact"))
    for k in a:
        np.testing.assert_allclose(b[k], a[k], rtol=1e-5, atol=1e-7, err_msg=k)
    np.testing.assert_allclose(losses(str(tmp_path / "exact")), losses(str(tmp_path / "default")), rtol=1e-5)


def test_the_command_line_rewrites_and_shows_deterministic_mode(models, tmp_path):
    import subprocess
    import sys

    from test_mpi_train import ENV
    from vfgraph import records
    from vfgraph.records import VirtualNodes

    out = str(tmp_path / "exact")
    cli = [sys.executable, "-m", "vfgraph.cli"]
    res = subprocess.run(cli + ["rewrite", models("mlp:sgd"), "--vnodes", "8", "--vnode-batch", str(B),
                                "--deterministic", "-o", out], capture_output=True, text=True, env=ENV, timeout=300)
    assert res.returncode == 0, res.stderr[-2000:]
    assert "deterministic=true" in res.stdout and "step-wise signatures: not added" in res.stderr
    assert records.read(out, VirtualNodes)["train"].deterministic
    shown = subprocess.run(cli + ["inspect", out], capture_output=True, text=True, env=ENV, timeout=300)
    assert "deterministic (exact) sums" in shown.stdout, shown.stdout
    bad = subprocess.run(cli + ["rewrite", models("mlp:sgd"), "--pipeline", "split-vnodes{vnodes=8}",
                                "--deterministic", "-o", str(tmp_path / "bad")], capture_output=True, text=True,
                         env=ENV, timeout=300)
    assert bad.returncode == 2 and "split-vnodes{vnodes=8,deterministic=true}" in bad.stderr
    assert "Traceback" not in bad.stderr and not (tmp_path / "bad").exists()
