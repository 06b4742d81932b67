"""Test accuracy of a SavedModel's serving signature on an .npz with x and y.

    python examples/evaluate.py MODEL_DIR test.npz
"""
import os
import sys

os.environ.setdefault("TF_CPP_MIN_LOG_LEVEL", "2")
os.environ.setdefault("TF_ENABLE_ONEDNN_OPTS", "0")


def accuracy(model_dir: str, data: str) -> float:
    import numpy as np
    import tensorflow as tf

    import vfgraph  # noqa: F401  (registers what rewritten graphs need)

    with np.load(data) as z:
        x, y = z["x"], z["y"]
    logits = tf.saved_model.load(model_dir).signatures["serving_default"](x=x)["logits"].numpy()
    return float((logits.argmax(-1) == y).mean())


if __name__ == "__main__":
    print(f"{accuracy(sys.argv[1], sys.argv[2]):.4f}")
