"""Export example models in the conventions vfgraph reads (a tf.Module with 'train' and
'serving_default' signatures), and the digits data set as .npz.

    python examples/export.py digits-mlp OUT_DIR [--optimizer sgd|momentum|adam|adamw|rmsprop|adagrad|manual]
    python examples/export.py digits-data OUT_DIR      # train.npz / test.npz from scikit-learn's digits
"""
from __future__ import annotations

import argparse
import os
from typing import Optional

os.environ.setdefault("TF_CPP_MIN_LOG_LEVEL", "2")
os.environ.setdefault("TF_ENABLE_ONEDNN_OPTS", "0")


def digits_data(out: str) -> None:
    import numpy as np
    from sklearn.datasets import load_digits

    x, y = load_digits(return_X_y=True)
    x = (x / 16.0).astype("float32")
    y = y.astype("int32")
    order = np.random.default_rng(0).permutation(len(x))
    x, y = x[order], y[order]
    os.makedirs(out, exist_ok=True)
    np.savez(os.path.join(out, "train.npz"), x=x[:1408], y=y[:1408])
    np.savez(os.path.join(out, "test.npz"), x=x[1408:], y=y[1408:])


def make_optimizer(name: str, lr: float):
    import keras

    return {
        "sgd": lambda: keras.optimizers.SGD(lr),
        "momentum": lambda: keras.optimizers.SGD(lr, momentum=0.9),
        "adam": lambda: keras.optimizers.Adam(lr),
        "adamw": lambda: keras.optimizers.AdamW(lr, weight_decay=0.01),
        "rmsprop": lambda: keras.optimizers.RMSprop(lr),
        "adagrad": lambda: keras.optimizers.Adagrad(lr),
    }[name]()


def build_module(model, input_specs, optimizer: str, lr: float, loss_fn):
    """A tf.Module whose 'train' signature takes a batch and applies one optimizer step."""
    import tensorflow as tf

    class Trainer(tf.Module):
        def __init__(self):
            super().__init__()
            self.model = model
            # Keras keeps some state (dropout seed generators) outside tf.Module tracking.
            self.model_variables = list(model.variables)
            self.manual = optimizer == "manual"
            if not self.manual:
                self.opt = make_optimizer(optimizer, lr)
                self.opt.build(self.model.trainable_variables)
            self.lr = lr

        @tf.function(input_signature=[input_specs])
        def train(self, batch):
            with tf.GradientTape() as tape:
                out = self.model(batch["x"], training=True)
                loss = loss_fn(batch["y"], out)
            grads = tape.gradient(loss, self.model.trainable_variables)
            if self.manual:
                for v, g in zip(self.model.trainable_variables, grads):
                    v.assign_sub(self.lr * g)
            else:
                self.opt.apply_gradients(zip(grads, self.model.trainable_variables))
            return {"loss": loss}

        @tf.function(input_signature=[input_specs["x"]])
        def serve(self, x):
            return {"logits": self.model(x, training=False)}

    return Trainer()


def sparse_ce(y, logits):
    import tensorflow as tf

    return tf.reduce_mean(tf.keras.losses.sparse_categorical_crossentropy(y, logits, from_logits=True))


def digits_mlp(out: str, optimizer: str = "sgd", lr: float = 0.1, hidden: int = 64,
               batch: Optional[int] = None) -> None:
    """``batch``: export with a static batch dimension instead of None."""
    import keras

    keras.utils.set_random_seed(0)
    model = keras.Sequential([keras.Input((64,)), keras.layers.Dense(hidden, activation="relu"),
                              keras.layers.Dense(10)])
    _digits_module(out, model, optimizer, lr, batch)


def resnet50(out: str, optimizer: str = "momentum", lr: float = 0.05, size: int = 64) -> None:
    """keras.applications.ResNet50 (weights=None) on size x size RGB images, 10 classes."""
    import keras
    import tensorflow as tf

    keras.utils.set_random_seed(0)
    model = keras.applications.ResNet50(weights=None, input_shape=(size, size, 3), classes=10,
                                        classifier_activation=None)
    specs = {"x": tf.TensorSpec([None, size, size, 3], tf.float32, name="x"),
             "y": tf.TensorSpec([None], tf.int32, name="y")}
    m = build_module(model, specs, optimizer, lr, sparse_ce)
    tf.saved_model.save(m, out, signatures={"train": m.train, "serving_default": m.serve})


