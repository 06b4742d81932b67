"""What a function traced by TensorFlow needs: argument specs, and the shapes it recorded."""
from __future__ import annotations

from tensorflow.core.framework import function_pb2, types_pb2

from vfgraph.ir.functions import arg_shape


def tf_dtype(enum: int):
    import tensorflow as tf

    return tf.dtypes.as_dtype(enum)


def arg_specs(fdef: function_pb2.FunctionDef) -> list:
    """TensorSpecs for ``fdef``'s arguments (resource args as scalar resource specs)."""
    import tensorflow as tf

    specs = []
    for a in fdef.signature.input_arg:
        if a.type == types_pb2.DT_RESOURCE:
            specs.append(tf.TensorSpec([], tf.resource))
            continue
        shape = arg_shape(fdef, a.name)
        dims = None if shape is None else [None if d < 0 else d for d in shape]
        specs.append(tf.TensorSpec(dims, tf_dtype(a.type)))
    return specs


def annotate_shapes(fdef: function_pb2.FunctionDef, graph) -> None:
    """Record each node's static output shapes (``_output_shapes``), as TensorFlow's own
    SavedModel export does, so later passes and ``inspect`` can read them."""
    ops = {op.name: op for op in graph.get_operations()}
    for node in fdef.node_def:
        op = ops.get(node.name)
        if op is None or not op.outputs or "_output_shapes" in node.attr:
            continue
        shapes = node.attr["_output_shapes"].list.shape
        for t in op.outputs:
            shapes.add().CopyFrom(t.shape.as_proto())
