"""TF1 MetaGraphDef + checkpoint: what ``tf.compat.v1.train.Saver().save`` leaves behind.

``saver.save(sess, "ckpt/model")`` writes ``model.meta`` (the graph, its collections and the
saver) beside the checkpoint ``model.index`` / ``model.data-*``. vfgraph reads either the
``.meta`` file or the checkpoint directory (its ``checkpoint`` file names the latest one) and
treats the pair as the TF1 SavedModel it is one step from: the same MetaGraph, the checkpoint
as its variables. Signatures the MetaGraph carries are kept; without a ``train`` signature
one is made from the ``train_op`` collection: its inputs are the placeholders the train op
depends on (keyed by placeholder name), its output ``loss`` is the tensor the optimizer
differentiated (found from the gradient graph, or named with ``loss=``), fetched after
the update as a TF1 loop fetches it.
"""
from __future__ import annotations

import glob
import os
import re
from typing import Dict, Iterable, List, Optional

from google.protobuf.message import DecodeError
from tensorflow.core.protobuf import meta_graph_pb2, saved_model_pb2

from vfgraph.errors import DetectionError, InputError

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


def is_checkpoint_dir(path: str) -> bool:
    return os.path.isdir(path) and os.path.isfile(os.path.join(path, "checkpoint"))


def meta_path_of(path: str) -> str:
    """The .meta file for ``path``: itself, or the latest checkpoint's in a checkpoint directory."""
    if not os.path.isdir(path):
        return path
    ckpt = os.path.join(path, "checkpoint")
    prefix = ""
    with open(ckpt) as f:
        for line in f:
            m = re.match(r'\s*model_checkpoint_path:\s*"(.*)"\s*$', line)
            if m:
                prefix = m.group(1)
                break
    if not prefix:
        raise InputError(f"{ckpt}: names no checkpoint (no model_checkpoint_path line); give the .meta file")
    if not os.path.isabs(prefix):
        prefix = os.path.join(path, prefix)
    if not os.path.isfile(prefix + ".meta"):
        raise InputError(f"{prefix}.meta: the latest checkpoint has no MetaGraph; save with "
                         "tf.compat.v1.train.Saver().save (write_meta_graph=True) or give the .meta file")
    return prefix + ".meta"


def read_meta_graph(path: str) -> meta_graph_pb2.MetaGraphDef:
    """Parse a .meta file, binary or text (export_meta_graph(as_text=True))."""
    from google.protobuf import text_format

    from vfgraph.io.savedmodel import read_bytes

    data = read_bytes(path)
    mg = meta_graph_pb2.MetaGraphDef()
    try:
        mg.ParseFromString(data)
    except (DecodeError, RuntimeError, ValueError):
        try:
            text_format.Parse(data.decode("utf-8"), mg)
        except (text_format.ParseError, UnicodeDecodeError, ValueError) as e:
            raise InputError(f"{path}: not a MetaGraphDef, binary or text ({str(e).splitlines()[0][:160]}); "
                             "give the .meta file tf.compat.v1.train.Saver().save wrote") from None
    if not mg.graph_def.node:
        raise InputError(f"{path}: the MetaGraphDef holds no graph; give the .meta file "
                         "tf.compat.v1.train.Saver().save wrote")
    return mg


def checkpoint_files(prefix: str) -> List[str]:
    """The files of the checkpoint at ``prefix`` (index first, then data shards)."""
    return [prefix + ".index"] + sorted(glob.glob(glob.escape(prefix) + ".data-*"))


def load_meta_graph(path: str, checkpoint: Optional[str] = None, loss: str = ""):
    """A GraphItem for a .meta file (or checkpoint directory) and its checkpoint."""
    from vfgraph.io import tf1

    meta = os.path.abspath(meta_path_of(path))
    prefix = os.path.abspath(checkpoint) if checkpoint else meta[:-len(".meta")]
    if not os.path.isfile(prefix + ".index"):
        raise InputError(f"{prefix}.index: no checkpoint beside {os.path.basename(meta)}; give its prefix "
                         "with --checkpoint (the path saver.save returned)")
    if len(checkpoint_files(prefix)) < 2:
        raise InputError(f"{prefix}: checkpoint has an index but no data files (.data-*); copy the whole checkpoint")
    mg = read_meta_graph(meta)
    if not mg.HasField("saver_def"):
        raise InputError(f"{meta}: the MetaGraph has no saver, so its checkpoint cannot be restored; export it "
                         "with tf.compat.v1.train.Saver().save")
    sm = saved_model_pb2.SavedModel(saved_model_schema_version=1)
    sm.meta_graphs.add().CopyFrom(mg)
    mg = sm.meta_graphs[0]
    if not mg.meta_info_def.tags:
        mg.meta_info_def.tags.append("serve")
    from vfgraph.io import refvars

    refvars.to_resource_variables(mg, meta)
    if "train" not in mg.signature_def and train_op_candidates(mg):
        _add_train_signature(mg, meta, loss)
    if not [k for k in mg.signature_def if not k.startswith("__")]:
        raise InputError(f"{meta}: nothing to rewrite: no signatures and no 'train_op' collection; add the train "
                         "op with tf.compat.v1.add_to_collection('train_op', train_op) before saving")
    item = tf1.convert(sm, meta)
    item.variables_prefix = prefix
    return item


