"""Records are the contract between the layers: a pass writes only the records it declares
(the pass manager checks it), and what another layer reads of a rewrite (the step-wise and
broadcast signatures' keys) it reads from the record, not from a naming convention; the
architecture document's table of records is generated from the declarations."""
import ast
import json
import os
import shutil
import subprocess
import sys
from dataclasses import dataclass
from typing import ClassVar

import numpy as np
import pytest

from vfgraph import records
from vfgraph.errors import InternalError
from vfgraph.passes.base import Pass, PassResult
from vfgraph.passes.manager import PassManager
from vfgraph.records import Allreduce, Microbatch, Stages, VirtualNodes

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
MODEL = os.path.join(ROOT, "tests", "goldens", "split-vnodes", "linear_manual.before.pbtxt")


def _writer(toy_passes, pass_name: str, declared: tuple, stored_under: str = ""):
    """A pass ``pass_name`` declaring ``declared`` that writes a Microbatch record of the
    serving signature (under ``stored_under`` instead, when given)."""
    @toy_passes
    @dataclass(frozen=True)
    class Writer(Pass):
        """Write a record of the serving signature (a test's pass)."""

        name: ClassVar[str] = pass_name
        produces: ClassVar[tuple] = declared

        def call(self, item):
            sig = next(iter(item.inference_signatures()))
            rec = Microbatch(function=sig.function, vnode_batch=1)
            if stored_under:
                item.metadata.setdefault(records.REWRITES, {}).setdefault(stored_under, {})[sig.key] = rec.to_json()
            else:
                records.put(item, sig.key, rec)
            return PassResult(item, True, [])

    return Writer


def test_a_pass_writing_a_record_it_does_not_declare_fails_in_the_manager(toy_passes):
    import vfgraph

    item = vfgraph.load(MODEL)
    undeclared = _writer(toy_passes, "write-undeclared", (VirtualNodes,))
    with pytest.raises(InternalError) as e:
        PassManager([undeclared()]).run(item)
    assert "pass write-undeclared wrote the Microbatch record, which it does not declare it produces;" in str(e.value)
    assert not records.get(item, Microbatch)  # the caller's item as it was

    nameless = _writer(toy_passes, "write-nameless", (Microbatch,), stored_under="no-such-pass")
    with pytest.raises(InternalError, match="pass write-nameless wrote records under 'no-such-pass', which no "
                                            "record type"):
        PassManager([nameless()]).run(item)

    declared = _writer(toy_passes, "write-declared", (Microbatch,))
    out, _ = PassManager([declared()]).run(item)
    assert set(records.get(out, Microbatch)) == {next(iter(item.inference_signatures())).key}


def test_a_record_a_pass_fills_in_is_declared_beside_the_record():
    """split-vnodes writes the stage signatures into partition-stages' record: declared in
    records.py (``Stages.AMENDED_BY``), and no other pass may."""
    assert records.amended_by("split-vnodes") == (Stages,)
    assert records.amended_by("insert-allreduce") == records.amended_by("partition-stages") == ()
    assert [records.kind_of(k.PASS) for k in records.KINDS] == list(records.KINDS)
    assert records.kind_of("no-such-pass") is None


def test_split_vnodes_filling_in_the_stage_record_is_checked(models, monkeypatch):
    """The real case: stages on MPI ranks, where split-vnodes fills in partition-stages'
    record. Without its declaration the manager refuses it, naming the pass and the record."""
    import vfgraph

    item = vfgraph.load(models("mlp:momentum"))
    pipeline = "partition-stages{stages=2},split-vnodes{vnodes=4}"
    out = vfgraph.rewrite(item, pipeline=pipeline)
    assert records.get(out, Stages)["train"].signatures == ("train_stage_1", "train_stage_2")
    monkeypatch.setattr(Stages, "AMENDED_BY", ())
    with pytest.raises(InternalError, match=r"pass split-vnodes \(after partition-stages\) wrote the Stages record, "
                                            "which it does not declare it produces"):
        vfgraph.rewrite(item, pipeline=pipeline)


