"""Truncated and mutated SavedModel files: a VfgraphError or a loaded item, never a crash or hang."""
import shutil

from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

import vfgraph
from vfgraph.errors import VfgraphError


@settings(max_examples=60, deadline=None, suppress_health_check=list(HealthCheck))
@given(data=st.data())
def test_mutated_saved_model(models, tmp_path_factory, data):
    src = models("mlp:sgd")
    d = tmp_path_factory.mktemp("fuzz")
    shutil.copytree(src, d, dirs_exist_ok=True)
    pb = d / "saved_model.pb"
    raw = bytearray(pb.read_bytes())
    cut = data.draw(st.integers(0, len(raw)))
    raw = raw[:cut]
    for _ in range(data.draw(st.integers(0, 8))):
        if raw:
            i = data.draw(st.integers(0, len(raw) - 1))
            raw[i] = data.draw(st.integers(0, 255))
    pb.write_bytes(bytes(raw))
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

    raw = bytearray(f.get_concrete_function().graph.as_graph_def().SerializeToString())
    raw = raw[: data.draw(st.integers(0, len(raw)))]
    for _ in range(data.draw(st.integers(0, 8))):
        if raw:
            raw[data.draw(st.integers(0, len(raw) - 1))] = data.draw(st.integers(0, 255))
    path = tmp_path_factory.mktemp("fuzzgd") / "g.pb"
    path.write_bytes(bytes(raw))
    try:
        vfgraph.load(path)
    except VfgraphError:
        pass
