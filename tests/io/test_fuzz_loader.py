"""Truncated and mutated SavedModel files: a VfgraphError or a loaded item, never a crash or hang."""
import shutil

from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

import vfgraph
from vfgraph.errors import VfgraphError


def mutate(raw: bytes, data) -> bytes:
    """``raw`` truncated at a drawn length, then up to 8 drawn bytes overwritten."""
    raw = bytearray(raw[: data.draw(st.integers(0, len(raw)))])
    for _ in range(data.draw(st.integers(0, 8))):
        if raw:
            raw[data.draw(st.integers(0, len(raw) - 1))] = data.draw(st.integers(0, 255))
    return bytes(raw)


@settings(max_examples=60, deadline=None, suppress_health_check=list(HealthCheck))
@given(data=st.data())
def test_mutated_saved_model(models, tmp_path_factory, data):
    src = models("mlp:sgd")
    d = tmp_path_factory.mktemp("fuzz")
    shutil.copytree(src, d, dirs_exist_ok=True)
    pb = d / "saved_model.pb"
    pb.write_bytes(mutate(pb.read_bytes(), data))
    try:
        vfgraph.load(d)
    except VfgraphError:
        pass


@settings(max_examples=40, deadline=None, suppress_health_check=list(HealthCheck))
@given(data=st.data())
def test_mutated_graph_def(tmp_path_factory, data):
    import tensorflow as tf

    @tf.function(input_signature=[tf.TensorSpec([None, 3], tf.float32, name="x")])
    def f(x):
        return tf.nn.relu(tf.matmul(x, tf.ones([3, 2])))

    path = tmp_path_factory.mktemp("fuzzgd") / "g.pb"
    path.write_bytes(mutate(f.get_concrete_function().graph.as_graph_def().SerializeToString(), data))
    try:
        vfgraph.load(path)
    except VfgraphError:
        pass


@settings(max_examples=40, deadline=None, suppress_health_check=list(HealthCheck))
@given(data=st.data())
def test_mutated_meta_graph(models, tmp_path_factory, data):
    """A TF1 .meta (reference variables) with its checkpoint, the .meta mutated."""
    meta = models("tf1ckpt:sgd")
    path = tmp_path_factory.mktemp("fuzzmeta") / "m.meta"
    path.write_bytes(mutate(open(meta, "rb").read(), data))
    try:
        vfgraph.load(path, checkpoint=meta[:-len(".meta")])
    except VfgraphError:
        pass
