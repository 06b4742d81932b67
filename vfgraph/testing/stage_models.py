"""Small training steps of the constructs a pipeline cut must carry: plain ``tf.Module`` steps
(raw ``assign_sub``; a hand-written momentum with slot variables), a step that updates
non-trainable state, a parameter-free middle that makes a stage with no variable, a
bidirectional LSTM, L2 kernel regularizers, a layer applied twice (shared weights),
``tf.recompute_grad`` and global-norm clipping. Each ``build(path)`` writes a SavedModel whose
``train`` signature takes ``{"x": float32 [N, FEATURES], "labels": int32 [N]}`` (labels in
[0, CLASSES)), runs one step and returns ``{"loss": ...}``; ``serving_default`` takes ``x``.

    python -m vfgraph.testing.stage_models NAME OUT_DIR
"""
from __future__ import annotations

import os
import sys
from typing import Callable, Dict, List

from vfgraph.testing.steps import save_step

FEATURES = 8   # input features
CLASSES = 10   # labels are in [0, CLASSES): vfgraph.testing.compare.make_inputs' integers
HIDDEN = 16
LR = 0.05


def _specs():
    import tensorflow as tf

    return ({"x": tf.TensorSpec([None, FEATURES], tf.float32, name="x"),
             "labels": tf.TensorSpec([None], tf.int32, name="labels")},
            tf.TensorSpec([None, FEATURES], tf.float32, name="x"))


def _ce(labels, logits):
    import tensorflow as tf

    return tf.reduce_mean(tf.nn.sparse_softmax_cross_entropy_with_logits(labels=labels, logits=logits))


def _weights(shapes: List[tuple], seed: int = 0) -> list:
    """tf.Variables of ``shapes``, seeded normal (biases, of rank 1, at zero)."""
    import numpy as np
    import tensorflow as tf

    rng = np.random.default_rng(seed)
    return [tf.Variable((rng.normal(size=s) / np.sqrt(s[0])).astype("float32") if len(s) > 1
                        else np.zeros(s, "float32"), name=f"w{i}") for i, s in enumerate(shapes)]


def _mlp_vars():
    return _weights([(FEATURES, HIDDEN), (HIDDEN,), (HIDDEN, CLASSES), (CLASSES,)])


def _mlp(vs, x):
    import tensorflow as tf

    w1, b1, w2, b2 = vs
    return tf.matmul(tf.nn.relu(tf.matmul(x, w1) + b1), w2) + b2


def module_assign_sub(path: str) -> str:
    """A tf.Module step: gradients from a GradientTape, each variable updated with
    ``assign_sub`` (no optimizer object)."""
    import tensorflow as tf

    vs = _mlp_vars()
    spec, serve_spec = _specs()

    def train(batch):
        with tf.GradientTape() as tape:
            loss = _ce(batch["labels"], _mlp(vs, batch["x"]))
        for v, g in zip(vs, tape.gradient(loss, vs)):
            v.assign_sub(LR * g)
        return {"loss": loss}

    return save_step(path, train, spec, vs, serve=lambda x: {"logits": _mlp(vs, x)}, serve_spec=serve_spec)


def module_momentum(path: str) -> str:
    """A tf.Module step with a hand-written momentum: a slot variable per parameter."""
    import tensorflow as tf

    vs = _mlp_vars()
    slots = [tf.Variable(tf.zeros_like(v), name=f"slot{i}") for i, v in enumerate(vs)]
    spec, serve_spec = _specs()

    def train(batch):
        with tf.GradientTape() as tape:
            loss = _ce(batch["labels"], _mlp(vs, batch["x"]))
        for v, m, g in zip(vs, slots, tape.gradient(loss, vs)):
            m.assign(0.9 * m + g)
            v.assign_sub(LR * m)
        return {"loss": loss}

    return save_step(path, train, spec, vs + slots, serve=lambda x: {"logits": _mlp(vs, x)}, serve_spec=serve_spec)


def nontrainable_state(path: str) -> str:
    """A step that also updates state no gradient reaches: a count of the examples seen and a
    running mean of the inputs (as a normalization layer's statistics)."""
    import tensorflow as tf

    vs = _mlp_vars()
    seen = tf.Variable(0.0, trainable=False, name="seen")
    mean = tf.Variable(tf.zeros([FEATURES]), trainable=False, name="input_mean")
    spec, serve_spec = _specs()

    def train(batch):
        x = batch["x"]
        mean.assign(0.9 * mean + 0.1 * tf.reduce_mean(x, 0))
        seen.assign_add(tf.cast(tf.shape(x)[0], tf.float32))
        with tf.GradientTape() as tape:
            loss = _ce(batch["labels"], _mlp(vs, x - tf.stop_gradient(mean)))
        for v, g in zip(vs, tape.gradient(loss, vs)):
            v.assign_sub(LR * g)
        return {"loss": loss}

    return save_step(path, train, spec, vs + [seen, mean], serve=lambda x: {"logits": _mlp(vs, x - mean)},
                     serve_spec=serve_spec)


def _keras_step(path: str, model, optimizer=None, clip_global_norm: float = 0.0, extra_loss=None) -> str:
    """``model`` (Keras) trained by ``optimizer`` (default SGD) on the cross-entropy plus the
    model's own losses (regularizers), gradients clipped to ``clip_global_norm`` when given."""
    import keras
    import tensorflow as tf

    opt = optimizer or keras.optimizers.SGD(LR)
    opt.build(model.trainable_variables)
    spec, serve_spec = _specs()

    def train(batch):
        with tf.GradientTape() as tape:
            loss = _ce(batch["labels"], model(batch["x"], training=True))
            if model.losses:
                loss = loss + tf.add_n(model.losses)
        grads = tape.gradient(loss, model.trainable_variables)
        if clip_global_norm:
            grads, _ = tf.clip_by_global_norm(grads, clip_global_norm)
        opt.apply_gradients(zip(grads, model.trainable_variables))
        return {"loss": loss}

    return save_step(path, train, spec, model.variables, (model, opt),
                     serve=lambda x: {"logits": model(x, training=False)}, serve_spec=serve_spec)


