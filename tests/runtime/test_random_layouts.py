"""Random ops keyed by virtual node, on every layout: the four models of test_random_ops
(Keras ``Dropout``, a keras-hub transformer with dropout, an in-graph random augmentation, a
``tf.random.Generator``) draw the same values with the V=8 virtual nodes on one process (1x8),
on 2 ranks (2x4, 5+3), through an elastic 1 -> 2 -> 1 run, over the replicas of a pipeline,
and fed one call at a time through the step-wise signatures.

(Each MPI run costs seconds: a model's layouts share one test, and the models are those
test_random_ops exports, made once per pytest process.)"""
import numpy as np
import pytest

from test_mpi_train import B, run_train
from test_random_ops import STEPS, assert_identical, made, reference  # noqa: F401 - fixtures

pytestmark = pytest.mark.mpi


KINDS = ["dropout", "transformer", "stateful", "generator"]  # the "stateful" model: an in-graph augmentation
ELASTIC = ("--max-ranks", "2", "--elastic-schedule", "0:1,3:2,6:1")  # steps 3-5 run 2x4


def _layout(kind: str, model: str, data: str, out: str, steps: int, *extra: str) -> None:
    """Train ``model`` ``steps`` steps on 2 ranks: "5+3", or "elastic" (1 -> 2 -> 1 ranks,
    the 2 ranks 4 virtual nodes each)."""
    if kind == "5+3":
        run_train(2, model, data, out, steps, "--threads", "1", "--vnodes-per-rank", "5,3")
        return
    res = run_train(1, model, data, out, steps, "--threads", "1", *ELASTIC, timeout=600)
    assert "resized 1 -> 2 ranks at step 3" in res.stderr and "resized 2 -> 1 ranks at step 6" in res.stderr, \
        res.stderr[-3000:]


@pytest.mark.parametrize("kind", KINDS)
def test_every_layout_trains_bit_identical(made, reference, digits, tmp_path, kind):
    """Deterministic mode: 5+3 and an elastic 1 -> 2 -> 1 run (whose middle steps run 2x4)
    leave the parameters and losses of 1x8 (the reference) bit for bit."""
    for layout in ("5+3", "elastic"):
        out = str(tmp_path / layout.replace("+", "_"))
        _layout(layout, made(kind, True), digits["train"], out, STEPS)
        assert_identical(reference(kind), out, f"{kind} {layout}")


@pytest.mark.parametrize("kind, layout", [("dropout", "elastic"), ("transformer", "5+3"), ("stateful", "5+3"),
                                          ("generator", "elastic")])
def test_default_mode_trains_alike_on_any_layout(made, digits, tmp_path, capsys, kind, layout):
    """Default mode (sums in floating point): within 1e-6 of 1x8, run in this process. (One
    multi-rank layout per model, each layout for two models: the draws are keyed by the same
    rewrite as in deterministic mode, tested above on every layout.)"""
    from test_mpi_train import assert_same_params, losses
    from vfgraph.testing.cli import run_in_process

    model, steps = made(kind, False), 8
    code, err = run_in_process(capsys, "train", model, "--data", digits["train"], "--steps", steps, "--batch-size",
                               8 * B, "--threads", 1, "--no-progress", "-o", tmp_path / "1x8")
    assert code == 0, err
    _layout(layout, model, digits["train"], str(tmp_path / "layout"), steps)
    assert_same_params(str(tmp_path / "1x8"), str(tmp_path / "layout"), 1e-6)
    np.testing.assert_allclose(losses(str(tmp_path / "layout")), losses(str(tmp_path / "1x8")), rtol=1e-6)


def _variables(loaded) -> dict:
    """The training step's variables by name, as arrays."""
    return {v.name: v.numpy() for v in loaded.signatures["train"].variables}


def test_stepwise_calls_draw_what_the_looped_step_draws(made):
    """accumulate called once per virtual node (8 calls), then apply, twice: each call numbers
    its virtual nodes after the step's calls before it, and apply starts the next step from 0;
    a generator restarts each call from its state at the step's start and has skipped once
    after the step. The parameters (and the generator's state) equal those of two looped
    steps bit for bit."""
    import tensorflow as tf

    from vfgraph import records
    from vfgraph.records import VirtualNodes

    for kind in ("dropout", "generator"):
        model = made(kind, False)
        assert records.read(model, VirtualNodes)["train"].stepwise, kind
        looped, stepwise = tf.saved_model.load(model), tf.saved_model.load(model)
        rng = np.random.default_rng(1)
        for _ in range(2):
            x, y = rng.random((8 * B, 64), np.float32), rng.integers(0, 10, 8 * B).astype(np.int32)
            looped.signatures["train"](x=x, y=y)
            for k in range(8):
                stepwise.signatures["train_accumulate"](x=x[k * B:(k + 1) * B], y=y[k * B:(k + 1) * B])
            stepwise.signatures["train_apply"]()
        a, b = _variables(looped), _variables(stepwise)
        differ = [k for k in a if not np.array_equal(a[k], b[k])]
        assert not differ, (kind, differ[:3])


def test_pipeline_replicas_draw_what_the_unstaged_step_draws(made, reference, digits, tmp_path):
    """2 stages x 2 replicas (mpiexec -n 4): each replica numbers its virtual nodes after the
    lower replica's (an all-gather over the ranks of its stage), so the deterministic staged
    step trains bit-identical to the unstaged one on one process."""
    import vfgraph

    staged = str(tmp_path / "staged")
    vfgraph.save(vfgraph.rewrite(made("dropout"), vnodes=8, vnode_batch=B, stages=2, deterministic=True), staged)
    run_train(4, staged, digits["train"], str(tmp_path / "replicas"), STEPS, "--threads", "1")
    assert_identical(reference("dropout"), str(tmp_path / "replicas"), "2 stages x 2 replicas")
