"""Serving exports (`vfgraph export`, `vfgraph.export`, the one `vfgraph train` writes beside its
model): loaded and run by stock TensorFlow in processes that never import vfgraph, through
Python's `tf.saved_model.load` and through the C API's `TF_LoadSessionFromSavedModel` (the C++
loader TF Serving uses), equal to the source model's serving output on a real batch."""
import json
import os
import re
import shutil
import subprocess
import sys

import numpy as np
import pytest
import tensorflow as tf
from tensorflow.core.protobuf import saved_model_pb2
from tensorflow.python.framework import op_def_registry

import vfgraph
from vfgraph.io import checkpoint
from vfgraph.testing import c_api, cli
from vfgraph.testing.cli import error_line, tree_digest
from vfgraph.ir.functions import function_dependencies, iter_func_attrs

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
ENV = {k: v for k, v in os.environ.items() if not k.startswith("PYTHON")}
ENV.update(TF_CPP_MIN_LOG_LEVEL="3", TF_ENABLE_ONEDNN_OPTS="0")
BATCH = 37  # not a multiple of any slice size used here

# exported from: an original tf.Module holding a Keras 3 model, the same sliced by the export, rewritten
# models with and without the all-reduce, a batch-norm CNN, a Keras model.export(), a trained model
CASES = ["mlp", "mlp-sliced", "mlp-allreduce", "mlp-no-allreduce", "cnn-allreduce", "keras-export", "trained"]


def read_proto(path):
    sm = saved_model_pb2.SavedModel()
    with open(os.path.join(path, "saved_model.pb"), "rb") as f:
        sm.ParseFromString(f.read())
    return sm


def serving_key(path):
    keys = sorted(k for k in read_proto(path).meta_graphs[0].signature_def if not k.startswith("__"))
    return "serving_default" if "serving_default" in keys else keys[0]


@pytest.fixture(scope="module")
def batch(digits):
    with np.load(digits["test"]) as z:
        return np.ascontiguousarray(z["x"][:BATCH], dtype=np.float32)


@pytest.fixture(scope="module")
def exports(models, rewritten, digits, tmp_path_factory):
    """case -> (source model, export directory DIR/1, the model whose serving output it equals)."""
    root = tmp_path_factory.mktemp("serving")
    mpi = rewritten("mlp:adam", 4, 8)
    cnn = rewritten("cnn:momentum", 4, 8)
    for m in (mpi, cnn):  # the all-reduce is really in the training step these exports drop
        assert "insert-allreduce" in vfgraph.load(m).metadata["rewrites"]
    none = str(root / "mlp_none")
    vfgraph.save(vfgraph.rewrite(models("mlp:adam"), vnodes=4, vnode_batch=8, allreduce="none"), none)
    sources = {"mlp": (models("mlp:adam"), 0), "mlp-sliced": (models("mlp:adam"), 8), "mlp-allreduce": (mpi, 0),
               "mlp-no-allreduce": (none, 0), "cnn-allreduce": (cnn, 0), "keras-export": (models("keras-export"), 0)}
    made = {}
    for case, (src, b) in sources.items():
        original = models("cnn:momentum") if case.startswith("cnn") else \
            models("keras-export") if case == "keras-export" else models("mlp:adam")
        made[case] = (src, vfgraph.export(src, root / case, vnode_batch=b), original)
    # `vfgraph train` writes OUT and, beside it, OUT.serving/1
    trained = root / "trained"
    res = subprocess.run([sys.executable, "-m", "vfgraph.cli", "train", mpi, "--data", digits["train"], "--steps", "2",
                          "--batch-size", "32", "-o", trained, "--no-progress"], capture_output=True, text=True,
                         env=ENV, timeout=300)
    assert res.returncode == 0, res.stderr
    serve = f"{trained}.serving{os.sep}1"
    assert f"to serve, {serve}" in res.stdout, res.stdout
    made["trained"] = (str(trained), serve, str(trained))
    return made


