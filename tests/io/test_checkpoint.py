"""The rewritten SavedModel's checkpoint: the source's variables plus zeroed accumulators,
written in bounded groups and merged into one checkpoint."""
import os

import numpy as np
import tensorflow as tf

import vfgraph
from vfgraph.io import checkpoint
from vfgraph.testing.compare import make_inputs


def _files(path):
    return {os.path.relpath(os.path.join(root, f), path): open(os.path.join(root, f), "rb").read()
            for root, _, files in os.walk(path) for f in files}


def test_a_checkpoint_written_in_groups_restores_like_one_written_at_once(models, tmp_path, monkeypatch):
    item = vfgraph.rewrite(models("mlp:adam"), vnodes=4, vnode_batch=8)
    whole = vfgraph.save(item, tmp_path / "whole")
    monkeypatch.setattr(checkpoint, "GROUP_BYTES", 4096)  # a few tensors per SaveV2 call
    grouped = [vfgraph.save(item, tmp_path / f"grouped{k}") for k in range(2)]
    shards = sorted(f for f in os.listdir(os.path.join(grouped[0], "variables")) if ".data-" in f)
    assert len(shards) > 3 and shards[0].endswith(f"-of-{len(shards):05d}")
    assert not [d for d in os.listdir(os.path.join(grouped[0], "variables")) if d.startswith(".part")]
    assert _files(grouped[0]) == _files(grouped[1])  # deterministic
    reader = tf.train.load_checkpoint(os.path.join(grouped[0], "variables", "variables"))
    want = tf.train.load_checkpoint(os.path.join(whole, "variables", "variables"))
    keys = want.get_variable_to_shape_map()
    assert reader.get_variable_to_shape_map() == keys and any("vf_accumulators" in k for k in keys)
    for k in keys:
        np.testing.assert_array_equal(reader.get_tensor(k), want.get_tensor(k), err_msg=k)
    loaded = tf.saved_model.load(grouped[0])  # stock TensorFlow restores every variable from it
    inputs = make_inputs(loaded.signatures["train_accumulate"], 8)
    assert np.isfinite(float(loaded.signatures["train_accumulate"](**inputs)["loss"]))
    assert loaded.signatures["train_apply"]() == {}
