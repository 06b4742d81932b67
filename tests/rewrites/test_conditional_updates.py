"""Updates applied under a condition train at any number of virtual nodes: the virtual nodes'
gradients are averaged before the step's condition and its update, which run once per step on
the batch's gradient (a loss-scale optimizer's unscaling, finite check and scale update, Keras'
gradient accumulation counter and apply, a condition on the gradients' norm). A condition on a
value of the batch that is not a gradient is refused, naming the conditional. Rows summed into
a tensor sized from the batch (the gradient of a gather from activations, as in keras-hub's
DeBERTa-V3) are per-example work, and what precedes them trains."""
import numpy as np
import pytest

import vfgraph
from vfgraph.errors import VfgraphError
from vfgraph.testing.compare import compare_models
from vfgraph.testing.steps import save_step

from test_training_semantics import assert_same_training, data, export


def export_loss_scaled(path, policy="float32", inner="sgd", embedding=False, loss="mean"):
    """The small MLP trained through Keras' LossScaleOptimizer under ``policy``, wrapping SGD
    (``inner="sgd"``) or Adam with a global-norm clip (``"adam_clipped"``: every gradient reaches
    every variable's update); its scale doubles after every 2 finite steps. ``embedding``: the
    features are 8 token ids, embedded and averaged (a sparse gradient, applied in the branch).
    ``loss``: the examples' losses reduced by their "mean" or "sum"."""
    import keras
    import tensorflow as tf

    keras.mixed_precision.set_global_policy(policy)
    try:
        keras.utils.set_random_seed(0)
        first = ([keras.Input((8,), dtype="int32"), keras.layers.Embedding(20, 16),
                  keras.layers.GlobalAveragePooling1D()] if embedding
                 else [keras.Input((8,)), keras.layers.Dense(16, activation="tanh")])
        model = keras.Sequential(first + [keras.layers.Dense(10, dtype="float32")])
        wrapped = keras.optimizers.SGD(0.3) if inner == "sgd" else keras.optimizers.Adam(0.01, global_clipnorm=0.5)
        opt = keras.optimizers.LossScaleOptimizer(wrapped, initial_scale=2.0 ** 8, dynamic_growth_steps=2)
        opt.build(model.trainable_variables)
    finally:
        keras.mixed_precision.set_global_policy("float32")
    specs = {"x": tf.TensorSpec([None, 8], tf.int32 if embedding else tf.float32),
             "y": tf.TensorSpec([None], tf.int32)}

    def train(batch):
        with tf.GradientTape() as tape:
            logits = model(batch["x"], training=True)
            value = (tf.reduce_sum if loss == "sum" else tf.reduce_mean)(
                keras.losses.sparse_categorical_crossentropy(batch["y"], logits, from_logits=True))
            scaled = opt.scale_loss(value)
        grads = tape.gradient(scaled, model.trainable_variables)
        opt.apply_gradients(zip(grads, model.trainable_variables))
        return {"loss": value}

    return save_step(path, train, specs, list(model.variables) + list(opt.variables), (model, opt),
                     lambda x: {"logits": model(x, training=False)}, specs["x"])


def export_conditional_sgd(path, condition):
    """Plain SGD applied under ``tf.cond``: when the gradients' global norm is below a bound
    (``condition="gradient_norm"``), when the batch's largest feature is (``"batch_max"``), or
    when any feature is above it (``"batch_any"``)."""
    import keras
    import tensorflow as tf

    keras.utils.set_random_seed(0)
    model = keras.Sequential([keras.Input((8,)), keras.layers.Dense(16, activation="tanh"), keras.layers.Dense(10)])
    specs = {"x": tf.TensorSpec([None, 8], tf.float32), "y": tf.TensorSpec([None], tf.int32)}

    def train(batch):
        params = model.trainable_variables
        with tf.GradientTape() as tape:
            logits = model(batch["x"], training=True)
            value = tf.reduce_mean(keras.losses.sparse_categorical_crossentropy(batch["y"], logits,
                                                                                from_logits=True))
        grads = tape.gradient(value, params)
        if condition == "gradient_norm":  # on data()'s batches: steps 1 and 3 apply, step 2 does not
            ok = tf.linalg.global_norm(grads) < 0.789
        elif condition == "batch_max":
            ok = tf.reduce_max(batch["x"]) < 2.5
        else:  # "batch_any"
            ok = tf.reduce_any(batch["x"] > 2.5)

        def apply():
            for p, g in zip(params, grads):
                p.assign_sub(0.3 * g)
            return tf.constant(1.0)

        applied = tf.cond(ok, apply, lambda: tf.constant(0.0))
        return {"loss": value, "applied": applied}

    return save_step(path, train, specs, model.variables, (model,),
                     lambda x: {"logits": model(x, training=False)}, specs["x"])


