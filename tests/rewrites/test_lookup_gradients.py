"""Gradients of lookups and of dense layers over sequences keep their meaning at any number of
virtual nodes: a token table's rows (a sparse gradient) clipped by value run the clip once on
the batch's rows; a position table read through a slice (a gradient of another shape than its
variable) is summed for a loss summed over the batch; a global norm clip over gradients whose
static shape the export lost (a Tensordot's) runs once on the batch's gradient. V=1 equals the
original step, V=4 the full-batch step."""
import numpy as np
import pytest

from test_training_semantics import assert_same_training
from vfgraph.testing.steps import save_step

SEQ, VOCAB = 6, 20


def export(path, loss: str, **options):
    """Token and position embeddings (the positions a slice of a longer table), mean-pooled,
    a classifier; SGD with ``options``; the loss a mean or a sum over the batch."""
    import keras
    import tensorflow as tf

    keras.utils.set_random_seed(0)

    class Embed(keras.layers.Layer):
        def build(self, shape):
            self.tokens = self.add_weight(shape=(VOCAB, 8), initializer="normal", name="tokens")
            self.positions = self.add_weight(shape=(2 * SEQ, 8), initializer="normal", name="positions")

        def call(self, ids):
            return tf.gather(self.tokens, ids) + self.positions[:tf.shape(ids)[1]]

    ids = keras.Input((None,), dtype="int32")  # (sequences of any length)
    hidden = keras.layers.Dense(8, activation="tanh")(Embed()(ids))  # (a Tensordot: gradients of unknown shape)
    logits = keras.layers.Dense(4)(keras.layers.GlobalAveragePooling1D()(hidden))
    model = keras.Model(ids, logits)
    specs = {"x": tf.TensorSpec([None, None], tf.int32), "y": tf.TensorSpec([None], tf.int32)}
    opt = keras.optimizers.SGD(0.5, momentum=0.9, **options)
    opt.build(model.trainable_variables)
    reduce = tf.reduce_sum if loss == "sum" else tf.reduce_mean

    def train(batch):
        with tf.GradientTape() as tape:
            value = reduce(keras.losses.sparse_categorical_crossentropy(
                batch["y"], model(batch["x"], training=True), from_logits=True))
        grads = tape.gradient(value, model.trainable_variables)
        opt.apply_gradients(zip(grads, model.trainable_variables))
        return {"loss": value}

    return save_step(path, train, specs, model.variables, (model, opt),
                     lambda x: {"logits": model(x, training=False)}, specs["x"])


def data(n):
    rng = np.random.default_rng(2)
    x = rng.integers(0, VOCAB, (n, SEQ)).astype(np.int32)
    return {"batch": x, "batch_1": rng.integers(0, 4, n).astype(np.int32), "x": x}


@pytest.mark.parametrize("loss, options", [("mean", dict(clipvalue=0.002)), ("sum", {}),
                                           ("sum", dict(clipvalue=0.01)), ("mean", dict(global_clipnorm=0.05)),
                                           ("sum", dict(global_clipnorm=0.5))])
def test_lookup_gradients_keep_their_meaning(loss, options, tmp_path):
    name = f"{loss}_{'_'.join(options) or 'plain'}"
    assert_same_training(export(tmp_path / name, loss, **options), tmp_path, name, make_data=data, tol=1e-4)