def test_stepwise_signature_keys_are_in_the_record(models):
    import vfgraph

    item = vfgraph.rewrite(models("mlp:momentum"), vnodes=4)
    stored = item.metadata[records.REWRITES][VirtualNodes.PASS]["train"]
    assert (stored["accumulate_signature"], stored["apply_signature"]) == ("train_accumulate", "train_apply")
    plain = vfgraph.rewrite(models("mlp:momentum"), pipeline="split-vnodes{vnodes=4,stepwise=false}")
    assert not {"accumulate_signature", "apply_signature"} & set(plain.metadata[records.REWRITES]["split-vnodes"]["train"])


def test_a_record_written_before_the_keys_were_recorded_derives_them_once():
    old = {"function": "f", "vnodes": 4, "stepwise": True, "gradients": []}
    got = records.get({records.REWRITES: {VirtualNodes.PASS: {"fit": old}}}, VirtualNodes)["fit"]
    assert (got.accumulate_signature, got.apply_signature) == ("fit_accumulate", "fit_apply")
    unstepped = records.get({records.REWRITES: {VirtualNodes.PASS: {"fit": dict(old, stepwise=False)}}}, VirtualNodes)
    assert unstepped["fit"].accumulate_signature == ""
    assert "accumulate_signature" not in unstepped["fit"].to_json()  # nothing new written for it


# ------------------------------------------------------------------ the readers read the record
def _rename_signatures(path: str, renames: dict) -> None:
    """Give signatures of the SavedModel ``path`` other keys (``renames``: old -> new): in its
    signature map, its object graph and vfgraph's records, as a model whose rewrite named
    them so would have them."""
    from tensorflow.core.protobuf import saved_model_pb2

    pb = os.path.join(path, "saved_model.pb")
    sm = saved_model_pb2.SavedModel()
    with open(pb, "rb") as f:
        sm.ParseFromString(f.read())
    mg = sm.meta_graphs[0]
    for old, new in renames.items():
        mg.signature_def[new].CopyFrom(mg.signature_def[old])
        del mg.signature_def[old]
    nodes = mg.object_graph_def.nodes
    (signatures,) = [c.node_id for c in nodes[0].children if c.local_name == "signatures"]
    for child in nodes[signatures].children:
        child.local_name = renames.get(child.local_name, child.local_name)
    with open(pb, "wb") as f:
        f.write(sm.SerializeToString())
    meta_path = os.path.join(path, records.METADATA_FILE)
    with open(meta_path) as f:
        meta = json.load(f)
    for rec in meta[records.REWRITES][Allreduce.PASS].values():
        rec["broadcast_signature"] = renames.get(rec["broadcast_signature"], rec["broadcast_signature"])
    for rec in meta[records.REWRITES][VirtualNodes.PASS].values():
        for k in ("accumulate_signature", "apply_signature"):
            rec[k] = renames.get(rec[k], rec[k])
    with open(meta_path, "w") as f:
        json.dump(meta, f, indent=1, sort_keys=True)


RENAMES = {"train_broadcast": "train_start", "train_accumulate": "train_add", "train_apply": "train_step_once"}


@pytest.fixture(scope="module")
def renamed(models, tmp_path_factory):
    """mlp:momentum rewritten with 8 virtual nodes of 8 and the all-reduce: as written, and
    with its added signatures under other keys."""
    import vfgraph

    root = tmp_path_factory.mktemp("renamed")
    plain, other = str(root / "plain"), str(root / "other")
    vfgraph.save(vfgraph.rewrite(models("mlp:momentum"), vnodes=8, vnode_batch=8, allreduce="mpi"), plain)
    shutil.copytree(plain, other)
    _rename_signatures(other, RENAMES)
    return plain, other


def test_load_and_inspect_read_the_added_signatures_from_the_record(renamed, capsys):
    import vfgraph
    from vfgraph import cli

    _, other = renamed
    from tensorflow.core.protobuf import saved_model_pb2

    sm = saved_model_pb2.SavedModel()
    with open(os.path.join(other, "saved_model.pb"), "rb") as f:
        sm.ParseFromString(f.read())
    assert set(RENAMES.values()) <= set(sm.meta_graphs[0].signature_def)
    assert not set(RENAMES) & set(sm.meta_graphs[0].signature_def)
    # recognised as the signatures the rewrite added, from the record: left out of the model's own
    assert set(vfgraph.load(other).signatures) == {"serving_default", "train"}
    capsys.readouterr()
    assert cli.main(["inspect", other]) == 0
    shown = capsys.readouterr().out
    assert "step-wise: signatures 'train_add' (repeat) and 'train_step_once'" in shown