def _add_train_signature(mg, where: str, loss: str) -> None:
    """Signature 'train' over the train_op collection's op: placeholders in, loss out."""
    gd = mg.graph_def
    nodes = {n.name: n for n in gd.node}
    train_op = find_train_op(mg, nodes, where)
    upstream = ancestors(nodes, [train_op])
    if loss:
        loss_tensor = loss if ":" in loss else loss + ":0"
        if loss_tensor.split(":")[0] not in nodes:
            raise InputError(f"{where}: --loss names missing node {loss_tensor.split(':')[0]!r}")
    else:
        loss_tensor = _find_loss(nodes, upstream, where)
    placeholders = sorted(n for n in upstream | ancestors(nodes, [loss_tensor.split(":")[0]])
                          if nodes[n].op == "Placeholder")
    if not placeholders:
        raise DetectionError(f"{where}: the train op {train_op!r} reads no placeholder; vfgraph needs the batch "
                             "fed through placeholders (graphs reading a tf.data iterator are not supported)")
    loss_node = nodes[loss_tensor.split(":")[0]]
    out = _after(gd, TRAIN_LOSS_NODE, loss_tensor, train_op,
                 _output_dtype(loss_node, int(loss_tensor.split(":")[1]), where))
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
            names.update(v.split(":")[0].lstrip("^") for v in mg.collection_def[key].node_list.value)
    if TRAIN_OP_SIGNATURE in mg.signature_def:
        names.update(t.name.split(":")[0].lstrip("^") for t in mg.signature_def[TRAIN_OP_SIGNATURE].outputs.values())
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
    if not outputs or any(not re.fullmatch(r"[^:^]+(:\d+)?", t.name) or t.name.split(":")[0] not in nodes
                          for _, t in outputs):
        return False  # converting the signature names what is wrong with it
    upstream = ancestors(nodes, [t.name.split(":")[0] for _, t in outputs])
    if any(nodes[n].op.startswith(_WRITE_PREFIXES) for n in upstream):
        return False
    train_op = find_train_op(mg, nodes, where)
    if train_op is None:
        return False
    feeds = {t.name.split(":")[0] for t in sig.inputs.values()}
    reads = {n for n in ancestors(nodes, [train_op]) if nodes[n].op == "Placeholder"}
    if not reads & feeds:
        return False  # a train op over other inputs: not this signature's step
    if reads - feeds:
        raise DetectionError(f"{where}: signature {key!r} computes no variable update, and the train op {train_op!r} "
                             f"reads placeholders that are not its inputs ({', '.join(sorted(reads - feeds))}); add "
                             "them to the signature's inputs so that it runs the training step")
    for out_key, t in outputs:
        name = t.name if ":" in t.name else t.name + ":0"
        dtype = t.dtype or _output_dtype(nodes[name.split(":")[0]], int(name.split(":")[1]), where)
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


def ancestors(nodes, roots: Iterable[str]) -> set:
    """Names of ``roots`` and every node they depend on (data and control inputs)."""
    seen, stack = set(), list(roots)
    while stack:
        n = stack.pop()
        if n in seen or n not in nodes:
            continue
        seen.add(n)
        stack.extend(s.lstrip("^").split(":")[0] for s in nodes[n].input)
    return seen


def _find_loss(nodes, ancestors, where: str) -> str:
    """The tensor tf.gradients differentiated. Its initial gradient is a ``grad_ys_N`` Fill;
    the Fill reads ``Shape(loss)`` when the loss's shape is not static, and the ops that
    consume it sit in the name scope ``.../gradients/<loss op>_grad/``."""
    consumers: Dict[str, List[str]] = {}
    for n in sorted(ancestors):
        for s in nodes[n].input:
            consumers.setdefault(s.split(":")[0], []).append(n)
    losses = set()
    for n in sorted(ancestors):
        node = nodes[n]
        if node.op != "Fill" or not _GRAD_YS.search(n) or not node.input:
            continue
        shape = nodes.get(node.input[0].split(":")[0])
        if shape is not None and shape.op == "Shape" and shape.input:
            losses.add(shape.input[0] if ":" in shape.input[0] else shape.input[0] + ":0")
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
    from vfgraph.ir.graph import output_layout

    try:
        return output_layout(node, {})[index][2]
    except (IndexError, KeyError, ValueError) as e:
        raise InputError(f"{where}: cannot type output {index} of {node.name!r} ({e})") from None