@pytest.fixture(scope="module")
def expected(exports, batch):
    """case -> {output name: the serving output of the model the case must equal} (in this
    process, which has vfgraph)."""
    out = {}
    for case, (_, path, original) in exports.items():
        fn = tf.saved_model.load(original).signatures[serving_key(path)]
        (arg,) = fn.structured_input_signature[1]
        out[case] = {k: v.numpy() for k, v in fn(**{arg: tf.constant(batch)}).items()}
    return out


FRESH = r"""
import json, os, sys
import numpy as np
import tensorflow as tf
root, batch_file, out_file = sys.argv[1:4]
cases = json.loads(sys.argv[4])
assert not any(p and os.path.abspath(p) == root for p in sys.path), sys.path
batch = np.load(batch_file)
results, signatures = {}, {}
for case, path in cases.items():
    loaded = tf.saved_model.load(path)
    signatures[case] = sorted(loaded.signatures)
    key = "serving_default" if "serving_default" in loaded.signatures else signatures[case][0]
    fn = loaded.signatures[key]
    (arg,) = fn.structured_input_signature[1]
    for k, v in fn(**{arg: tf.constant(batch)}).items():
        results[case + "/" + k] = v.numpy()
np.savez(out_file, **results)
ours = sorted(m for m in sys.modules if m.split(".")[0] == "vfgraph")
with open("/proc/self/maps") as f:
    libs = sorted({line.split()[-1] for line in f if "vfgraph" in line})
print(json.dumps({"vfgraph_modules": ours, "vfgraph_libraries": libs, "signatures": signatures}))
"""


@pytest.fixture(scope="module")
def fresh(exports, batch, tmp_path_factory):
    """One fresh interpreter (isolated: no PYTHON* variables, no script directory on sys.path,
    started outside the repository) that loads every export with tf.saved_model.load and runs
    its serving signature on the batch."""
    d = tmp_path_factory.mktemp("fresh")
    np.save(d / "batch.npy", batch)
    res = subprocess.run([sys.executable, "-I", "-c", FRESH, ROOT, str(d / "batch.npy"), str(d / "out.npz"),
                          json.dumps({c: p for c, (_, p, _) in exports.items()})],
                         capture_output=True, text=True, env=ENV, cwd=d, timeout=300)
    assert res.returncode == 0, res.stderr[-3000:]
    report = json.loads(res.stdout.strip().splitlines()[-1])
    with np.load(d / "out.npz") as z:
        report["outputs"] = {k: z[k] for k in z.files}
    return report


def run_c_client(exe, path, batch, tmp_path):
    """Serve ``batch`` from ``path`` through the C API; the tensor names come from the
    serving signature_def. Returns {output key: array}."""
    key = serving_key(path)
    ((name, _),) = read_proto(path).meta_graphs[0].signature_def[key].inputs.items()
    return c_api.serve(exe, path, {name: batch.astype(np.float32)}, key, env=ENV)


@pytest.mark.parametrize("case", CASES)
def test_tf_saved_model_load_without_vfgraph(case, fresh, expected):
    assert fresh["vfgraph_modules"] == [] and fresh["vfgraph_libraries"] == []
    want = expected[case]
    got = {k.split("/", 1)[1]: v for k, v in fresh["outputs"].items() if k.split("/", 1)[0] == case}
    assert sorted(got) == sorted(want)
    for k in want:
        assert got[k].shape == want[k].shape == (BATCH, 10)
        np.testing.assert_allclose(got[k], want[k], rtol=0, atol=1e-6, err_msg=f"{case}: {k}")
    assert not [s for s in fresh["signatures"][case] if s.startswith("train")]