@pytest.mark.mpi
def test_the_trainer_starts_the_ranks_from_the_broadcast_signature_the_record_names(renamed, digits, tmp_path):
    """Two ranks run the broadcast signature the record names (``train_start`` here, no
    ``train_broadcast`` in the model): the same parameters as one process."""
    plain, other = renamed
    env = dict(os.environ, TF_CPP_MIN_LOG_LEVEL="2", TF_ENABLE_ONEDNN_OPTS="0", OMP_NUM_THREADS="1")
    mpiexec = os.path.join(os.path.dirname(sys.executable), "mpiexec")
    outs = {}
    for label, launcher, model in (("one", [], plain), ("two", [mpiexec, "-n", "2"], other)):
        outs[label] = str(tmp_path / label)
        res = subprocess.run(launcher + [sys.executable, "-m", "vfgraph.cli", "train", model, "--data",
                                         digits["train"], "--steps", "3", "--batch-size", "64", "-o", outs[label],
                                         "--no-progress"], capture_output=True, text=True, env=env, timeout=300)
        assert res.returncode == 0, res.stderr[-3000:]
    import tensorflow as tf

    def params(path):
        loaded = tf.saved_model.load(path)  # (held while its variables are read)
        return {v.name: v.numpy() for v in loaded.signatures["train"].variables}

    got = {k: params(p) for k, p in outs.items()}
    assert sorted(got["one"]) == sorted(got["two"])
    for name, value in got["one"].items():
        np.testing.assert_allclose(got["two"][name], value, rtol=1e-6, atol=1e-7, err_msg=name)


def _suffixed_names(tree: ast.AST, suffixes) -> list:
    """Lines of ``tree`` that build a name as something + a suffix of ``suffixes``: an
    f-string whose text after a replacement field starts with one, or ``x + "suffix"``."""
    lines = []
    for node in ast.walk(tree):
        if isinstance(node, ast.JoinedStr):
            parts = node.values
            texts = [b.value for a, b in zip(parts, parts[1:])
                     if isinstance(a, ast.FormattedValue) and isinstance(b, ast.Constant)]
        elif isinstance(node, ast.BinOp) and isinstance(node.op, ast.Add) and isinstance(node.right, ast.Constant):
            texts = [node.right.value]
        else:
            continue
        if any(isinstance(t, str) and t.startswith(suffixes) for t in texts):
            lines.append(node.lineno)
    return lines


def test_no_reader_rebuilds_an_added_signature_name():
    """Outside records.py, nothing in vfgraph's package or passes builds a name with a suffix
    the rewrites give the signatures they add (f"{key}_broadcast", key + "_apply"): a reader
    takes the name from the record, a writer from the record type."""
    suffixes = ("_broadcast", "_accumulate", "_apply", "_stage_")
    found = []
    for top in ("vfgraph", "rewrites"):
        for dirpath, _, filenames in os.walk(os.path.join(ROOT, top)):
            for f in filenames:
                path = os.path.join(dirpath, f)
                if f.endswith(".py") and path != os.path.join(ROOT, "vfgraph", "records.py"):
                    with open(path) as source:
                        lines = _suffixed_names(ast.parse(source.read()), suffixes)
                    found += [f"{os.path.relpath(path, ROOT)}:{n}" for n in lines]
    assert not found, found
    assert _suffixed_names(ast.parse('a = f"{key}_broadcast"; b = key + "_apply"'), suffixes) == [1, 1]


def test_the_architecture_documents_records_table_is_generated():
    """docs/architecture.md holds what tools/architecture_doc.py writes from the declarations
    (run the script when a pass's or a record's declaration changes)."""
    import importlib.util

    spec = importlib.util.spec_from_file_location("architecture_doc", os.path.join(ROOT, "tools",
                                                                                   "architecture_doc.py"))
    tool = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(tool)
    with open(tool.DOC) as f:
        text = f.read()
    assert tool.render(text) == text, "docs/architecture.md is out of date: run python tools/architecture_doc.py"
    table = tool.table()
    assert "| `split-vnodes` | - | `VirtualNodes` | `Stages` | yes |" in table
    assert "| `insert-allreduce` | `VirtualNodes` | `Allreduce` | - | yes |" in table
    assert tool.render(text.replace(table, "| stale |\n")) == text
