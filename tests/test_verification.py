"""verify() of a whole model: what TensorFlow's loader reads (captured tensors, concrete
functions), on a real Keras export."""
import pytest

from vfgraph.errors import VerifyError


@pytest.fixture(scope="module")
def silu_mlp(tmp_path_factory):
    """A Keras MLP with SiLU activations: tf.nn.silu's custom gradient keeps forward tensors as
    captured tensors of the training function in the object graph."""
    import keras
    import tensorflow as tf

    import export

    keras.utils.set_random_seed(0)
    model = keras.Sequential([keras.Input((64,)), keras.layers.Dense(16, activation="silu"), keras.layers.Dense(10)])
    out = str(tmp_path_factory.mktemp("silu") / "m")
    specs = {"x": tf.TensorSpec([None, 64], tf.float32, name="x"), "y": tf.TensorSpec([None], tf.int32, name="y")}
    m = export.build_module(model, specs, "sgd", 0.05, export.sparse_ce)
    tf.saved_model.save(m, out, signatures={"train": m.train, "serving_default": m.serve})
    return out


def _captured(item):
    return [n.captured_tensor for n in item.meta_graph.object_graph_def.nodes
            if n.WhichOneof("kind") == "captured_tensor"]


def test_captured_tensors_follow_the_nodes_a_rewrite_moves(silu_mlp, tmp_path):
    """split-vnodes moves the training function's nodes into the virtual-node function and
    microbatch-inference the serving function's into its slice function: the object graph's
    captured tensors are relinked, and the output loads in a fresh process."""
    import subprocess
    import sys

    import vfgraph

    item = vfgraph.rewrite(silu_mlp, vnodes=2, vnode_batch=4)
    caps = _captured(item)
    assert caps, "the model has no captured tensors: the test checks nothing"
    lib = item.library
    for ct in caps:
        assert ct.name.rsplit(":", 1)[0] in {n.name for n in lib[ct.concrete_function].node_def}, ct
    assert any(ct.concrete_function.startswith("__vf_") for ct in caps)
    out = vfgraph.save(item, str(tmp_path / "v2"))
    code = f"import vfgraph, tensorflow as tf; m = tf.saved_model.load({out!r}); print(sorted(m.signatures))"
    res = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True)
    assert res.returncode == 0, res.stderr[-2000:]


def test_verify_refuses_what_the_loader_would(silu_mlp):
    """A captured tensor whose node is gone, or a concrete function missing from the library,
    is what makes tf.saved_model.load fail: verify names it."""
    import vfgraph

    item = vfgraph.load(silu_mlp)
    vfgraph.verify(item)
    _captured(item)[0].name = "no_such_node:0"
    with pytest.raises(VerifyError, match="captures tensor 'no_such_node:0'"):
        vfgraph.verify(item)
    item = vfgraph.load(silu_mlp)
    name = sorted(item.meta_graph.object_graph_def.concrete_functions)[0]
    lib = item.meta_graph.graph_def.library.function
    del lib[[f.signature.name for f in lib].index(name)]
    with pytest.raises(VerifyError, match="not in the library"):
        vfgraph.verify(item)
