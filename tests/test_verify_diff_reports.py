"""`vfgraph verify` and `vfgraph diff` report what is true: a difference batch statistics
make by design is named as such, values that are not finite are counted where they are,
random inputs a model refuses are one line, and two exports of one model have no graph diff."""
import numpy as np
import pytest

from vfgraph.testing.cli import error_line, run_in_process as run


def small_classifier(out: str, classes: int = 3, activation: str = "relu") -> str:
    """A two-layer classifier of 4 features into ``classes`` classes, a tf.Module with a manual
    SGD 'train' signature and 'serving_default' (no Keras: its node names are TensorFlow's, so
    two exports differ only in what tracing numbers)."""
    import tensorflow as tf

    act = getattr(tf.nn, activation)

    class Small(tf.Module):
        def __init__(self):
            super().__init__()
            self.w1 = tf.Variable(tf.random.stateless_normal([4, 8], seed=[1, 2]), name="w1")
            self.w2 = tf.Variable(tf.random.stateless_normal([8, classes], seed=[3, 4]), name="w2")

        def logits(self, x):
            return tf.matmul(act(tf.matmul(x, self.w1)), self.w2)

        @tf.function(input_signature=[{"x": tf.TensorSpec([None, 4], tf.float32, name="x"),
                                       "y": tf.TensorSpec([None], tf.int32, name="y")}])
        def train(self, batch):
            with tf.GradientTape() as tape:
                loss = tf.reduce_mean(tf.nn.sparse_softmax_cross_entropy_with_logits(batch["y"],
                                                                                     self.logits(batch["x"])))
            for v, g in zip([self.w1, self.w2], tape.gradient(loss, [self.w1, self.w2])):
                v.assign_sub(0.1 * g)
            return {"loss": loss}

        @tf.function(input_signature=[tf.TensorSpec([None, 4], tf.float32, name="x")])
        def serve(self, x):
            return {"logits": self.logits(x)}

    m = Small()
    tf.saved_model.save(m, out, signatures={"train": m.train, "serving_default": m.serve})
    return out


@pytest.fixture(scope="module")
def small(tmp_path_factory):
    """Two exports of one 3-class model (other tracing numbers), one with tanh, and their
    rewrites at V=2 (through Python and the command line) and V=4."""
    import vfgraph
    from vfgraph import cli

    root = tmp_path_factory.mktemp("small")
    p = {name: small_classifier(str(root / name), activation=act)
         for name, act in (("a", "relu"), ("b", "relu"), ("tanh", "tanh"))}
    for name in ("a", "b"):
        vfgraph.save(vfgraph.rewrite(p[name], vnodes=2), str(root / f"{name}_v2"))
        p[f"{name}_v2"] = str(root / f"{name}_v2")
    for vnodes in (2, 4):
        p[f"a_cli{vnodes}"] = str(root / f"a_cli{vnodes}")
        assert cli.main(["rewrite", p["a"], "--vnodes", str(vnodes), "-o", p[f"a_cli{vnodes}"]]) == 0
    return p


def _out(capsys, *argv):
    capsys.readouterr()
    from vfgraph import cli

    code = cli.main([str(a) for a in argv])
    return code, capsys.readouterr().out


# --- verify --------------------------------------------------------------------------------------

def test_batch_norm_at_v4_names_per_vnode_statistics(models, rewritten, capsys):
    code, out = _out(capsys, "verify", models("cnn"), rewritten("cnn", 4))
    assert code == 1, out
    note = [ln for ln in out.splitlines() if ln.startswith("note: ")]
    assert len(note) == 1, out
    assert "4 virtual nodes of 8 examples" in note[0] and "batch statistics" in note[0]
    assert "moving_mean" in note[0] and "moving_variance" in note[0]
    assert "--vnodes 1" in note[0] and "--rtol" in note[0]
    assert out.splitlines()[-1].startswith("MISMATCH: parameter difference above --rtol 1e-05 (expected")
    # a tolerance that accepts the difference is OK, and the note goes with the mismatch
    code, out = _out(capsys, "verify", models("cnn"), rewritten("cnn", 4), "--rtol", "1")
    assert code == 0 and out.splitlines()[-1] == "OK" and "note:" not in out, out


def test_batch_norm_at_v1_matches_without_a_note(models, rewritten, capsys):
    code, out = _out(capsys, "verify", models("cnn"), rewritten("cnn", 1))
    assert code == 0 and out.splitlines()[-1] == "OK" and "note:" not in out, out