@pytest.mark.parametrize("case", CASES)
def test_c_api_loads_and_serves(case, exports, expected, batch, c_client, tmp_path):
    """TF_LoadSessionFromSavedModel (tag serve) restores every variable through the saver's
    restore op and runs the signature's tensors; a Keras 3 model inside a tf.Module included."""
    got = run_c_client(c_client, exports[case][1], batch, tmp_path)
    want = expected[case]
    assert sorted(got) == sorted(want)
    for k in want:
        np.testing.assert_allclose(got[k], want[k], rtol=0, atol=1e-6, err_msg=f"{case}: {k}")


def _reached(graph_def, names):
    lib = {f.signature.name: f for f in graph_def.library.function}
    found = set()
    for node in graph_def.node:
        if node.name in names:
            for fa in iter_func_attrs(node):
                found.update(function_dependencies(fa.name, lib))
    return found


@pytest.mark.parametrize("case", ["mlp-allreduce", "cnn-allreduce", "mlp-no-allreduce", "trained"])
def test_export_holds_only_serving(case, exports):
    src, path, _ = exports[case]
    src_mg, mg = read_proto(src).meta_graphs[0], read_proto(path).meta_graphs[0]
    assert list(mg.meta_info_def.tags) == ["serve"] and len(read_proto(path).meta_graphs) == 1
    # no op of vfgraph's, none unknown to stock TensorFlow, anywhere in the graph or the library
    lib = {f.signature.name for f in mg.graph_def.library.function}
    ops = {n.op for n in mg.graph_def.node} | {n.op for f in mg.graph_def.library.function for n in f.node_def}
    assert not [op for op in ops - lib if op.startswith("Vf") or op_def_registry.get(op) is None]
    assert case == "mlp-no-allreduce" or any(n.op.startswith("Vf") for f in src_mg.graph_def.library.function
                                             for n in f.node_def)
    # the library is what the serving signatures reach in the source, nothing of training
    def call_nodes(meta, keys):
        return {t.name.split(":")[0] for k in keys for t in meta.signature_def[k].outputs.values()}

    serving = [k for k in mg.signature_def if not k.startswith("__")]
    training = [k for k in src_mg.signature_def if k.startswith("train")]
    assert serving == ["serving_default"] and training
    assert lib == _reached(src_mg.graph_def, call_nodes(src_mg, serving))
    assert not lib & (_reached(src_mg.graph_def, call_nodes(src_mg, training)) - lib)
    assert not mg.graph_def.library.gradient
    # the checkpoint holds the variables the serving call reads, each behind one graph handle
    (call,) = [n for n in mg.graph_def.node if n.name in call_nodes(mg, serving)]
    handles = {n.name: n for n in mg.graph_def.node if n.op == "VarHandleOp"}
    reads = [i for i in call.input if i in handles]
    reader = tf.train.load_checkpoint(os.path.join(path, "variables", "variables"))
    keys = set(reader.get_variable_to_shape_map()) - {checkpoint.OBJECT_GRAPH_KEY}
    assert len(keys) == len(reads) == len(handles) == len({h.attr["shared_name"].s for h in handles.values()})
    names = [n.variable.name for n in mg.object_graph_def.nodes if n.WhichOneof("kind") == "variable"]
    assert len(names) == len(keys) and not [n for n in names if re.search(
        r"adam|sgd|momentum|velocit|accumulat|iteration|learning_rate", n)], names
    assert mg.saver_def.restore_op_name and mg.saver_def.filename_tensor_name


