"""TF1 MetaGraphDef + checkpoint input (what Saver().save writes), reference variables included."""
import os
import shutil
import subprocess
import sys

import numpy as np
import pytest
import tensorflow as tf

import vfgraph

v1 = tf.compat.v1
ENV = dict(os.environ, TF_CPP_MIN_LOG_LEVEL="3", TF_ENABLE_ONEDNN_OPTS="0")
RNG = np.random.default_rng(0)
BATCHES = [(RNG.normal(size=(32, 64)).astype(np.float32), RNG.integers(0, 10, 32).astype(np.int32)) for _ in range(2)]


def run_session(load, batches=BATCHES):
    """Run a TF1 train op over ``batches`` in a Session; (variables by name, losses)."""
    with tf.Graph().as_default() as g, v1.Session(graph=g) as sess:
        train_op, loss = load(sess)
        losses = [sess.run([train_op, loss], {"x:0": x, "y:0": y})[1] for x, y in batches]
        return {v.name: sess.run(v) for v in v1.global_variables()}, losses


def original(meta):
    def load(sess):
        v1.train.import_meta_graph(meta).restore(sess, meta[:-len(".meta")])
        return v1.get_collection("train_op")[0], sess.graph.get_tensor_by_name("loss:0")
    return load


def rewritten_session(out):
    def load(sess):
        mg = v1.saved_model.load(sess, ["serve"], out)
        return mg.collection_def["train_op"].node_list.value[0], mg.signature_def["train"].outputs["loss"].name
    return load


@pytest.fixture(scope="module")
def rewrite_meta(models, tmp_path_factory):
    root = tmp_path_factory.mktemp("tf1ckpt")
    made = {}

    def get(name, vnodes):
        if (name, vnodes) not in made:
            out = str(root / f"{name.replace(':', '_')}_v{vnodes}")
            vfgraph.save(vfgraph.rewrite(models(name), vnodes=vnodes), out)
            made[name, vnodes] = out
        return made[name, vnodes]

    return get


@pytest.mark.parametrize("kind", ["tf1ckpt", "tf1ckpt-resource"])
def test_one_vnode_reproduces_the_session_loop_exactly(models, rewrite_meta, kind):
    """Reference (VariableV2) and resource variables: V=1 equals the original train op run
    in a Session, bit for bit, and a TF1 loop over the rewritten SavedModel keeps working."""
    want, want_loss = run_session(original(models(f"{kind}:momentum")))
    got, got_loss = run_session(rewritten_session(rewrite_meta(f"{kind}:momentum", 1)))
    assert sorted(got) == sorted(want)
    for name in want:
        np.testing.assert_array_equal(got[name], want[name], err_msg=name)
    assert got_loss == want_loss


def test_reference_variable_saved_model(models, rewritten):
    """A TF1 SavedModel built with reference variables: V=1 equals the original exactly."""
    want, want_loss = run_session(rewritten_session(models("tf1-ref:adam")))
    got, got_loss = run_session(rewritten_session(rewritten("tf1-ref:adam", 1)))
    assert sorted(got) == sorted(want) and got_loss == want_loss
    for name in want:
        np.testing.assert_array_equal(got[name], want[name], err_msg=name)


def test_vnodes_equal_the_saved_model_rewrite(models, rewrite_meta, rewritten):
    """V=4 on the reference-variable checkpoint equals V=4 on the same graph exported as a
    TF1 SavedModel (itself checked against per-slice gradients in test_split_vnodes)."""
    got, got_loss = run_session(rewritten_session(rewrite_meta("tf1ckpt:momentum", 4)), BATCHES[:1])
    ref = tf.saved_model.load(rewritten("tf1:momentum", 4))
    x, y = BATCHES[0]
    ref_loss = float(ref.signatures["train"](x=x, y=y)["loss"])
    want = {v.name: v.numpy() for v in ref.signatures["train"].variables}
    assert got_loss[0] == pytest.approx(ref_loss, rel=1e-6)
    assert set(want) <= set(got)
    for name, value in want.items():
        np.testing.assert_allclose(got[name], value, rtol=1e-6, atol=1e-7, err_msg=name)
    # and the split really happened: a full-batch step gives different batch-norm statistics
    full, _ = run_session(rewritten_session(rewrite_meta("tf1ckpt:momentum", 1)), BATCHES[:1])
    assert not np.allclose(full["bn/moving_variance:0"], got["bn/moving_variance:0"], rtol=1e-6)


