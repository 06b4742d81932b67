"""The hand-written golden inputs (tests/goldens/<pass>/<case>.before.pbtxt whose first line
is ``# Hand-written``) are real SavedModels: each one, written as a binary saved_model.pb with
a checkpoint of its variables, loads with ``tf.saved_model.load`` and runs; rewritten by the
pipeline its golden case runs (tests/rewrites/test_goldens.py), saved and loaded again, it computes
what the original does (serving outputs, training losses and variables)."""
import os

import numpy as np
import pytest
import tensorflow as tf
from google.protobuf import text_format
from tensorflow.core.protobuf import saved_model_pb2, trackable_object_graph_pb2

import vfgraph
from test_goldens import HAND_WRITTEN, HERE, pipeline_spec
from vfgraph.io.checkpoint import OBJECT_GRAPH_KEY
from vfgraph.testing.compare import compare_models

BATCH = 4  # two slices of the goldens' vnode-batch=2


def write_saved_model(text_path: str, out: str, seed: int = 0) -> saved_model_pb2.SavedModel:
    """Write the SavedModel in protobuf text form at ``text_path`` as the directory ``out``:
    saved_model.pb, and variables/ holding every variable of its object graph (seeded normal
    values) with the checkpoint's object graph, which mirrors the SavedModel's."""
    sm = saved_model_pb2.SavedModel()
    with open(text_path) as f:
        text_format.Parse(f.read(), sm)
    os.makedirs(out)
    with open(os.path.join(out, "saved_model.pb"), "wb") as f:
        f.write(sm.SerializeToString(deterministic=True))
    og = sm.meta_graphs[0].object_graph_def
    graph = trackable_object_graph_pb2.TrackableObjectGraph()
    paths = {0: ""}
    names, values = [], []
    rng = np.random.default_rng(seed)
    for i, node in enumerate(og.nodes):
        entry = graph.nodes.add()
        for c in node.children:
            entry.children.add(node_id=c.node_id, local_name=c.local_name)
            paths.setdefault(c.node_id, f"{paths[i]}/{c.local_name}" if paths[i] else c.local_name)
        if node.WhichOneof("kind") == "variable":
            key = f"{paths[i]}/.ATTRIBUTES/VARIABLE_VALUE"
            entry.attributes.add(name="VARIABLE_VALUE", full_name=node.variable.name, checkpoint_key=key)
            dtype = tf.dtypes.as_dtype(node.variable.dtype).as_numpy_dtype
            names.append(key)
            values.append(rng.normal(size=[d.size for d in node.variable.shape.dim]).astype(dtype))
    if names:
        names.append(OBJECT_GRAPH_KEY)
        values.append(np.array(graph.SerializeToString(deterministic=True), dtype=object))
        with tf.device("/cpu:0"):
            tf.raw_ops.SaveV2(prefix=os.path.join(out, "variables", "variables"), tensor_names=names,
                              shape_and_slices=[""] * len(names), tensors=[tf.constant(v) for v in values])
    return sm


def _inputs(fn, batch: int, seed: int = 1):
    _, specs = fn.structured_input_signature
    rng = np.random.default_rng(seed)
    return {k: rng.normal(size=[batch] + s.shape.as_list()[1:]).astype(s.dtype.as_numpy_dtype)
            for k, s in specs.items()}


def test_hand_written_inputs_exist_for_every_pass():
    assert {os.path.basename(os.path.dirname(c)) for c in HAND_WRITTEN} == {
        "split-vnodes", "microbatch-inference", "insert-allreduce", "partition-stages"}


@pytest.mark.parametrize("before", HAND_WRITTEN, ids=lambda p: os.path.relpath(p, HERE)[: -len(".before.pbtxt")])
def test_hand_written_input_loads_in_tensorflow_before_and_after(before, tmp_path):
    pass_name = os.path.basename(os.path.dirname(before))
    original = str(tmp_path / "original")
    sm = write_saved_model(before, original)
    keys = sorted(k for k in sm.meta_graphs[0].signature_def if not k.startswith("__"))
    loaded = tf.saved_model.load(original)
    assert sorted(loaded.signatures) == keys
    for key in keys:  # the original runs; a training step trains (its variables change)
        fn = loaded.signatures[key]
        start = [v.numpy() for v in fn.variables]
        result = fn(**_inputs(fn, BATCH))
        assert set(result) == set(fn.structured_outputs)
        assert all(np.all(np.isfinite(r.numpy())) for r in result.values())
        assert key != "train" or any(not np.array_equal(a, v.numpy()) for a, v in zip(start, fn.variables))

    rewritten = str(tmp_path / "rewritten")
    vfgraph.save(vfgraph.rewrite(original, pipeline=pipeline_spec(pass_name)), rewritten)
    again = tf.saved_model.load(rewritten)
    added = {"split-vnodes": {"train_accumulate", "train_apply"},
             "insert-allreduce": {"train_accumulate", "train_apply", "train_broadcast"}}.get(pass_name, set())
    assert sorted(again.signatures) == sorted(set(keys) | added)
    report = compare_models(original, rewritten, steps=2, batch=BATCH)
    assert report.loss or report.serving
    assert report.worst_output < 1e-5, report.serving
    assert report.worst_param < 1e-5, report.params
    for _, a, b in report.loss:
        assert b == pytest.approx(a, rel=1e-5)

    if "train" in keys and "train_accumulate" not in again.signatures:
        assert pass_name == "partition-stages"  # (places the step; adds no step-wise signatures)
    elif "train" in keys:  # step-wise: two slices accumulated, then applied once, make one step
        fresh = tf.saved_model.load(original)  # (held: a signature keeps only weak references to its variables)
        one = fresh.signatures["train"]
        inputs = _inputs(one, BATCH, seed=2)
        loss = float(one(**inputs)["loss"])
        accumulate, apply = again.signatures["train_accumulate"], again.signatures["train_apply"]
        if "train_broadcast" in again.signatures:
            again.signatures["train_broadcast"]()  # one process: the fingerprint check, no copy
        losses = [float(accumulate(**{k: v[i:i + 2] for k, v in inputs.items()})["loss"]) for i in (0, 2)]
        apply()
        assert np.mean(losses) == pytest.approx(loss, rel=1e-5)
        want = {v.name: v.numpy() for v in one.variables}
        got = {v.name: v.numpy() for v in apply.variables if v.name in want}
        assert set(got) == set(want)
        for name in want:
            np.testing.assert_allclose(got[name], want[name], rtol=1e-5, atol=1e-6)
    else:  # serving: a batch that is no multiple of the slice size
        fa, fb = loaded.signatures[keys[0]], again.signatures[keys[0]]
        inputs = _inputs(fa, 5, seed=3)
        for k, a in fa(**inputs).items():
            np.testing.assert_allclose(fb(**inputs)[k].numpy(), a.numpy(), rtol=1e-6, atol=1e-6)
