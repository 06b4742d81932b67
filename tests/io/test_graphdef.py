"""Frozen GraphDefs in (.pb, .pbtxt), micro-batched GraphDefs out, same tensor names."""
import os
import subprocess
import sys

import numpy as np
import pytest
import tensorflow as tf
from google.protobuf import text_format

import vfgraph
from vfgraph.errors import InputError


@pytest.fixture(scope="session")
def frozen(models, tmp_path_factory):
    from tensorflow.python.framework.convert_to_constants import convert_variables_to_constants_v2

    loaded = tf.saved_model.load(models("mlp:sgd"))
    gd = convert_variables_to_constants_v2(loaded.signatures["serving_default"]).graph.as_graph_def()
    root = tmp_path_factory.mktemp("frozen")
    tf.io.write_graph(gd, str(root), "mlp.pb", as_text=False)
    tf.io.write_graph(gd, str(root), "mlp.pbtxt", as_text=True)
    return root


def run_graph(path, x):
    gd = tf.compat.v1.GraphDef()
    with open(path, "rb") as f:
        data = f.read()
    if str(path).endswith(".pbtxt"):
        text_format.Parse(data.decode(), gd)
    else:
        gd.ParseFromString(data)
    f = tf.compat.v1.wrap_function(lambda: tf.graph_util.import_graph_def(gd, name=""), [])
    return f.prune(f.graph.get_tensor_by_name("x:0"), f.graph.get_tensor_by_name("Identity:0"))(tf.constant(x)).numpy()


@pytest.mark.parametrize("ext", [".pb", ".pbtxt"])
def test_frozen_graph_microbatched(frozen, tmp_path, ext):
    src = frozen / f"mlp{ext}"
    out = vfgraph.save(vfgraph.rewrite(src, pipeline="microbatch-inference{vnode-batch=8}"), tmp_path / f"o{ext}")
    assert vfgraph.load(out).signatures["graph"]  # readable again
    for n in (0, 3, 8, 29):
        x = np.random.default_rng(n).normal(size=(n, 64)).astype("float32")
        np.testing.assert_allclose(run_graph(out, x), run_graph(src, x), rtol=1e-5, atol=1e-6)
    written = vfgraph.load(out).meta_graph.graph_def  # the GraphDef as written
    assert any(n.op == "While" for f in written.library.function for n in f.node_def)


def test_frozen_graph_cli_and_errors(frozen, tmp_path):
    env = dict(os.environ, TF_CPP_MIN_LOG_LEVEL="3")
    run = lambda *a: subprocess.run([sys.executable, "-m", "vfgraph.cli", *map(str, a)], capture_output=True,  # noqa: E731
                                    text=True, env=env, timeout=300)
    ok = run("rewrite", frozen / "mlp.pb", "--vnode-batch", 4, "-o", tmp_path / "a.pb")
    assert ok.returncode == 0, ok.stderr
    assert run("diff", frozen / "mlp.pb", tmp_path / "a.pb").returncode == 1
    bad = tmp_path / "bad.pb"
    bad.write_bytes((frozen / "mlp.pb").read_bytes()[:100])
    res = run("rewrite", bad, "--vnode-batch", 4, "-o", tmp_path / "b.pb")
    assert res.returncode == 2 and "bad.pb" in res.stderr and "Traceback" not in res.stderr
    assert not (tmp_path / "b.pb").exists()
    res = run("rewrite", frozen / "mlp.pb", "--outputs", "nope", "-o", tmp_path / "c.pb")
    assert res.returncode == 2 and "'nope'" in res.stderr


def test_missing_output_names_the_node(frozen):
    with pytest.raises(InputError, match="names no node"):
        vfgraph.load(frozen / "mlp.pb", outputs=["missing:0"])
