"""Write the generated golden-test input models (tests/goldens/<pass>/<case>.before.pbtxt).

Each generated input (CASES) is a small model exported by tf.saved_model.save in a fresh
process and stored as protobuf text, so golden tests read a fixed graph whatever TensorFlow
traced before them; they run to thousands of lines and cover what a real export holds.

The other inputs are hand-written (matmul_sgd, matmul_serve, matmul_assign_sub): SavedModels
in protobuf text form, a few dozen nodes each, whose first line is ``# Hand-written golden
input`` and whose comment header says what they are. This script does not generate them and
refuses to overwrite them; edit them by hand (tests/rewrites/test_golden_inputs.py checks that
TensorFlow loads each one, before and after its rewrite).

    python tools/make_golden_inputs.py [CASE...]
"""
import os
import sys
import tempfile

os.environ.setdefault("TF_CPP_MIN_LOG_LEVEL", "2")
os.environ.setdefault("TF_ENABLE_ONEDNN_OPTS", "0")

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
GOLDENS = os.path.join(ROOT, "tests", "goldens")
CASES = {"split-vnodes": ["linear_manual", "linear_momentum"], "microbatch-inference": ["linear_manual"],
         "insert-allreduce": ["linear_momentum"]}
HAND_WRITTEN_MARK = "# Hand-written golden input"  # first line of a hand-written input (tests/rewrites/test_goldens.py)


def is_hand_written(path: str) -> bool:
    if not os.path.isfile(path):
        return False
    with open(path) as f:
        return f.readline().startswith(HAND_WRITTEN_MARK)


def linear(optimizer: str):
    import keras
    import tensorflow as tf

    class Linear(tf.Module):
        def __init__(self):
            super().__init__()
            self.w = tf.Variable(tf.reshape(tf.range(6, dtype=tf.float32) / 10.0, [3, 2]), name="w")
            self.b = tf.Variable(tf.zeros([2]), name="b")
            self.opt = keras.optimizers.SGD(0.1, momentum=0.9) if optimizer == "momentum" else None
            if self.opt is not None:
                self.opt.build([self.w, self.b])

        @tf.function(input_signature=[tf.TensorSpec([None, 3], tf.float32, name="x"),
                                      tf.TensorSpec([None, 2], tf.float32, name="y")])
        def train(self, x, y):
            with tf.GradientTape() as tape:
                loss = tf.reduce_mean(tf.square(tf.matmul(x, self.w) + self.b - y))
            gw, gb = tape.gradient(loss, [self.w, self.b])
            if self.opt is None:
                self.w.assign_sub(0.1 * gw)
                self.b.assign_sub(0.1 * gb)
            else:
                self.opt.apply_gradients([(gw, self.w), (gb, self.b)])
            return {"loss": loss}

        @tf.function(input_signature=[tf.TensorSpec([None, 3], tf.float32, name="x")])
        def serve(self, x):
            return {"y": tf.matmul(x, self.w) + self.b}

    return Linear()


def minimise(sm) -> None:
    """Keep only what the signatures reach: their graph nodes and library functions."""
    from vfgraph.ir.functions import function_dependencies
    from vfgraph.ir.names import tensor_node
    from vfgraph.ir.walk import ancestors

    mg = sm.meta_graphs[0]
    mg.meta_info_def.ClearField("tensorflow_git_version")
    mg.ClearField("object_graph_def")
    mg.ClearField("saver_def")
    for key in [k for k in mg.signature_def if k.startswith("__")]:
        del mg.signature_def[key]
    nodes = {n.name: n for n in mg.graph_def.node}
    keep = ancestors(nodes, [tensor_node(t.name) for s in mg.signature_def.values() for t in s.outputs.values()])
    kept_nodes = [n for n in mg.graph_def.node if n.name in keep]
    del mg.graph_def.node[:]
    mg.graph_def.node.extend(kept_nodes)
    lib = {f.signature.name: f for f in mg.graph_def.library.function}
    fns = set()
    for n in kept_nodes:
        if "f" in n.attr:
            fns.update(function_dependencies(n.attr["f"].func.name, lib))
    kept_fns = [f for f in mg.graph_def.library.function if f.signature.name in fns]
    del mg.graph_def.library.function[:]
    mg.graph_def.library.function.extend(kept_fns)


def export(case: str, path: str) -> None:
    import tensorflow as tf
    from google.protobuf import text_format
    from tensorflow.core.protobuf import saved_model_pb2

    m = linear("momentum" if case == "linear_momentum" else "manual")
    with tempfile.TemporaryDirectory() as d:
        tf.saved_model.save(m, d, signatures={"train": m.train, "serving_default": m.serve})
        sm = saved_model_pb2.SavedModel()
        with open(os.path.join(d, "saved_model.pb"), "rb") as f:
            sm.ParseFromString(f.read())
    minimise(sm)
    with open(path, "w") as f:
        f.write(text_format.MessageToString(sm))


if __name__ == "__main__":
    only = sys.argv[1:]
    for pass_name, cases in CASES.items():
        os.makedirs(os.path.join(GOLDENS, pass_name), exist_ok=True)
        for case in cases:
            if only and case not in only:
                continue
            path = os.path.join(GOLDENS, pass_name, f"{case}.before.pbtxt")
            if is_hand_written(path):
                sys.exit(f"{os.path.relpath(path, ROOT)} is hand-written; not overwriting it (edit it by hand, "
                         "or rename the case in CASES)")
            export(case, path)
            print("wrote", os.path.relpath(path, ROOT))
