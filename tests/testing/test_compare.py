"""compare_models (``vfgraph verify``): what it compares, and the one-line InputError for what it cannot."""
import re

import numpy as np
import pytest

from vfgraph.errors import InputError
from vfgraph.testing import compare
from vfgraph.testing.compare import compare_models


def _module_model(path, units=3, features=4, variable="w", input_name="x", output="y", extra_signature=False):
    """A hand-made SavedModel: ``serving_default`` sums ``x @ w`` per row; optionally a second signature."""
    import tensorflow as tf

    class Linear(tf.Module):
        def __init__(self):
            super().__init__()
            self.w = tf.Variable(tf.ones([features, units]), name=variable)

        @tf.function(input_signature=[tf.TensorSpec([None, features], tf.float32, name=input_name)])
        def serve(self, x):
            return {output: tf.reduce_sum(tf.matmul(x, self.w), axis=1)}

    m = Linear()
    signatures = {"serving_default": m.serve}
    if extra_signature:
        signatures["scaled"] = m.serve
    tf.saved_model.save(m, str(path), signatures=signatures)
    return str(path)


@pytest.fixture(scope="module")
def small(tmp_path_factory):
    """Hand-made models by name (exported once per module)."""
    root = tmp_path_factory.mktemp("small")
    kinds = {
        "base": {},
        "wide": {"units": 2},                  # w [4, 2] instead of [4, 3]
        "features": {"features": 8},           # x [None, 8]
        "renamed-input": {"input_name": "inputs"},
        "renamed-output": {"output": "z"},
        "renamed-variable": {"variable": "v"},
        "two-signatures": {"extra_signature": True},
    }
    made = {}

    def get(name):
        if name not in made:
            made[name] = _module_model(root / name, **kinds[name])
        return made[name]

    return get


@pytest.fixture(scope="module")
def digits_batch():
    """64 rows of inputs for the digits models' signatures (x float32 [N, 64], y int32 [N])."""
    rng = np.random.default_rng(0)
    return {"x": rng.normal(size=(64, 64)).astype(np.float32), "y": rng.integers(0, 10, 64).astype(np.int32)}


def test_unrelated_models_are_refused_naming_the_variables(models):
    mlp, cnn = models("mlp:sgd"), models("cnn:momentum")  # same signatures, other variables
    with pytest.raises(InputError) as e:
        compare_models(mlp, cnn, steps=1, batch=16)
    msg = str(e.value)
    assert msg.startswith(f"{mlp} and {cnn} are not the same model: variables differ (")
    assert re.search(rf"\d+ only in {re.escape(mlp)}: \S+:0, ", msg), msg
    assert re.search(rf"\d+ only in {re.escape(cnn)}\); give the model and its rewrite$", msg), msg


def test_a_variable_of_another_shape_is_named(small):
    a, b = small("base"), small("wide")
    with pytest.raises(InputError, match=re.escape(f"{a} and {b} are not the same model: variables differ "
                                                   "(w:0 [4, 3] vs [4, 2]); give the model and its rewrite")):
        compare_models(a, b, steps=1, batch=4)


def test_a_variable_missing_from_the_rewrite_is_named(small):
    a, b = small("base"), small("renamed-variable")
    with pytest.raises(InputError, match=re.escape(f"variables differ (1 only in {a}: w:0; 1 only in {b})")):
        compare_models(a, b, steps=1, batch=4)


@pytest.mark.parametrize("other, detail", [
    ("features", "signature 'serving_default' input 'x' is float32 [None, 4] in {a} but float32 [None, 8] in {b}"),
    ("renamed-input", "signature 'serving_default' has inputs ['x'] in {a} but ['inputs'] in {b}"),
    ("renamed-output", "signature 'serving_default' has outputs ['y'] in {a} but ['z'] in {b}"),
])
def test_signatures_that_differ_are_named(small, other, detail):
    a, b = small("base"), small(other)
    want = f"{a} and {b} are not the same model: " + detail.format(a=a, b=b) + "; give the model and its rewrite"
    with pytest.raises(InputError, match=re.escape(want)):
        compare_models(a, b, steps=1, batch=4)


def test_a_signature_missing_from_the_rewrite_is_named(small):
    a, b = small("two-signatures"), small("base")
    with pytest.raises(InputError, match=re.escape(f"signatures ['scaled'] of {a} are not in {b} "
                                                   "(it has: serving_default)")):
        compare_models(a, b, steps=1, batch=4)
    assert compare_models(b, a, steps=1, batch=4).serving == {"serving_default": 0.0}  # a rewrite may add some


def test_a_model_and_its_rewrite_still_compare(models, rewritten):
    rep = compare_models(models("mlp:sgd"), rewritten("mlp:sgd", 2, 16), steps=3, batch=32)
    assert set(rep.serving) == {"serving_default"} and rep.worst_output < 1e-5, rep.serving
    assert len(rep.loss) == 3 and rep.params, rep
    assert rep.worst_param < 1e-5, rep.params