def stateless_stage(path: str) -> str:
    """Dense, a long parameter-free middle (activations, a parameter-free layer norm), Dense:
    cut at the middle's first and last ops (:data:`SPLITS`), the middle stage holds no variable."""
    import keras

    keras.utils.set_random_seed(0)
    x = keras.Input((FEATURES,))
    h = keras.layers.Dense(HIDDEN, activation="tanh", name="first")(x)
    h = keras.layers.Activation("sigmoid", name="free_a")(h)
    h = keras.layers.LayerNormalization(center=False, scale=False, name="free_norm")(h)
    h = keras.layers.Activation("softplus", name="free_b")(h)
    out = keras.layers.Dense(CLASSES, name="last")(h)
    return _keras_step(path, keras.Model(x, out))


def bilstm(path: str) -> str:
    """The features as a sequence of 4 steps of 2 through a bidirectional LSTM, then Dense."""
    import keras

    keras.utils.set_random_seed(0)
    model = keras.Sequential([keras.Input((FEATURES,)), keras.layers.Reshape((4, 2)),
                              keras.layers.Bidirectional(keras.layers.LSTM(8)), keras.layers.Dense(CLASSES)])
    return _keras_step(path, model)


def l2_regularized(path: str) -> str:
    """Three Dense layers with L2 kernel regularizers (the penalty added to the loss)."""
    import keras

    keras.utils.set_random_seed(0)
    reg = keras.regularizers.L2(0.01)
    model = keras.Sequential([keras.Input((FEATURES,)),
                              keras.layers.Dense(HIDDEN, activation="relu", kernel_regularizer=reg),
                              keras.layers.Dense(HIDDEN, activation="relu", kernel_regularizer=reg),
                              keras.layers.Dense(CLASSES, kernel_regularizer=reg)])
    return _keras_step(path, model)


def shared_layer(path: str) -> str:
    """One Dense layer applied twice, at the start and near the end (weights read by both ends
    of the step)."""
    import keras

    keras.utils.set_random_seed(0)
    shared = keras.layers.Dense(FEATURES, activation="tanh", name="shared")
    x = keras.Input((FEATURES,))
    h = shared(x)
    h = keras.layers.Dense(FEATURES, activation="relu", name="middle")(h)
    h = shared(h)
    return _keras_step(path, keras.Model(x, keras.layers.Dense(CLASSES, name="head")(h)))


def recompute(path: str) -> str:
    """A block under ``tf.recompute_grad`` (its activations recomputed in the backward)."""
    import tensorflow as tf

    vs = _weights([(FEATURES, HIDDEN), (HIDDEN, HIDDEN), (HIDDEN, CLASSES)])
    spec, serve_spec = _specs()

    @tf.recompute_grad
    def block(h):
        return tf.nn.relu(tf.matmul(tf.nn.relu(tf.matmul(h, vs[0])), vs[1]))

    def train(batch):
        with tf.GradientTape() as tape:
            loss = _ce(batch["labels"], tf.matmul(block(batch["x"]), vs[2]))
        for v, g in zip(vs, tape.gradient(loss, vs)):
            v.assign_sub(LR * g)
        return {"loss": loss}

    class Step(tf.Module):  # (save_step's, saved without the custom gradient, which TensorFlow cannot trace)
        def __init__(self):
            super().__init__()
            self.model_variables = vs

    module = Step()
    module.train = tf.function(train, input_signature=[spec])
    module.serve = tf.function(lambda x: {"logits": tf.matmul(block(x), vs[2])}, input_signature=[serve_spec])
    tf.saved_model.save(module, path, signatures={"train": module.train, "serving_default": module.serve},
                        options=tf.saved_model.SaveOptions(experimental_custom_gradients=False))
    return path


def global_clip(path: str) -> str:
    """Three Dense layers trained with momentum, gradients clipped by their global norm."""
    import keras

    keras.utils.set_random_seed(0)
    model = keras.Sequential([keras.Input((FEATURES,)), keras.layers.Dense(HIDDEN, activation="relu"),
                              keras.layers.Dense(HIDDEN, activation="relu"), keras.layers.Dense(CLASSES)])
    return _keras_step(path, model, keras.optimizers.SGD(LR, momentum=0.9), clip_global_norm=0.5)


MODELS: Dict[str, Callable[[str], str]] = {
    "module-assign-sub": module_assign_sub,
    "module-momentum": module_momentum,
    "nontrainable-state": nontrainable_state,
    "stateless-stage": stateless_stage,
    "bilstm": bilstm,
    "l2": l2_regularized,
    "shared-layer": shared_layer,
    "recompute-grad": recompute,
    "global-clip": global_clip,
}


def main() -> None:
    if len(sys.argv) != 3 or sys.argv[1] not in MODELS:
        sys.exit(f"usage: python -m vfgraph.testing.stage_models {{{','.join(MODELS)}}} OUT_DIR")
    os.environ.setdefault("TF_CPP_MIN_LOG_LEVEL", "2")
    print(f"wrote {MODELS[sys.argv[1]](sys.argv[2])}")


if __name__ == "__main__":
    main()