def digits_cnn(out: str, optimizer: str = "momentum", lr: float = 0.05) -> None:
    """A small CNN with batch normalisation on 8x8 digit images."""
    import keras

    keras.utils.set_random_seed(0)
    model = keras.Sequential([
        keras.Input((64,)), keras.layers.Reshape((8, 8, 1)),
        keras.layers.Conv2D(8, 3, padding="same", use_bias=False), keras.layers.BatchNormalization(),
        keras.layers.ReLU(), keras.layers.MaxPooling2D(), keras.layers.Flatten(), keras.layers.Dense(10)])
    _digits_module(out, model, optimizer, lr)


def _digits_module(out: str, model, optimizer: str, lr: float, batch: Optional[int] = None) -> None:
    import tensorflow as tf

    specs = {"x": tf.TensorSpec([batch, 64], tf.float32, name="x"), "y": tf.TensorSpec([batch], tf.int32, name="y")}
    m = build_module(model, specs, optimizer, lr, sparse_ce)
    tf.saved_model.save(m, out, signatures={"train": m.train, "serving_default": m.serve})


def digits_embedding(out: str, optimizer: str = "adam", lr: float = 0.01) -> None:
    """Pixel intensities (0..16) as tokens through an Embedding: sparse gradients."""
    import keras

    keras.utils.set_random_seed(0)
    x = keras.Input((64,))
    tokens = keras.layers.Lambda(lambda v: keras.ops.cast(keras.ops.clip(keras.ops.round(v * 16.0), 0, 16), "int32"))(x)
    h = keras.layers.Embedding(17, 8)(tokens)
    h = keras.layers.GlobalAveragePooling1D()(h)
    _digits_module(out, keras.Model(x, keras.layers.Dense(10)(h)), optimizer, lr)


def digits_lstm(out: str, optimizer: str = "adam", lr: float = 0.01) -> None:
    """The 8 rows of each image as a sequence through an LSTM."""
    import keras

    keras.utils.set_random_seed(0)
    model = keras.Sequential([keras.Input((64,)), keras.layers.Reshape((8, 8)), keras.layers.LSTM(16),
                              keras.layers.Dense(10)])
    _digits_module(out, model, optimizer, lr)


def digits_transformer(out: str, optimizer: str = "adam", lr: float = 0.005) -> None:
    """A one-block Transformer encoder (MultiHeadAttention, LayerNormalization) over image rows."""
    import keras

    keras.utils.set_random_seed(0)
    x = keras.Input((64,))
    h = keras.layers.Dense(16)(keras.layers.Reshape((8, 8))(x))
    a = keras.layers.MultiHeadAttention(num_heads=2, key_dim=8)(h, h)
    h = keras.layers.LayerNormalization()(h + a)
    f = keras.layers.Dense(16)(keras.layers.Dense(32, activation="relu")(h))
    h = keras.layers.LayerNormalization()(h + f)
    h = keras.layers.GlobalAveragePooling1D()(h)
    _digits_module(out, keras.Model(x, keras.layers.Dense(10)(h)), optimizer, lr)


def digits_dropout(out: str, optimizer: str = "sgd", lr: float = 0.05) -> None:
    import keras

    keras.utils.set_random_seed(0)
    model = keras.Sequential([keras.Input((64,)), keras.layers.Dense(64, activation="relu"),
                              keras.layers.Dropout(0.5), keras.layers.Dense(10)])
    _digits_module(out, model, optimizer, lr)


def keras_export(out: str) -> None:
    """An inference-only model written by Keras 3's model.export()."""
    import keras

    keras.utils.set_random_seed(0)
    model = keras.Sequential([keras.Input((64,)), keras.layers.Dense(16, activation="relu"), keras.layers.Dense(10)])
    model.export(out, verbose=False)