def _trained(path, steps, batch=16):
    """The train signature's variables after ``steps`` steps on data()'s batches."""
    import tensorflow as tf

    loaded = tf.saved_model.load(path)  # (kept alive while its function runs)
    fn = loaded.signatures["train"]
    feed = data(max(steps, 1) * batch)
    for s in range(steps):
        fn(**{k: tf.constant(feed[k][s * batch:(s + 1) * batch]) for k in ("batch", "batch_1")})
    return {v.name: v.numpy() for v in fn.variables}


@pytest.mark.parametrize("inner", ["sgd", "adam_clipped"])
def test_loss_scale_optimizer_trains_with_one_scale_update_per_step(inner, tmp_path):
    """Each cut gradient is matched to its own variable (and Adam's slots of it) inside the
    conditional; V=1 and V=4 train as the original (the scale is compared with the parameters)."""
    from vfgraph.analysis.train_step import analyze_train_step
    from vfgraph.ir.graph import FunctionGraph

    original = export_loss_scaled(tmp_path / inner, inner=inner)
    item = vfgraph.load(original)
    sig = item.signatures["train"]
    step = analyze_train_step(FunctionGraph.over(item.function(sig.function), item.library), sig)
    names = sorted(sig.variables[c.variable].name for c in step.cut if c.role == "gradient")
    assert len(step.cut) == 4 and names == sorted(sig.variables[r].name for r in step.trainable), step.cut
    assert len(set(names)) == 4 and all(n.endswith(("kernel", "bias")) for n in names), names
    assert_same_training(original, tmp_path, inner)


@pytest.mark.parametrize("loss", ["mean", "sum"])
def test_loss_scale_optimizer_with_an_embedding(loss, tmp_path):
    """The embedding's rows and indices go into the conditional apply: they are cut as a sparse
    gradient (rows concatenated over virtual nodes, scaled by 1 / V for a mean loss only) and
    the finite check reads them."""
    original = export_loss_scaled(tmp_path / f"embedded_{loss}", embedding=True, loss=loss)
    _same_training_on_random_batches(original, tmp_path, f"embedded_{loss}")


def test_loss_scale_optimizer_under_mixed_float16(tmp_path):
    """V=1 is the original step; at V=4 each virtual node rounds its own float16 gradient sums,
    so the parameters agree within float16's rounding (the original's own float16 sums are
    rounded as much), and the scale advances once per step exactly as the original's."""
    original = export_loss_scaled(tmp_path / "mixed", "mixed_float16")
    for vnodes, within in ((1, 0.0), (4, 2e-3)):
        out = str(tmp_path / f"mixed_v{vnodes}")
        vfgraph.save(vfgraph.rewrite(original, vnodes=vnodes, allreduce="none"), out)
        rep = compare_models(original, out, steps=3, batch=16, data=data(48))
        assert not rep.nonfinite and rep.worst_param <= within, (vnodes, rep.params)
        scale = next(k for k in rep.params if k.endswith("/dynamic_scale:0"))  # (Keras numbers the names)
        assert rep.params[scale] == 0.0, vnodes
    after = _trained(out, steps=3)
    counter = next(k for k in after if k.endswith("/step_counter:0"))
    assert after[scale] == 2.0 ** 9 and after[counter] == 1, after


def test_keras_gradient_accumulation_over_four_steps(tmp_path):
    """Keras' gradient_accumulation_steps=2 applies every second step the mean of two steps'
    gradients: V=1 equals the original and V=4 the full-batch step, over two applies."""
    original = export(tmp_path / "accumulating", gradient_accumulation_steps=2)
    for vnodes in (1, 4):
        out = str(tmp_path / f"accumulating_v{vnodes}")
        vfgraph.save(vfgraph.rewrite(original, vnodes=vnodes, allreduce="none"), out)
        rep = compare_models(original, out, steps=4, batch=16, data=data(64))
        assert not rep.nonfinite and rep.worst_param < 2e-5, (vnodes, rep.params)
        for step, a, b in rep.loss:
            assert b == pytest.approx(a, rel=1e-5), (vnodes, step)
    before, after = _trained(original, steps=0), _trained(out, steps=4)
    kernel = sorted(k for k in after if k.endswith("kernel:0"))[0]
    assert np.abs(after[kernel] - before[kernel]).max() > 1e-3  # it did train


def test_a_condition_on_the_gradients_trains(tmp_path):
    assert_same_training(export_conditional_sgd(tmp_path / "norm", "gradient_norm"), tmp_path, "norm")


@pytest.mark.parametrize("condition, message", [
    ("batch_max", r"the update 'cond' \(If\) runs under a condition computed from .*Max.*not a gradient"),
    ("batch_any", r"the update 'cond' \(If\) runs on values of the batch that cannot be averaged .*Any.*"
                  r"not from the gradients")])
def test_a_condition_on_the_batch_values_is_refused_naming_it(condition, message, tmp_path):
    path = export_conditional_sgd(tmp_path / condition, condition)
    with pytest.raises(VfgraphError, match=message):
        vfgraph.rewrite(path, vnodes=4, allreduce="none")


