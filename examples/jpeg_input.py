"""The input function of examples/jpeg.sh: ``vfgraph train --input-fn examples/jpeg_input.py:decode``.

vfgraph calls ``decode(features, rng)`` for every training example, in its input threads,
while the steps run: ``features`` is one ``tf.train.Example`` record's features by name, each
a 1-D numpy array of its values (here ``image``: the JPEG file's bytes, ``label``: int64), and
``rng`` a ``numpy.random.Generator`` keyed by (--seed, step, the example's index), so an
example's augmentation is the same on any number of ranks and any split of the virtual nodes.
It returns the training signature's inputs for the one example.
"""
import numpy as np
import tensorflow as tf

CROP = 28


def pixels(jpeg: bytes) -> np.ndarray:
    """The JPEG file's grey pixels as float32 between 0 and 1 (height x width x 1)."""
    return tf.io.decode_jpeg(jpeg, channels=1).numpy().astype(np.float32) / 255.0


def centre(jpeg: bytes) -> np.ndarray:
    """The centre CROP x CROP of the image (validation: no randomness)."""
    img = pixels(jpeg)
    top, left = (img.shape[0] - CROP) // 2, (img.shape[1] - CROP) // 2
    return img[top:top + CROP, left:left + CROP]


def decode(features, rng):
    """A random CROP x CROP crop, a random contrast and brightness, and the label. (A random
    horizontal flip, ``img[:, ::-1]`` when ``rng.random() < 0.5``, suits images whose label a
    mirror keeps; not digits.)"""
    img = pixels(features["image"][0])
    top, left = rng.integers(0, img.shape[0] - CROP + 1), rng.integers(0, img.shape[1] - CROP + 1)
    img = img[top:top + CROP, left:left + CROP]
    img = np.clip(img * np.float32(rng.uniform(0.8, 1.2)) + np.float32(rng.uniform(-0.1, 0.1)), 0, 1)
    return {"x": img.astype(np.float32), "y": np.int32(features["label"][0])}