def test_export_is_deterministic_and_leaves_its_input_alone(exports, tmp_path, monkeypatch):
    src = exports["mlp-allreduce"][0]
    before = tree_digest(src)
    a = vfgraph.export(src, tmp_path / "a", version=3)
    b = vfgraph.export(vfgraph.load(src), tmp_path / "b", version=3)  # a loaded model: the same bytes
    assert a.endswith(os.path.join("a", "3")) and tree_digest(a) == tree_digest(b)
    assert tree_digest(exports["mlp-allreduce"][1]) == tree_digest(a)  # version 1 of the same model
    sliced = vfgraph.export(exports["mlp"][0], tmp_path / "s", vnode_batch=8)
    assert tree_digest(sliced) == tree_digest(exports["mlp-sliced"][1])
    assert tree_digest(src) == before
    assert sorted(os.listdir(tmp_path / "a")) == ["3"]  # no temporary directory left
    # a checkpoint written in groups (one SaveV2 each, merged) holds the same values
    monkeypatch.setattr(checkpoint, "GROUP_BYTES", 1024)
    grouped = [vfgraph.export(src, tmp_path / f"g{k}") for k in range(2)]
    assert tree_digest(grouped[0]) == tree_digest(grouped[1])
    shards = [f for f in os.listdir(os.path.join(grouped[0], "variables")) if ".data-" in f]
    assert len(shards) > 2
    r, want = (tf.train.load_checkpoint(os.path.join(p, "variables", "variables")) for p in (grouped[0], a))
    assert r.get_variable_to_shape_map() == want.get_variable_to_shape_map()
    for k in want.get_variable_to_shape_map():
        np.testing.assert_array_equal(r.get_tensor(k), want.get_tensor(k))


def test_saved_model_cli_shows_export(exports):
    cli = shutil.which("saved_model_cli", path=os.path.dirname(sys.executable)) or "saved_model_cli"
    show = subprocess.run([cli, "show", "--dir", exports["mlp-allreduce"][1], "--all"], capture_output=True,
                          text=True, env=ENV, timeout=300)
    assert show.returncode == 0, show.stderr[-2000:]
    assert "signature_def['serving_default']" in show.stdout and "signature_def['train" not in show.stdout


def vf(*args):
    return cli.vf(*args, env=ENV)


def test_cli_export_and_its_errors(models, tmp_path):
    res = vf("export", tmp_path / "missing", "-o", tmp_path / "out")
    assert res.returncode == 2 and "missing: no such file or directory" in error_line(res)
    assert not (tmp_path / "out").exists()
    vfgraph.export(models("mlp:adam"), tmp_path / "out", version=2)
    before = tree_digest(tmp_path / "out")
    res = vf("export", models("mlp:adam"), "-o", tmp_path / "out", "--version", 2, "--vnode-batch", 8)
    assert res.returncode == 2 and "version 2 exists" in error_line(res) and "--force" in error_line(res)
    assert tree_digest(tmp_path / "out") == before
    res = vf("export", models("mlp:adam"), "-o", tmp_path / "out", "--version", 2, "--vnode-batch", 8, "--force")
    assert res.returncode == 0, res.stderr
    assert res.stdout.strip() == f"wrote {tmp_path / 'out' / '2'} (serving only: serving_default (slices of 8))"
    assert sorted(os.listdir(tmp_path / "out")) == ["2"] and tree_digest(tmp_path / "out") != before


def test_api_errors(models, tmp_path):
    with pytest.raises(vfgraph.VfgraphError, match="lies inside the input"):
        vfgraph.export(models("mlp:adam"), os.path.join(models("mlp:adam"), "serving"))
    with pytest.raises(vfgraph.VfgraphError, match="non-negative integer"):
        vfgraph.export(models("mlp:adam"), tmp_path / "o", version=-1)
    with pytest.raises(vfgraph.VfgraphError, match="already micro-batched in slices of 8"):
        vfgraph.export(vfgraph.rewrite(models("mlp:adam"), vnodes=2, vnode_batch=8, allreduce="none"), tmp_path / "o",
                       vnode_batch=4)
    item = vfgraph.load(models("mlp:adam"))
    for key in [k for k in item.signatures if k != "train"]:
        del item.signatures[key]
    with pytest.raises(vfgraph.VfgraphError, match="no serving signature"):
        vfgraph.export(item, tmp_path / "o")
    assert not (tmp_path / "o").exists()