def _same_training_on_random_batches(original, tmp_path, name):
    """As assert_same_training, on compare_models' seeded random batches (integer inputs in [0, 10))."""
    for vnodes in (1, 4):
        out = str(tmp_path / f"{name}_v{vnodes}")
        vfgraph.save(vfgraph.rewrite(original, vnodes=vnodes, allreduce="none"), out)
        rep = compare_models(original, out, steps=3, batch=16)
        assert not rep.nonfinite and rep.worst_param < 2e-5, (name, vnodes, rep.params)
        for step, a, b in rep.loss:
            assert b == pytest.approx(a, rel=1e-5), (name, vnodes, step)


def export_gathering(path, construct):
    """Token embeddings, layer-normalized, then per-example work whose gradient sums rows into a
    tensor sized from the batch (a gather from the activations by per-example positions, or
    per-example segment sums over the batch), then a dense layer and a mean-pooled classifier."""
    import keras
    import tensorflow as tf

    keras.utils.set_random_seed(0)
    layers = [keras.layers.Embedding(20, 16), keras.layers.LayerNormalization(),
              keras.layers.Dense(16, activation="tanh"), keras.layers.Dense(10)]
    embed, norm, dense, head = layers
    head(dense(norm(embed(tf.zeros([2, 8], tf.int32)))))
    params = [v for layer in layers for v in layer.trainable_variables]
    opt = keras.optimizers.SGD(0.3)
    opt.build(params)
    specs = {"x": tf.TensorSpec([None, 8], tf.int32), "y": tf.TensorSpec([None], tf.int32)}

    def forward(x):
        h = norm(embed(x))  # [batch, 8, 16]
        where = tf.math.floormod(x[:, ::-1], 8)  # per-example positions
        if construct == "gather_batch_dims":
            h = tf.gather(h, where, axis=1, batch_dims=1)
        elif construct == "take_along_axis":
            h = keras.ops.take_along_axis(h, where[:, :, None] * tf.ones([1, 1, 16], tf.int32), axis=1)
        else:  # "segment_sum": each example's sum over its positions, added back to them
            size = tf.shape(h)[0]
            pooled = tf.math.unsorted_segment_sum(tf.reshape(h, [-1, 16]), tf.repeat(tf.range(size), 8), size)
            h = h + pooled[:, None, :] / 8.0
        return head(tf.reduce_mean(dense(h), axis=1))

    def train(batch):
        with tf.GradientTape() as tape:
            value = tf.reduce_mean(keras.losses.sparse_categorical_crossentropy(
                batch["y"], forward(batch["x"]), from_logits=True))
        opt.apply_gradients(zip(tape.gradient(value, params), params))
        return {"loss": value}

    return save_step(path, train, specs, [v for layer in layers for v in layer.variables], (*layers, opt))


def export_deberta(path):
    """A tiny keras-hub DeBERTa-V3 backbone (its relative-position attention gathers from
    activations) with a classifier on the first token."""
    import keras
    import keras_hub
    import tensorflow as tf

    keras.utils.set_random_seed(0)
    backbone = keras_hub.models.DebertaV3Backbone(vocabulary_size=100, num_layers=1, num_heads=2, hidden_dim=16,
                                                  intermediate_dim=32, dropout=0.0, max_sequence_length=8,
                                                  bucket_size=4)
    head = keras.layers.Dense(10)
    specs = {"token_ids": tf.TensorSpec([None, 8], tf.int32), "padding_mask": tf.TensorSpec([None, 8], tf.int32),
             "label": tf.TensorSpec([None], tf.int32)}
    inputs = lambda batch: {k: batch[k] for k in ("token_ids", "padding_mask")}  # noqa: E731
    head(backbone(inputs({k: tf.ones([2, 8], tf.int32) for k in specs}))[:, 0])
    params = backbone.trainable_variables + head.trainable_variables
    opt = keras.optimizers.SGD(0.1)
    opt.build(params)

    def train(batch):
        with tf.GradientTape() as tape:
            logits = head(backbone(inputs(batch), training=True)[:, 0])
            value = tf.reduce_mean(keras.losses.sparse_categorical_crossentropy(batch["label"], logits,
                                                                                from_logits=True))
        opt.apply_gradients(zip(tape.gradient(value, params), params))
        return {"loss": value}

    return save_step(path, train, specs, list(backbone.variables) + list(head.variables), (backbone, head, opt))


@pytest.mark.parametrize("construct", ["gather_batch_dims", "take_along_axis", "segment_sum"])
def test_rows_summed_into_a_batch_sized_tensor_are_per_example_work(construct, tmp_path):
    """The gradient of a gather from activations sums rows into a tensor whose size is read from
    the batch: per-example work, not a variable's sparse gradient, so the layer normalization
    and embeddings before it train (they were refused: no cut behind a sparse gradient)."""
    _same_training_on_random_batches(export_gathering(tmp_path / construct, construct), tmp_path, construct)


def test_keras_hub_deberta_trains(tmp_path):
    _same_training_on_random_batches(export_deberta(tmp_path / "deberta"), tmp_path, "deberta")