def _tf1_graph(optimizer: str, lr: float, resource: bool):
    """A TF1 graph (tf.compat.v1): dense layer, batch norm whose moving averages are updated
    under control dependencies, a tf.compat.v1.train optimizer; ``resource`` picks resource
    or reference (TF1's default) variables. Returns (graph, tensors by role)."""
    import numpy as np
    import tensorflow as tf

    v1 = tf.compat.v1
    g = tf.Graph()
    with g.as_default():
        v1.set_random_seed(0)
        x = v1.placeholder(tf.float32, [None, 64], name="x")
        y = v1.placeholder(tf.int32, [None], name="y")

        def var(name, init, trainable=True):
            return v1.get_variable(name, initializer=init, trainable=trainable, use_resource=resource)

        w1 = var("w1", np.random.default_rng(0).normal(scale=0.1, size=(64, 32)).astype("float32"))
        gamma, beta = var("bn/gamma", tf.ones([32])), var("bn/beta", tf.zeros([32]))
        mmean = var("bn/moving_mean", tf.zeros([32]), trainable=False)
        mvar = var("bn/moving_variance", tf.ones([32]), trainable=False)
        w2 = var("w2", np.random.default_rng(1).normal(scale=0.1, size=(32, 10)).astype("float32"))
        b2 = var("b2", tf.zeros([10]))
        h = tf.matmul(x, w1)
        mean, variance = tf.nn.moments(h, [0])
        updates = [v1.assign_sub(mmean, (mmean - mean) * 0.1), v1.assign_sub(mvar, (mvar - variance) * 0.1)]
        for u in updates:
            v1.add_to_collection(v1.GraphKeys.UPDATE_OPS, u)
        logits = tf.matmul(tf.nn.relu(tf.nn.batch_normalization(h, mean, variance, beta, gamma, 1e-3)), w2) + b2
        loss = tf.reduce_mean(tf.nn.sparse_softmax_cross_entropy_with_logits(labels=y, logits=logits))
        step = v1.train.get_or_create_global_step()
        opt = {"sgd": lambda: v1.train.GradientDescentOptimizer(lr),
               "momentum": lambda: v1.train.MomentumOptimizer(lr, 0.9),
               "adam": lambda: v1.train.AdamOptimizer(lr / 10)}[optimizer]()
        with tf.control_dependencies(v1.get_collection(v1.GraphKeys.UPDATE_OPS)):
            train_op = opt.minimize(loss, global_step=step, name="train")
        v1.add_to_collection("train_op", train_op)
        with tf.control_dependencies([train_op]):
            loss_out = tf.identity(loss, name="loss")
        serve_h = tf.nn.batch_normalization(tf.matmul(x, w1), mmean, mvar, beta, gamma, 1e-3)
        serve = tf.identity(tf.matmul(tf.nn.relu(serve_h), w2) + b2, name="logits")
        init = v1.global_variables_initializer()
    return g, {"x": x, "y": y, "loss": loss_out, "logits": serve, "init": init}


def tf1_momentum_bn(out: str, optimizer: str = "momentum", lr: float = 0.05, resource: bool = True) -> None:
    """The TF1 graph saved with SavedModelBuilder: 'train' returns the loss after running
    the train op, 'serving_default' the logits; reference variables unless ``resource``."""
    import tensorflow as tf

    v1 = tf.compat.v1
    g, t = _tf1_graph(optimizer, lr, resource=resource)
    with g.as_default(), v1.Session(graph=g) as sess:
        sess.run(t["init"])
        b = v1.saved_model.Builder(out)
        sig = v1.saved_model.signature_def_utils.predict_signature_def
        b.add_meta_graph_and_variables(sess, ["serve"], signature_def_map={
            "train": sig({"x": t["x"], "y": t["y"]}, {"loss": t["loss"]}),
            "serving_default": sig({"x": t["x"]}, {"logits": t["logits"]})})
        b.save()


def tf1_checkpoint(out: str, optimizer: str = "momentum", lr: float = 0.05, resource: bool = False) -> str:
    """The TF1 graph as a TF1 training script leaves it: ``tf.compat.v1.train.Saver().save``
    writes OUT/model.meta (the MetaGraphDef with its train_op collection, no signatures) and
    the checkpoint beside it; reference variables unless ``resource``. Returns the .meta path."""
    import tensorflow as tf

    v1 = tf.compat.v1
    g, t = _tf1_graph(optimizer, lr, resource=resource)
    os.makedirs(out, exist_ok=True)
    with g.as_default(), v1.Session(graph=g) as sess:
        sess.run(t["init"])
        v1.train.Saver().save(sess, os.path.join(out, "model"))
    return os.path.join(out, "model.meta")