def test_a_batch_that_is_not_a_multiple_of_b_is_refused(models, rewritten):
    out = rewritten("mlp:sgd", 2, 16)
    with pytest.raises(InputError, match=re.escape(f"--batch-size 20: not a multiple of the virtual-node batch b=16 "
                                                   f"of {out}; give a multiple of 16")):
        compare_models(models("mlp:sgd"), out, steps=1, batch=20)


def test_a_batch_that_does_not_split_into_the_vnodes_is_refused(models, rewritten):
    out = rewritten("mlp:sgd", 2)  # b derived at run time: the fed batch / 2
    with pytest.raises(InputError, match=re.escape(f"--batch-size 33: not a multiple of the vnodes=2 virtual nodes "
                                                   f"of {out}") + r".*give a multiple of 2$"):
        compare_models(models("mlp:sgd"), out, steps=1, batch=33)


def test_a_failed_graph_check_is_reported_with_its_line(models, rewritten, monkeypatch):
    """Should a batch get past the checks up front, the rewritten graph's own check is reported as an
    InputError with its message, not as TensorFlow's InvalidArgumentError."""
    out = rewritten("mlp:sgd", 2, 16)
    monkeypatch.setattr(compare, "_check_vnode_batch", lambda *args: None)
    with pytest.raises(InputError, match=re.escape(f"{out}: signature 'train': vfgraph: the fed batch is not a "
                                                   "multiple of the virtual-node batch b=16; feed a multiple of 16 "
                                                   "examples")):
        compare_models(models("mlp:sgd"), out, steps=1, batch=20)


@pytest.mark.parametrize("steps, batch, message", [
    (0, 32, "--steps 0: give the training steps to compare, a whole number from 1"),
    (-1, 32, "--steps -1: give the training steps to compare, a whole number from 1"),
    (3, 0, "--batch-size 0: give the examples per step, a whole number from 1"),
])
def test_counts_below_one_are_refused(steps, batch, message):
    with pytest.raises(InputError, match=re.escape(message)):
        compare_models("not-read", "not-read", steps=steps, batch=batch)


def test_a_directory_that_is_no_saved_model_is_refused(models, tmp_path):
    with pytest.raises(InputError, match=re.escape(f"{tmp_path}: not a SavedModel directory")):
        compare_models(models("mlp:sgd"), str(tmp_path))


@pytest.mark.parametrize("edit, message", [
    (lambda d: {"x": d["x"]},
     "--data: no array 'y'; signature 'train' takes x float32 [None, 64], y int32 [None] (the data has: x)"),
    (lambda d: {**d, "x": d["x"][:, :32]},
     "--data: array 'x' has shape [64, 32]; signature 'serving_default' takes x float32 [None, 64]: "
     "give an array of shape [N, 64]"),
    (lambda d: {**d, "x": d["x"][:, :, None]},
     "--data: array 'x' has shape [64, 64, 1]; signature 'serving_default' takes x float32 [None, 64]"),
    (lambda d: {k: v[:10] for k, v in d.items()},
     "--data: array 'x' has 10 rows; signature 'serving_default' takes 32 per call (--batch-size 32): "
     "give at least 32 rows"),
    (lambda d: {**d, "y": d["y"][:40]},
     "--data: arrays have different numbers of rows (x 64, y 40); give one row per example in each"),
    (lambda d: {**d, "y": d["y"].astype(np.float64)},
     "--data: array 'y' holds float64; signature 'train' takes x float32 [None, 64], y int32 [None]: give y as int32"),
], ids=["missing", "features", "rank", "rows", "lengths", "dtype"])
def test_data_that_does_not_fit_is_named(models, rewritten, digits_batch, edit, message):
    with pytest.raises(InputError, match=re.escape(message)):
        compare_models(models("mlp:sgd"), rewritten("mlp:sgd", 2, 16), steps=2, batch=32, data=edit(digits_batch))


def test_data_is_fed_in_blocks_of_the_batch(models, rewritten, digits_batch):
    """Step k feeds the k-th block of ``batch`` rows; labels stored as int64 are accepted."""
    orig, out = models("mlp:sgd"), rewritten("mlp:sgd", 2, 16)
    data = {**digits_batch, "y": digits_batch["y"].astype(np.int64)}
    rep = compare_models(orig, out, steps=2, batch=32, data=data)
    assert rep.worst_param < 1e-5, rep.params
    later = {k: np.concatenate([v[:32], v[:32][::-1]]) for k, v in data.items()}  # other rows 32-63
    again = compare_models(orig, out, steps=2, batch=32, data=later)
    assert again.loss[0] == rep.loss[0] and again.loss[1] != rep.loss[1]
