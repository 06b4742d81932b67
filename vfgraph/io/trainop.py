"""The train op of a TF1 graph: where TF1 code leaves it, what it reads, the loss it minimises.

TF1 code runs its training step as an op beside the loss (``sess.run([train_op, loss])``)
and leaves it in a collection or a signature. The loaders of TF1 graphs
(:mod:`vfgraph.io.metagraph` for a ``.meta`` file and its checkpoint, :mod:`vfgraph.io.tf1`
for a TF1 SavedModel) find it here, make a ``train`` signature over it when the graph has
none (:func:`add_train_signature`), and attach it to a training signature that computes no
variable update (:func:`attach_train_op`).
"""
from __future__ import annotations

import re
from typing import Dict, List, Optional

from vfgraph.errors import DetectionError, InputError
from vfgraph.ir.functions import output_layout
from vfgraph.ir.names import data_inputs, is_tensor_name, tensor_index, tensor_name, tensor_node
from vfgraph.ir.walk import ancestors

TRAIN_LOSS_NODE = "vf/train_loss"
# Where TF1 code leaves its train op: tf.compat.v1.GraphKeys.TRAIN_OP (opt.minimize adds to it),
# SavedModel's constants.TRAIN_OP_KEY collection, and constants.TRAIN_OP_SIGNATURE_KEY (what
# tf.compat.v1.saved_model.loader's get_train_op reads first).
TRAIN_OP_COLLECTIONS = ("train_op", "saved_model_train_op")
TRAIN_OP_SIGNATURE = "__saved_model_train_op"
# variable writes (resource forms; reference variables are converted before these are read)
_WRITE_PREFIXES = ("Assign", "ResourceApply", "ResourceSparseApply", "ResourceScatter", "ResourceStridedSliceAssign")
_GRAD_YS = re.compile(r"(^|/)grad_ys_\d+$")
_GRAD_SCOPE = re.compile(r"(^|/)gradients(?:_\d+)?/(.+?)_grad/")


def add_train_signature(mg, where: str, loss: str) -> None:
    """Signature 'train' over the train_op collection's op: placeholders in, loss out."""
    gd = mg.graph_def
    nodes = {n.name: n for n in gd.node}
    train_op = find_train_op(mg, nodes, where)
    upstream = ancestors(nodes, [train_op])
    if loss:
        loss_tensor = tensor_name(loss)
        if not is_tensor_name(loss_tensor, indexed=True):
            raise InputError(f"{where}: --loss {loss!r} is not a tensor name (NODE or NODE:INDEX)")
        if tensor_node(loss_tensor) not in nodes:
            raise InputError(f"{where}: --loss names missing node {tensor_node(loss_tensor)!r}")
    else:
        loss_tensor = _find_loss(nodes, upstream, where)
    placeholders = sorted(n for n in upstream | ancestors(nodes, [tensor_node(loss_tensor)])
                          if nodes[n].op == "Placeholder")
    if not placeholders:
        raise DetectionError(f"{where}: the train op {train_op!r} reads no placeholder; vfgraph needs the batch "
                             "fed through placeholders (graphs reading a tf.data iterator are not supported)")
    loss_node = nodes[tensor_node(loss_tensor)]
    out = _after(gd, TRAIN_LOSS_NODE, loss_tensor, train_op, _output_dtype(loss_node, tensor_index(loss_tensor), where))
    sig = mg.signature_def["train"]
    sig.method_name = "tensorflow/serving/predict"
    for p in placeholders:
        t = sig.inputs[p]
        t.name = p + ":0"
        t.dtype = nodes[p].attr["dtype"].type
        t.tensor_shape.CopyFrom(nodes[p].attr["shape"].shape)
    o = sig.outputs["loss"]
    o.name = TRAIN_LOSS_NODE + ":0"
    o.dtype = out.attr["T"].type
    o.tensor_shape.SetInParent()


def train_op_candidates(mg) -> List[str]:
    """Names of the ops TF1 code marked as its train op (collections and signature), sorted."""
    names = set()
    for key in TRAIN_OP_COLLECTIONS:
        if key in mg.collection_def:
            names.update(tensor_node(v) for v in mg.collection_def[key].node_list.value)
    if TRAIN_OP_SIGNATURE in mg.signature_def:
        names.update(tensor_node(t.name) for t in mg.signature_def[TRAIN_OP_SIGNATURE].outputs.values())
    return sorted(n for n in names if n)