def tf1_serve_train(out: str, optimizer: str = "momentum", lr: float = 0.05, resource: bool = True,
                    ema: bool = False) -> None:
    """A TF1 SavedModel as TF1 training code exports it for serving and training: tags
    ``serve, train``; 'serving_default' (x -> logits, moving statistics) and 'train' whose only
    output is the loss, computed without the update; the update is the train op, stored in
    the ``train_op`` collection (``opt.minimize`` puts it there). Batch norm from
    ``tf.nn.moments``: its moving averages are assign ops run under control dependencies of
    ``opt.minimize``, or (``ema``) a ``tf.compat.v1.train.ExponentialMovingAverage`` of the
    moments grouped with it, ``tf.group(minimize, ema.apply(...))``, which SavedModel's
    ``saved_model_train_op`` collection holds (``train_op`` then holds the minimize op alone).
    Reference variables unless ``resource``."""
    import numpy as np
    import tensorflow as tf
    from tensorflow.python.saved_model import constants

    v1 = tf.compat.v1
    g = tf.Graph()
    with g.as_default(), v1.variable_scope(v1.get_variable_scope(), use_resource=resource):
        x = v1.placeholder(tf.float32, [None, 64], name="x")
        y = v1.placeholder(tf.int32, [None], name="y")
        w1 = v1.get_variable("w1", initializer=np.random.default_rng(0).normal(scale=0.1, size=(64, 32))
                             .astype("float32"))
        gamma = v1.get_variable("bn/gamma", initializer=tf.ones([32]))
        beta = v1.get_variable("bn/beta", initializer=tf.zeros([32]))
        w2 = v1.get_variable("w2", initializer=np.random.default_rng(1).normal(scale=0.1, size=(32, 10))
                             .astype("float32"))
        b2 = v1.get_variable("b2", initializer=tf.zeros([10]))
        h = tf.matmul(x, w1)
        mean, variance = tf.nn.moments(h, [0])
        logits = tf.matmul(tf.nn.relu(tf.nn.batch_normalization(h, mean, variance, beta, gamma, 1e-3)), w2) + b2
        loss = tf.reduce_mean(tf.nn.sparse_softmax_cross_entropy_with_logits(labels=y, logits=logits), name="loss")
        step = v1.train.get_or_create_global_step()
        opt = {"sgd": lambda: v1.train.GradientDescentOptimizer(lr),
               "momentum": lambda: v1.train.MomentumOptimizer(lr, 0.9),
               "adam": lambda: v1.train.AdamOptimizer(lr / 10)}[optimizer]()
        if ema:
            averages = v1.train.ExponentialMovingAverage(0.9, name="bn_moving")
            apply = averages.apply([mean, variance])
            train_op = tf.group(opt.minimize(loss, global_step=step), apply, name="train")
            v1.add_to_collection(constants.TRAIN_OP_KEY, train_op)
            mmean, mvar = averages.average(mean), averages.average(variance)
        else:
            mmean = v1.get_variable("bn/moving_mean", initializer=tf.zeros([32]), trainable=False)
            mvar = v1.get_variable("bn/moving_variance", initializer=tf.ones([32]), trainable=False)
            for avg, value in ((mmean, mean), (mvar, variance)):
                v1.add_to_collection(v1.GraphKeys.UPDATE_OPS, v1.assign_sub(avg, (avg - value) * 0.1))
            with tf.control_dependencies(v1.get_collection(v1.GraphKeys.UPDATE_OPS)):
                opt.minimize(loss, global_step=step, name="train")  # minimize adds it to GraphKeys.TRAIN_OP
        serve_h = tf.nn.batch_normalization(tf.matmul(x, w1), mmean, mvar, beta, gamma, 1e-3)
        serve = tf.identity(tf.matmul(tf.nn.relu(serve_h), w2) + b2, name="logits")
        init = v1.global_variables_initializer()
    with g.as_default(), v1.Session(graph=g) as sess:
        sess.run(init)
        b = v1.saved_model.Builder(out)
        sig = v1.saved_model.signature_def_utils.predict_signature_def
        tags = [v1.saved_model.tag_constants.SERVING, v1.saved_model.tag_constants.TRAINING]
        b.add_meta_graph_and_variables(sess, tags,
                                       signature_def_map={"train": sig({"x": x, "y": y}, {"loss": loss}),
                                                          "serving_default": sig({"x": x}, {"logits": serve})},
                                       saver=v1.train.Saver(), strip_default_attrs=True)
        b.save()


MODELS = {"digits-mlp": digits_mlp, "digits-cnn": digits_cnn, "digits-embedding": digits_embedding,
          "digits-lstm": digits_lstm, "digits-transformer": digits_transformer, "digits-dropout": digits_dropout,
          "tf1-bn": tf1_momentum_bn, "tf1-checkpoint": tf1_checkpoint, "tf1-serve-train": tf1_serve_train,
          "resnet50": resnet50}


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("what", choices=sorted(MODELS) + ["digits-data", "keras-export"])
    p.add_argument("out")
    p.add_argument("--optimizer", default=None,
                   choices=["sgd", "momentum", "adam", "adamw", "rmsprop", "adagrad", "manual"])
    p.add_argument("--lr", type=float, default=None)
    a = p.parse_args()
    if a.what == "digits-data":
        digits_data(a.out)
    elif a.what == "keras-export":
        keras_export(a.out)
    else:
        kw = {k: v for k, v in (("optimizer", a.optimizer), ("lr", a.lr)) if v is not None}
        MODELS[a.what](a.out, **kw)
    print(f"wrote {a.out}")


if __name__ == "__main__":
    main()

