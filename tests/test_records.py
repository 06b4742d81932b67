"""The typed records passes publish (vfgraph.records): the JSON they are stored as is exactly
what the passes wrote before they had a type, and records older versions wrote still read."""
import dataclasses
import json
import os

import pytest

from vfgraph import records
from vfgraph.records import Allreduce, Gradient, Microbatch, VirtualNodes

KINDS = (VirtualNodes, Allreduce, Microbatch)


def _stored(path):
    with open(os.path.join(path, "assets.extra", "vfgraph.json")) as f:
        return json.load(f)


def _same_types(a, b, where="record"):
    """``a`` and ``b`` are equal and hold values of the same types throughout (4 == 4.0 is not enough)."""
    assert type(a) is type(b), f"{where}: {type(a).__name__} vs {type(b).__name__}"
    if isinstance(a, dict):
        assert sorted(a) == sorted(b), f"{where}: keys {sorted(a)} vs {sorted(b)}"
        for k in a:
            _same_types(a[k], b[k], f"{where}.{k}")
    elif isinstance(a, list):
        assert len(a) == len(b), f"{where}: {len(a)} items vs {len(b)}"
        for k, (x, y) in enumerate(zip(a, b)):
            _same_types(x, y, f"{where}[{k}]")
    else:
        assert a == b, f"{where}: {a!r} vs {b!r}"


def test_saved_records_round_trip(rewritten):
    path = rewritten("mlp:adam", 4, 8)
    meta = _stored(path)
    for kind in KINDS:
        stored = meta["rewrites"][kind.PASS]
        assert stored, kind.PASS
        for key, d in stored.items():
            _same_types(kind.from_json(d).to_json(), d, f"{kind.PASS}.{key}")
        assert records.read(path, kind) == {k: kind.from_json(d) for k, d in stored.items()}
    vn = records.read(path, VirtualNodes)["train"]
    assert (vn.vnodes, vn.vnode_batch, vn.stepwise) == (4, 8, True)
    assert vn.gradients and all(isinstance(g, Gradient) and g.role == "gradient" for g in vn.gradients)
    assert records.read(path, Allreduce)["train"].broadcast_signature == "train_broadcast"
    assert records.read(path, Microbatch)["serving_default"].vnode_batch == 8


def test_records_in_memory_are_what_the_passes_wrote(models):
    """The records of a rewritten item, before it is saved: the same dicts and value types."""
    import vfgraph

    item = vfgraph.rewrite(models("mlp:adam"), vnodes=4, vnode_batch=8)
    for kind in KINDS:
        got = records.get(item, kind)
        assert got and set(got) == set(item.metadata["rewrites"][kind.PASS])
        for key, rec in got.items():
            _same_types(rec.to_json(), item.metadata["rewrites"][kind.PASS][key], f"{kind.PASS}.{key}")
    copy = {}
    for key, rec in records.get(item, VirtualNodes).items():
        records.put(copy, key, rec)
    assert copy["rewrites"][VirtualNodes.PASS] == item.metadata["rewrites"][VirtualNodes.PASS]


def test_record_pass_names_are_the_passes():
    from vfgraph.rewrites.insert_allreduce import InsertAllreducePass
    from vfgraph.rewrites.microbatch_inference import MicrobatchInferencePass
    from vfgraph.rewrites.split_vnodes import SplitVnodesPass

    assert VirtualNodes.PASS == SplitVnodesPass.name
    assert Allreduce.PASS == InsertAllreducePass.name
    assert Microbatch.PASS == MicrobatchInferencePass.name


def test_records_without_optional_keys(rewritten):
    """What earlier versions wrote: split-vnodes without seeds, step-wise signatures or reduce
    functions, micro-batching with one slice function and no executor."""
    meta = _stored(rewritten("mlp:adam", 4, 8))["rewrites"]
    vn = dict(meta[VirtualNodes.PASS]["train"])
    for k in ("per_vnode_seeds", "stepwise", "reduce_functions"):
        del vn[k]
    old = VirtualNodes.from_json(vn)
    assert (old.per_vnode_seeds, old.stepwise, old.reduce_functions) == ((), False, ())
    assert (old.function, old.vnodes, old.vnode_batch) == (vn["function"], 4, 8)
    assert [g.to_json() for g in old.gradients] == vn["gradients"]
    bare = VirtualNodes.from_json({"function": "f", "gradients": [{"tensor": "t:0", "shape": None}]})
    assert (bare.vnodes, bare.vnode_batch) == (1, 0)
    assert bare.gradients == (Gradient("t:0", None, "gradient", None),)

    mb = Microbatch.from_json({"function": "f", "slice_function": "g", "vnode_batch": 4})
    assert mb == Microbatch("f", 4, "", "", "default")

    ar = dict(meta[Allreduce.PASS]["train"])
    del ar["broadcast_signature"]
    assert Allreduce.from_json(ar).broadcast_signature is None


def test_no_records_without_rewrites(models):
    import vfgraph

    src = models("mlp:adam")
    item = vfgraph.load(src)
    for kind in KINDS:
        assert records.get(item, kind) == {}
        assert records.get(item.metadata, kind) == {}
        assert records.read(src, kind) == {}
    assert records.rewrites(item) == {}


def test_records_are_frozen_and_readers_use_them(rewritten):
    from vfgraph.io.savedmodel import added_signatures
    from vfgraph.runtime.train import vnode_layout

    path = rewritten("mlp:adam", 4, 8)
    rec = records.read(path, VirtualNodes)["train"]
    with pytest.raises(dataclasses.FrozenInstanceError):
        rec.vnodes = 2
    assert added_signatures(_stored(path)) == {"train_accumulate", "train_apply", "train_broadcast"}
    assert vnode_layout(path, "train") == (8, True)
