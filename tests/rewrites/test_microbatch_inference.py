import numpy as np
import pytest
import tensorflow as tf


@pytest.mark.parametrize("n", [0, 1, 7, 8, 29])
def test_serving_in_slices_matches_original(models, rewritten, n):
    a = tf.saved_model.load(models("mlp:sgd"))
    b = tf.saved_model.load(rewritten("mlp:sgd", 4, 8))
    x = np.random.default_rng(n).normal(size=(n, 64)).astype("float32")
    ra = a.signatures["serving_default"](x=x)["logits"].numpy()
    rb = b.signatures["serving_default"](x=x)["logits"].numpy()
    assert ra.shape == rb.shape == (n, 10)
    np.testing.assert_allclose(rb, ra, rtol=1e-5, atol=1e-6)


def test_keras_export_serving(models, tmp_path):
    import vfgraph

    src = models("keras-export")
    out = vfgraph.save(vfgraph.rewrite(src, pipeline="microbatch-inference{vnode-batch=4}"), tmp_path / "o")
    a, b = tf.saved_model.load(src), tf.saved_model.load(out)
    x = np.random.default_rng(0).normal(size=(11, 64)).astype("float32")
    key = "serve" if "serve" in a.signatures else "serving_default"
    fa, fb = a.signatures[key], b.signatures[key]
    (name,) = fa.structured_input_signature[1]
    ra = list(fa(**{name: x}).values())[0].numpy()
    rb = list(fb(**{name: x}).values())[0].numpy()
    np.testing.assert_allclose(rb, ra, rtol=1e-5, atol=1e-6)
    meta = vfgraph.load(out).metadata
    assert key in meta["rewrites"]["microbatch-inference"]
