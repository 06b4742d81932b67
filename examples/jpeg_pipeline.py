"""An image pipeline from JPEG-in-TFRecord: the data and the model of examples/jpeg.sh.

    python examples/jpeg_pipeline.py data OUT_DIR    # JPEG digits in TFRecord shards, and test.npz
    python examples/jpeg_pipeline.py model OUT_DIR   # a small CNN on 28x28x1 images

``data`` writes scikit-learn's 8x8 digits, upscaled to 32x32 grey JPEG images, as
``tf.train.Example`` records with a bytes feature ``image`` (the JPEG file) and an int64 feature
``label``, in 4 TFRecord shards ``train-0000S-of-00004.tfrecord`` (1,400 images), and the other
397 as ``test.npz`` (``x``: their 28x28 centre crops, as examples/jpeg_input.py decodes them,
``y``: the labels) for ``vfgraph train --eval-data``. The records hold files, not the model's
inputs: ``vfgraph train --input-fn examples/jpeg_input.py:decode`` decodes them.
"""
from __future__ import annotations

import argparse
import os
import sys

os.environ.setdefault("TF_CPP_MIN_LOG_LEVEL", "2")
os.environ.setdefault("TF_ENABLE_ONEDNN_OPTS", "0")
sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))

SIZE, CROP, TRAIN, SHARDS = 32, 28, 1400, 4


def jpegs(images) -> list:
    """Each uint8 image (SIZE x SIZE) as a JPEG file's bytes."""
    import tensorflow as tf

    return [tf.io.encode_jpeg(img[:, :, None], quality=90).numpy() for img in images]


def digit_images():
    """The digits, shuffled, as SIZE x SIZE uint8 images (bilinear upscaling), and their labels."""
    import numpy as np
    import tensorflow as tf
    from sklearn.datasets import load_digits

    x, y = load_digits(return_X_y=True)
    order = np.random.default_rng(0).permutation(len(x))
    x, y = x[order].reshape(-1, 8, 8, 1) * (255 / 16), y[order]
    big = tf.image.resize(x.astype("float32"), (SIZE, SIZE), method="bilinear").numpy()
    return np.clip(np.round(big[..., 0]), 0, 255).astype(np.uint8), y.astype(np.int64)


def write_data(out: str) -> None:
    import numpy as np
    import tensorflow as tf

    from jpeg_input import centre

    images, labels = digit_images()
    files = jpegs(images)
    os.makedirs(out, exist_ok=True)
    for s, part in enumerate(np.array_split(np.arange(TRAIN), SHARDS)):
        with tf.io.TFRecordWriter(os.path.join(out, f"train-{s:05d}-of-{SHARDS:05d}.tfrecord")) as w:
            for i in part:
                feature = {"image": tf.train.Feature(bytes_list=tf.train.BytesList(value=[files[i]])),
                           "label": tf.train.Feature(int64_list=tf.train.Int64List(value=[labels[i]]))}
                w.write(tf.train.Example(features=tf.train.Features(feature=feature)).SerializeToString())
    test = [centre(f) for f in files[TRAIN:]]
    with open(os.path.join(out, "test.npz"), "wb") as f:
        np.savez(f, x=np.stack(test), y=labels[TRAIN:].astype(np.int32))


def write_model(out: str, lr: float = 0.05) -> None:
    """A small CNN with batch normalisation on CROP x CROP grey images: 'train' and 'serving_default'."""
    import keras
    import tensorflow as tf

    from export import build_module, sparse_ce

    keras.utils.set_random_seed(0)
    model = keras.Sequential([
        keras.Input((CROP, CROP, 1)),
        keras.layers.Conv2D(8, 3, strides=2, padding="same", use_bias=False), keras.layers.BatchNormalization(),
        keras.layers.ReLU(), keras.layers.Conv2D(16, 3, strides=2, padding="same", activation="relu"),
        keras.layers.Flatten(), keras.layers.Dense(10)])
    specs = {"x": tf.TensorSpec([None, CROP, CROP, 1], tf.float32, name="x"),
             "y": tf.TensorSpec([None], tf.int32, name="y")}
    m = build_module(model, specs, "momentum", lr, sparse_ce)
    tf.saved_model.save(m, out, signatures={"train": m.train, "serving_default": m.serve})


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("what", choices=["data", "model"])
    p.add_argument("out")
    a = p.parse_args()
    (write_data if a.what == "data" else write_model)(a.out)
    print(f"wrote {a.out}")


if __name__ == "__main__":
    main()