def test_signature_and_metadata(models, rewrite_meta):
    out = rewrite_meta("tf1ckpt:momentum", 4)
    loaded = tf.saved_model.load(out)
    x, y = BATCHES[0]
    assert np.isfinite(float(loaded.signatures["train"](x=x, y=y)["loss"]))
    meta = vfgraph.load(out).metadata
    assert meta["rewrites"]["split-vnodes"]["train"]["vnodes"] == 4
    cli = shutil.which("saved_model_cli", path=os.path.dirname(sys.executable)) or "saved_model_cli"
    show = subprocess.run([cli, "show", "--dir", out, "--all"], capture_output=True, text=True, env=ENV)
    assert show.returncode == 0 and "signature_def['train']" in show.stdout, show.stderr


def test_checkpoint_directory_and_cli(models, tmp_path):
    meta = models("tf1ckpt-resource:sgd")
    res = subprocess.run([sys.executable, "-m", "vfgraph.cli", "rewrite", os.path.dirname(meta), "--vnodes", "2",
                          "-o", str(tmp_path / "o")], capture_output=True, text=True, env=ENV, timeout=300)
    assert res.returncode == 0, res.stderr
    res = subprocess.run([sys.executable, "-m", "vfgraph.cli", "inspect", meta], capture_output=True, text=True,
                         env=ENV, timeout=300)
    assert res.returncode == 0 and "'train'" in res.stdout and "w1" in res.stdout, res.stdout + res.stderr


def _error(args):
    res = subprocess.run([sys.executable, "-m", "vfgraph.cli", *map(str, args)], capture_output=True, text=True,
                         env=ENV, timeout=300)
    lines = [line for line in res.stderr.splitlines() if line.startswith("vfgraph")]
    assert res.returncode == 2 and lines and "Traceback" not in res.stderr, res.stderr
    return lines[-1]


def test_bad_checkpoint_input(models, tmp_path):
    meta = models("tf1ckpt:sgd")
    lone = tmp_path / "lone.meta"
    shutil.copyfile(meta, lone)
    assert "no checkpoint beside lone.meta" in _error(["rewrite", lone, "--vnodes", 2, "-o", tmp_path / "o1"])
    res = subprocess.run([sys.executable, "-m", "vfgraph.cli", "rewrite", lone, "--vnodes", "2", "--checkpoint",
                          meta[:-len(".meta")], "-o", str(tmp_path / "o2")], capture_output=True, text=True, env=ENV,
                         timeout=300)
    assert res.returncode == 0, res.stderr
    truncated = tmp_path / "cut.meta"
    truncated.write_bytes(open(meta, "rb").read()[:300])
    assert "not a MetaGraphDef" in _error(["rewrite", truncated, "--checkpoint", meta[:-5], "-o", tmp_path / "o3"])
    # no train_op collection and no signatures: nothing to rewrite, and it says how to fix it
    mg = tf.compat.v1.MetaGraphDef()
    mg.ParseFromString(open(meta, "rb").read())
    del mg.collection_def["train_op"]
    bare = tmp_path / "bare.meta"
    bare.write_bytes(mg.SerializeToString())
    assert "add_to_collection('train_op'" in _error(["rewrite", bare, "--checkpoint", meta[:-5], "-o", tmp_path / "o4"])
    assert not any((tmp_path / f"o{i}").exists() for i in (1, 3, 4))
    assert open(meta, "rb").read() == open(lone, "rb").read()  # input untouched


def test_stepwise_signatures_in_a_tf1_session(rewritten):
    """train_accumulate twice (16 examples each) then train_apply, in a TF1 Session, gives the
    looped step over the 32: accumulators are graph variables zeroed by the init op."""
    out = rewritten("tf1-ref:adam", 4, 8)
    want, want_loss = run_session(rewritten_session(out))
    with tf.Graph().as_default() as g, v1.Session(graph=g) as sess:
        mg = v1.saved_model.load(sess, ["serve"], out)
        acc, apply = mg.signature_def["train_accumulate"], mg.signature_def["train_apply"]
        got_loss = []
        for x, y in BATCHES:
            halves = [sess.run(acc.outputs["loss"].name, {acc.inputs["x"].name: x[i:i + 16],
                                                          acc.inputs["y"].name: y[i:i + 16]}) for i in (0, 16)]
            assert sess.run(apply.outputs["vnodes"].name) == 4.0
            got_loss.append(np.mean(halves))
        got = {v.name: sess.run(v) for v in v1.global_variables()}
        with pytest.raises(tf.errors.InvalidArgumentError, match="train_apply found no accumulated virtual node"):
            sess.run(apply.outputs["vnodes"].name)
    assert sorted(got) == sorted(want)
    for name in want:
        np.testing.assert_allclose(got[name], want[name], rtol=1e-6, atol=1e-7, err_msg=name)
    np.testing.assert_allclose(got_loss, want_loss, rtol=1e-6)