def test_no_batch_statistics_no_note(small, capsys, tmp_path):
    """A real mismatch of a model without batch statistics (another activation under the
    same variables) exits 1 without blaming batch statistics."""
    data = tmp_path / "d.npz"
    rng = np.random.default_rng(0)
    np.savez(data, x=rng.normal(size=(32, 4)).astype("float32"), y=rng.integers(0, 3, 32).astype("int32"))
    code, out = _out(capsys, "verify", small["a"], small["a_cli2"], "--data", data)
    assert code == 0 and out.splitlines()[-1] == "OK", out
    code, out = _out(capsys, "verify", small["tanh"], small["a_cli2"], "--data", data)
    assert code == 1 and "note:" not in out and out.splitlines()[-1].startswith("MISMATCH"), out


def test_not_finite_values_are_counted_not_printed_as_nan(small, capsys, tmp_path):
    data = tmp_path / "nan.npz"
    x = np.random.default_rng(0).normal(size=(32, 4)).astype("float32")
    x[3, 1] = np.nan
    np.savez(data, x=x, y=np.zeros(32, "int32"))
    code, out = _out(capsys, "verify", small["a"], small["a_cli2"], "--data", data)
    assert code == 1, out
    assert "difference nan" not in out and "max abs output difference" not in out, out
    lines = out.splitlines()
    assert "serving serving_default: no output is finite (listed below)" in lines
    for model in (small["a"], small["a_cli2"]):
        assert f"not finite: {model}: signature 'serving_default' output 'logits': 3 of 96 values are not " \
               "finite" in lines, out
        assert f"not finite: {model}: signature 'train' output 'loss' at step 0: 1 of 1 values are not finite" \
               in lines, out
        assert f"not finite: {model}: parameter w1:0 after 3 steps: 32 of 32 values are not finite" in lines, out
    assert lines[-1].startswith("MISMATCH: 8 outputs or parameters are not finite"), out


def test_random_labels_beyond_the_classes_are_one_line(small, capsys):
    code, err = run(capsys, "verify", small["a"], small["a_cli2"])
    assert code == 2, err
    line = error_line(err)
    assert line.startswith(f"vfgraph verify: error: {small['a']}: signature 'train' refuses vfgraph's random "
                           "inputs, whose integers are in [0, 10)"), line
    assert "valid range of [0, 3)" in line and line.endswith("--data FILE.npz"), line


# --- diff --------------------------------------------------------------------------------------

@pytest.mark.parametrize("a, b", [("a", "b"), ("a_v2", "b_v2"), ("a_v2", "a_cli2"), ("b_v2", "a_cli2")])
def test_graphs_only_of_one_model_is_empty(small, capsys, a, b):
    """Two exports of one model (their __inference_* numbers differ), and their rewrites made
    through Python or the command line, have equal graphs."""
    import vfgraph
    from vfgraph.diff import diff_models
    from vfgraph.ir.canonical import canonical_text

    plain = [canonical_text(vfgraph.load(small[k])) for k in ("a", "b")]
    assert plain[0] != plain[1]  # the case: the exports' generated names differ
    code, out = _out(capsys, "diff", "--graphs-only", small[a], small[b])
    assert code == 0 and out == "", out
    assert diff_models(small[a], small[b], graphs_only=True).lines == []


def test_graphs_only_still_shows_real_differences(small, capsys):
    code, out = _out(capsys, "diff", "--graphs-only", small["b"], small["tanh"])
    changed = [ln for ln in out.splitlines() if ln[:1] in "+-" and ln[:3] not in ("---", "+++")]
    assert code == 1 and '-    op: "Relu"' in changed and '+    op: "Tanh"' in changed, out
    assert not any("__inference" in ln for ln in changed), out  # the functions' names are equal
    code, out = _out(capsys, "diff", "--graphs-only", small["a_cli2"], small["a_cli4"])
    assert code == 1 and "-          int_val: 2" in out.splitlines() and "@@ function __inference_train\n" in out


def test_generated_names_are_named_by_content(small):
    import vfgraph
    from vfgraph.ir.canonical import canonical_text

    item = vfgraph.load(small["a_v2"])
    traced = item.signatures["train"].function  # __inference_train_N
    text = canonical_text(item, generated_names=True)
    assert "# signature train: function __inference_train\n" in text
    assert 'name: "__vf_inference_train_vnode"' in text and 'name: "__vf_inference_train_reduce"' in text
    assert traced.strip("_") not in text
    assert traced.strip("_") in canonical_text(item)  # the goldens' plain form keeps the names
