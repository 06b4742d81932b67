"""TF1 MetaGraphDef + checkpoint: what ``tf.compat.v1.train.Saver().save`` leaves behind.

``saver.save(sess, "ckpt/model")`` writes ``model.meta`` (the graph, its collections and the
saver) beside the checkpoint ``model.index`` / ``model.data-*``. vfgraph reads either the
``.meta`` file or the checkpoint directory (its ``checkpoint`` file names the latest one) and
treats the pair as the TF1 SavedModel it is one step from: the same MetaGraph, the checkpoint
as its variables. Signatures the MetaGraph carries are kept; without a ``train`` signature
one is made from the ``train_op`` collection: its inputs are the placeholders the train op
depends on (keyed by placeholder name), its output ``loss`` is the tensor the optimizer
differentiated (found from the gradient graph, or named with ``loss=``), fetched after
the update as a TF1 loop fetches it (:mod:`vfgraph.io.trainop`).
"""
from __future__ import annotations

import os
import re
from typing import Optional

from google.protobuf import text_format
from google.protobuf.message import DecodeError
from tensorflow.core.protobuf import meta_graph_pb2, saved_model_pb2

from vfgraph.errors import InputError
from vfgraph.io import refvars, tf1
from vfgraph.io.checkpoint import checkpoint_files
from vfgraph.io.files import read_bytes
from vfgraph.io.trainop import add_train_signature, train_op_candidates


def is_checkpoint_dir(path: str) -> bool:
    return os.path.isdir(path) and os.path.isfile(os.path.join(path, "checkpoint"))


def is_meta_graph(path: str) -> bool:
    """Whether ``path`` is a TF1 MetaGraphDef: a ``.meta`` file, or a checkpoint directory."""
    return path.endswith(".meta") and os.path.isfile(path) or is_checkpoint_dir(path)


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


def load_meta_graph(path: str, checkpoint: Optional[str] = None, loss: str = ""):
    """A GraphItem for a .meta file (or checkpoint directory) and its checkpoint."""
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
    refvars.to_resource_variables(mg, meta)
    if "train" not in mg.signature_def and train_op_candidates(mg):
        add_train_signature(mg, meta, loss)
    if not [k for k in mg.signature_def if not k.startswith("__")]:
        raise InputError(f"{meta}: nothing to rewrite: no signatures and no 'train_op' collection; add the train "
                         "op with tf.compat.v1.add_to_collection('train_op', train_op) before saving")
    item = tf1.convert(sm, meta)
    item.variables_prefix = prefix
    return item