def find_train_op(mg, nodes, where: str) -> Optional[str]:
    """The op that runs the training step: the one train-op candidate, or of several the one
    that runs all the others (``tf.group(minimize, ema_apply)`` in ``saved_model_train_op``
    beside the minimize op that ``opt.minimize`` left in ``train_op``); None without any."""
    ops = train_op_candidates(mg)
    if not ops:
        return None
    for op in ops:
        if op not in nodes:
            raise InputError(f"{where}: the train op collections ({', '.join(TRAIN_OP_COLLECTIONS)}) name missing "
                             f"node {op!r}")
    if len(ops) == 1:
        return ops[0]
    covering = [op for op in ops if set(ops) <= ancestors(nodes, [op])]
    if len(covering) != 1:
        raise DetectionError(f"{where}: the train op collections hold {len(ops)} ops ({', '.join(ops)}) and none "
                             "runs all the others; vfgraph needs one train op (group them with tf.group)")
    return covering[0]


def attach_train_op(mg, key: str, where: str) -> bool:
    """Make training signature ``key`` run the train op when it computes no variable update.

    TF1 code often exports a 'train' signature whose outputs are only the loss, the update
    being the op a TF1 loop runs beside it (``sess.run([train_op, loss])``). When the train op
    reads the placeholders the signature's inputs name (and no other), each output of the
    signature is replaced by an ``Identity`` of it with a control dependency on the train op:
    the values returned are the same, and the signature is the training step. Returns whether
    the signature was changed."""
    sig = mg.signature_def[key]
    gd = mg.graph_def
    nodes = {n.name: n for n in gd.node}
    outputs = sorted(sig.outputs.items())
    if not outputs or any(not is_tensor_name(t.name) or tensor_node(t.name) not in nodes for _, t in outputs):
        return False  # converting the signature names what is wrong with it
    upstream = ancestors(nodes, [tensor_node(t.name) for _, t in outputs])
    if any(nodes[n].op.startswith(_WRITE_PREFIXES) for n in upstream):
        return False
    train_op = find_train_op(mg, nodes, where)
    if train_op is None:
        return False
    feeds = {tensor_node(t.name) for t in sig.inputs.values()}
    reads = {n for n in ancestors(nodes, [train_op]) if nodes[n].op == "Placeholder"}
    if not reads & feeds:
        return False  # a train op over other inputs: not this signature's step
    if reads - feeds:
        raise DetectionError(f"{where}: signature {key!r} computes no variable update, and the train op {train_op!r} "
                             f"reads placeholders that are not its inputs ({', '.join(sorted(reads - feeds))}); add "
                             "them to the signature's inputs so that it runs the training step")
    for out_key, t in outputs:
        name = tensor_name(t.name)
        dtype = t.dtype or _output_dtype(nodes[tensor_node(name)], tensor_index(name), where)
        node_name = f"vf/{key}_{re.sub(r'[^A-Za-z0-9_.]', '_', out_key)}"
        while node_name in nodes:
            node_name += "_"
        nodes[node_name] = _after(gd, node_name, name, train_op, dtype)
        t.name = node_name + ":0"
    return True


def _after(gd, name: str, tensor: str, op: str, dtype: int):
    """A node ``name`` of ``gd`` returning ``tensor`` once ``op`` has run."""
    out = gd.node.add(name=name, op="Identity", input=[tensor, "^" + op])
    out.attr["T"].type = dtype
    return out


def _find_loss(nodes, ancestors, where: str) -> str:
    """The tensor tf.gradients differentiated. Its initial gradient is a ``grad_ys_N`` Fill;
    the Fill reads ``Shape(loss)`` when the loss's shape is not static, and the ops that
    consume it sit in the name scope ``.../gradients/<loss op>_grad/``."""
    consumers: Dict[str, List[str]] = {}
    for n in sorted(ancestors):
        for s in data_inputs(nodes[n]):
            consumers.setdefault(tensor_node(s), []).append(n)
    losses = set()
    for n in sorted(ancestors):
        node = nodes[n]
        if node.op != "Fill" or not _GRAD_YS.search(n) or not node.input:
            continue
        shape = nodes.get(tensor_node(node.input[0]))
        if shape is not None and shape.op == "Shape" and shape.input:
            losses.add(tensor_name(shape.input[0]))
            continue
        for c in consumers.get(n, []):
            for m in _GRAD_SCOPE.finditer(c):
                if m.group(2) in nodes:
                    losses.add(m.group(2) + ":0")
                    break
    found = sorted(losses)
    if len(found) != 1:
        what = "no gradient computation" if not found else f"{len(found)} differentiated tensors ({', '.join(found)})"
        raise DetectionError(f"{where}: cannot tell the loss of the train op: {what}; name it with --loss TENSOR")
    return found[0]


def _output_dtype(node, index: int, where: str) -> int:
    try:
        return output_layout(node, {})[index][2]
    except (IndexError, KeyError, ValueError) as e:
        raise InputError(f"{where}: cannot type output {index} of {node.name!r} ({e})") from None
