"""Checkpoints of SavedModels whose object graph gained variables (accumulators)."""
from __future__ import annotations

import os
from typing import Dict, List

import numpy as np
from tensorflow.core.protobuf import saved_object_graph_pb2, trackable_object_graph_pb2

OBJECT_GRAPH_KEY = "_CHECKPOINTABLE_OBJECT_GRAPH"


def _paths(og: saved_object_graph_pb2.SavedObjectGraph) -> Dict[int, str]:
    """Node id -> path of local names from the root (first path found breadth first)."""
    paths, queue = {0: ""}, [0]
    while queue:
        n = queue.pop(0)
        for c in og.nodes[n].children:
            if c.node_id not in paths:
                paths[c.node_id] = (paths[n] + "/" if paths[n] else "") + c.local_name
                queue.append(c.node_id)
    return paths


def extend_checkpoint(src_prefix: str, dst_prefix: str, og: saved_object_graph_pb2.SavedObjectGraph) -> bool:
    """Write ``dst_prefix`` = the checkpoint at ``src_prefix`` plus zero-valued entries for the
    variables of ``og`` that it lacks, with its object graph extended to match ``og`` (node
    ids of the two graphs correspond). Returns False when nothing needed adding."""
    import tensorflow as tf

    reader = tf.train.load_checkpoint(src_prefix)
    if not og.nodes or not reader.has_tensor(OBJECT_GRAPH_KEY):
        return False  # a TF1 checkpoint: nothing is added to it
    ckpt_graph = trackable_object_graph_pb2.TrackableObjectGraph()
    ckpt_graph.ParseFromString(reader.get_tensor(OBJECT_GRAPH_KEY))
    old = len(ckpt_graph.nodes)
    if old >= len(og.nodes):
        return False
    paths = _paths(og)
    names: List[str] = []
    tensors: List = []
    for key in sorted(reader.get_variable_to_shape_map()):
        if key == OBJECT_GRAPH_KEY:
            continue
        names.append(key)
        tensors.append(reader.get_tensor(key))
    known = {c.node_id for c in ckpt_graph.nodes[0].children}
    for c in og.nodes[0].children:
        if c.node_id >= old and c.node_id not in known:
            ckpt_graph.nodes[0].children.add(node_id=c.node_id, local_name=c.local_name)
    for node_id in range(old, len(og.nodes)):
        saved = og.nodes[node_id]
        node = ckpt_graph.nodes.add()
        for c in saved.children:
            node.children.add(node_id=c.node_id, local_name=c.local_name)
        if saved.WhichOneof("kind") == "variable":
            var = saved.variable
            key = f"{paths[node_id]}/.ATTRIBUTES/VARIABLE_VALUE"
            node.attributes.add(name="VARIABLE_VALUE", full_name=var.name, checkpoint_key=key)
            names.append(key)
            dims = [max(d.size, 0) for d in var.shape.dim]  # an unknown dimension starts empty (sparse rows)
            tensors.append(np.zeros(dims, tf.dtypes.as_dtype(var.dtype).as_numpy_dtype))
    names.append(OBJECT_GRAPH_KEY)
    tensors.append(np.array(ckpt_graph.SerializeToString(deterministic=True), dtype=object))
    os.makedirs(os.path.dirname(dst_prefix), exist_ok=True)
    with tf.device("/cpu:0"):
        tf.raw_ops.SaveV2(prefix=dst_prefix, tensor_names=names, shape_and_slices=[""] * len(names),
                          tensors=[tf.constant(t) for t in tensors])
    return True
