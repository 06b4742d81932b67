"""Checkpoints: the files of one, and the checkpoints of SavedModels whose object graph gained
variables (accumulators)."""
from __future__ import annotations

import functools
import glob
import os
from typing import Callable, Dict, List, Optional, Tuple

import numpy as np
from tensorflow.core.protobuf import saved_object_graph_pb2, trackable_object_graph_pb2

from vfgraph.errors import InputError

OBJECT_GRAPH_KEY = "_CHECKPOINTABLE_OBJECT_GRAPH"


def checkpoint_files(prefix: str) -> List[str]:
    """The files of the checkpoint at ``prefix`` (index first, then data shards)."""
    return [prefix + ".index"] + sorted(glob.glob(glob.escape(prefix) + ".data-*"))


def _damaged(prefix: str, e: BaseException, key: str = "") -> InputError:
    first = (str(getattr(e, "message", "") or e).strip().splitlines() or [type(e).__name__])[0]
    what = f"{key} from the checkpoint" if key else "the checkpoint"
    return InputError(f"{prefix}: cannot read {what} ({first}); its .index and .data-* files are incomplete or "
                      "damaged: copy the model again from where it came")


class CheckpointReader:
    """``tf.train.load_checkpoint`` whose failures (a truncated or damaged file) are one line
    naming the checkpoint, not TensorFlow's IndexError or DataLossError."""

    def __init__(self, prefix: str):
        import tensorflow as tf

        self.prefix = prefix
        try:
            self._reader = tf.train.load_checkpoint(prefix)
        except (tf.errors.OpError, ValueError, IndexError) as e:
            raise _damaged(prefix, e) from None

    def has_tensor(self, key: str) -> bool:
        return self._reader.has_tensor(key)

    def get_variable_to_shape_map(self):
        return self._reader.get_variable_to_shape_map()

    def get_variable_to_dtype_map(self):
        return self._reader.get_variable_to_dtype_map()

    def get_tensor(self, key: str):
        import tensorflow as tf

        try:
            return self._reader.get_tensor(key)
        except (tf.errors.OpError, ValueError, IndexError) as e:
            raise _damaged(self.prefix, e, key) from None


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


# Bytes of tensors per SaveV2 call. A larger checkpoint is written in groups, each to its own
# temporary prefix, and merged by MergeV2Checkpoints (which moves data files, not tensors):
# memory stays near one group (twice: the read values and their tensors), not the model's size.
GROUP_BYTES = 64 << 20


def extend_checkpoint(src_prefix: str, dst_prefix: str, og: saved_object_graph_pb2.SavedObjectGraph,
                      group_bytes: Optional[int] = None) -> bool:
    """Write ``dst_prefix`` = the checkpoint at ``src_prefix`` plus zero-valued entries for the
    variables of ``og`` that it lacks, with its object graph extended to match ``og`` (node
    ids of the two graphs correspond), in groups of about ``group_bytes`` (default
    GROUP_BYTES). Returns False (and writes nothing) when nothing needed adding."""
    import tensorflow as tf

    reader = CheckpointReader(src_prefix)
    if not og.nodes or not reader.has_tensor(OBJECT_GRAPH_KEY):
        return False  # a TF1 checkpoint: nothing is added to it
    ckpt_graph = trackable_object_graph_pb2.TrackableObjectGraph()
    ckpt_graph.ParseFromString(reader.get_tensor(OBJECT_GRAPH_KEY))
    old = len(ckpt_graph.nodes)
    if old >= len(og.nodes):
        return False
    paths = _paths(og)
    shapes, dtypes = reader.get_variable_to_shape_map(), reader.get_variable_to_dtype_map()
    # (key, bytes (strings count none: their size is known once read), what makes the value when its group is written)
    entries: List[Tuple[str, int, Callable[[], np.ndarray]]] = [
        (key, int(np.prod(shapes[key])) * dtypes[key].size, functools.partial(reader.get_tensor, key))
        for key in sorted(shapes) if key != OBJECT_GRAPH_KEY]
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
            dims = [max(d.size, 0) for d in var.shape.dim]  # an unknown dimension starts empty (sparse rows)
            dtype = np.dtype(tf.dtypes.as_dtype(var.dtype).as_numpy_dtype)
            entries.append((key, int(np.prod(dims)) * dtype.itemsize, functools.partial(np.zeros, dims, dtype)))
    graph = ckpt_graph.SerializeToString(deterministic=True)
    entries.append((OBJECT_GRAPH_KEY, len(graph), functools.partial(np.array, graph, dtype=object)))
    limit = GROUP_BYTES if group_bytes is None else group_bytes
    groups: List[list] = [[]]
    size = 0
    for entry in entries:
        if groups[-1] and size + entry[1] > limit:
            groups.append([])
            size = 0
        groups[-1].append(entry)
        size += entry[1]
    parent = os.path.dirname(dst_prefix)
    os.makedirs(parent, exist_ok=True)
    parts = [dst_prefix]
    if len(groups) > 1:  # each part in its own directory, which the merge deletes
        parts = [os.path.join(parent, f".part-{k}", "part") for k in range(len(groups))]
    with tf.device("/cpu:0"):
        for prefix, group in zip(parts, groups):
            names = [key for key, _, _ in group]
            tensors = [tf.constant(make()) for _, _, make in group]
            tf.raw_ops.SaveV2(prefix=prefix, tensor_names=names, shape_and_slices=[""] * len(names), tensors=tensors)
            del tensors
        if len(parts) > 1:  # moves the parts' data files under dst_prefix
            tf.raw_ops.MergeV2Checkpoints(checkpoint_prefixes=parts, destination_prefix=dst_prefix,
                                          delete_old_dirs=True)
    return True
