"""partition-stages: a training step cut into K pipeline stages on K devices computes what the
unpartitioned step with the same virtual nodes computes, with each stage's ops and variables
on its device (checked in one process over logical CPU devices, TensorFlow's own placement
read back from its partition graphs)."""
import json
import os
import subprocess
import sys

import pytest

from vfgraph import records
from vfgraph.errors import PipelineError, VfgraphError
from vfgraph.records import Stages, VirtualNodes

HERE = os.path.dirname(os.path.abspath(__file__))
MODELS = ["mlp:adam", "cnn", "llama"]  # ours, and a transformer of the corpus (keras-hub)
# (name, stages, schedule)
VARIANTS = [("k2", 2, "1f1b"), ("k2-gpipe", 2, "gpipe"), ("k3", 3, "1f1b")]
VNODES = 8


def _devices(k):
    return [f"/CPU:{i}" for i in range(k)]


@pytest.fixture(scope="module")
def partitioned(models, tmp_path_factory):
    """Each model rewritten with V=8 unpartitioned and in every variant: name -> (path, item)."""
    import vfgraph

    root = tmp_path_factory.mktemp("partitioned")
    made = {}
    for model in MODELS:
        base = str(root / f"{model.replace(':', '_')}_base")
        vfgraph.save(vfgraph.rewrite(models(model), vnodes=VNODES, allreduce="none"), base)
        made[model, "base"] = (base, None)
        for name, k, schedule in VARIANTS:
            item = vfgraph.rewrite(models(model), vnodes=VNODES, allreduce="none", stages=k, devices=_devices(k),
                                   schedule=schedule)
            path = str(root / f"{model.replace(':', '_')}_{name}")
            vfgraph.save(item, path)
            made[model, name] = (path, item)
    return made


@pytest.fixture(scope="module")
def ran(partitioned, tmp_path_factory):
    """The worker's report: every variant of every model against its unpartitioned rewrite."""
    cases = [{"name": f"{model}/{name}", "baseline": partitioned[model, "base"][0],
              "model": partitioned[model, name][0]} for model in MODELS for name, _, _ in VARIANTS]
    config = tmp_path_factory.mktemp("partition_worker") / "config.json"
    config.write_text(json.dumps({"devices": 3, "steps": 3, "batch": 64, "cases": cases}))
    res = subprocess.run([sys.executable, os.path.join(HERE, "partition_worker.py"), str(config)],
                         capture_output=True, text=True, timeout=900)
    assert res.returncode == 0, res.stderr[-3000:]
    return json.loads(res.stdout.strip().splitlines()[-1])


@pytest.mark.parametrize("model", MODELS)
@pytest.mark.parametrize("variant", [v[0] for v in VARIANTS])
def test_stages_compute_the_unpartitioned_step(ran, model, variant):
    """Same parameters and losses as the unpartitioned V=8 step after 3 steps (the same ops in
    the same order: the sums are added in the same sequence whatever device runs them)."""
    r = ran[f"{model}/{variant}"]
    assert r["same_names"]
    assert r["params"] <= 1e-6, r["params"]
    assert r["loss"] <= 1e-6 * 10, r["loss"]


@pytest.mark.parametrize("model", MODELS)
@pytest.mark.parametrize("variant", [v[0] for v in VARIANTS])
def test_each_stage_runs_on_its_device(partitioned, ran, model, variant):
    """TensorFlow places each stage's ops on its device, and creates each stage's variables
    (parameters and optimizer state) there."""
    _, item = partitioned[model, variant]
    rec = records.get(item, Stages)["train"]
    r = ran[f"{model}/{variant}"]
    k = rec.count
    assert [p.device for p in rec.parts] == [f"/device:CPU:{i}" for i in range(k)]
    for i, part in enumerate(rec.parts):
        assert part.ops, f"stage {i + 1} runs no op"
        for v in part.variables + part.optimizer_state:
            assert r["variable_devices"][v + ":0"] == f"CPU:{i}", (v, r["variable_devices"][v + ":0"])
    used = {}
    for name, device in r["ops"].items():
        used[device] = used.get(device, 0) + 1
    for i in range(k):
        assert used.get(f"CPU:{i}", 0) >= rec.parts[i].ops // 2, (used, [p.ops for p in rec.parts])
    # the model's parameters are split between the stages, each held once
    held = [v for p in rec.parts for v in p.variables]
    assert len(held) == len(set(held)) and len([p for p in rec.parts if p.variables]) >= 2


def test_partition_record_and_loop(partitioned):
    """The record says where everything went; the virtual-node loop lets K virtual nodes (1F1B)
    or all of them (GPipe) be in flight, one at a time without stages."""
    from vfgraph.ir.graph import FunctionGraph

    for name, k, schedule in VARIANTS:
        path, item = partitioned["mlp:adam", name]
        rec = records.get(item, Stages)["train"]
        assert records.read(path, Stages)["train"] == rec == Stages.from_json(rec.to_json())
        assert (rec.count, rec.schedule, len(rec.split_at), len(rec.cut_bytes)) == (k, schedule, k - 1, k - 1)
        assert all(b > 0 for b in rec.cut_bytes)
        assert sum(p.parameter_bytes for p in rec.parts) == (64 * 32 + 32 + 32 * 10 + 10) * 4
        vn = records.get(item, VirtualNodes)["train"]
        g = FunctionGraph(item.library[vn.function], item.library)
        (loop,) = [n for n, node in g.nodes.items() if node.op == "While"]
        assert g.nodes[loop].attr["parallel_iterations"].i == (VNODES if schedule == "gpipe" else k)
    import vfgraph

    base = vfgraph.load(partitioned["mlp:adam", "base"][0])
    assert not records.get(base, Stages)


def test_output_is_deterministic_and_the_input_unchanged(models, tmp_path_factory):
    import vfgraph
    from vfgraph.ir.canonical import canonical_text

    src = models("cnn")
    before = canonical_text(vfgraph.load(src))
    a = vfgraph.rewrite(src, vnodes=4, allreduce="none", stages=2, devices=_devices(2))
    b = vfgraph.rewrite(src, vnodes=4, allreduce="none", stages=2, devices=_devices(2))
    assert canonical_text(a) == canonical_text(b)
    assert canonical_text(vfgraph.load(src)) == before


def test_split_at_is_followed(models):
    import vfgraph

    item = vfgraph.rewrite(models("mlp:adam"), vnodes=2, allreduce="none", stages=2, devices=_devices(2))
    first = records.get(item, Stages)["train"]
    # force another cut: before the first layer's bias add, where the plan itself never starts a
    # stage (it would part the bias from the matrix product TensorFlow fuses it with)
    from vfgraph.analysis.stages import plan_stages
    from vfgraph.analysis.train_step import analyze_train_step
    from vfgraph.ir.graph import FunctionGraph

    orig = vfgraph.load(models("mlp:adam"))
    sig = orig.training_signature()
    g = FunctionGraph(orig.library[sig.function], orig.library)
    order = plan_stages(g, analyze_train_step(g, sig), 2).order
    other = next(op for op in order[1:] if g.nodes[op].op == "BiasAdd")
    assert g.nodes[first.split_at[0]].op == "MatMul"  # the plan's own cut: a layer's start
    item = vfgraph.rewrite(models("mlp:adam"), vnodes=2, allreduce="none", stages=2, devices=_devices(2),
                           split_at=[other])
    assert records.get(item, Stages)["train"].split_at == (other,)


@pytest.mark.parametrize("kwargs, match", [
    (dict(stages=2, devices=["/CPU:0"]), "2 stages need 2 devices"),
    (dict(stages=2, devices=["/CPU:0", "/cpu:0"]), "named twice"),
    (dict(stages=2, devices=["/CPU:0", "gpu one"]), "device type and index"),
    (dict(stages=2, devices=["/CPU:0", "/CPU:1"], split_at=["no/such/op"]), "not a forward op"),
    (dict(stages=2, devices=["/CPU:0", "/CPU:1"], schedule="zigzag"), "choose 1f1b or gpipe"),
])
def test_bad_options_are_refused(models, kwargs, match):
    import vfgraph

    with pytest.raises(VfgraphError, match=match):
        vfgraph.rewrite(models("mlp:sgd"), vnodes=2, allreduce="none", **kwargs)


def test_partition_after_split_vnodes_is_refused(models):
    import vfgraph

    with pytest.raises(PipelineError, match="run it before split-vnodes"):
        vfgraph.rewrite(models("mlp:sgd"), pipeline="split-vnodes{vnodes=2},"
                                                     "partition-stages{stages=2,devices=/CPU:0;/CPU:1}")


def test_tf1_models_are_refused_by_name(models):
    import vfgraph

    with pytest.raises(PipelineError, match="partition-stages takes TF2 SavedModels"):
        vfgraph.rewrite(models("tf1"), vnodes=2, stages=2, devices=_devices(2))


def test_command_line_rewrite_train_inspect_and_serve(models, digits, tmp_path):
    """``vfgraph rewrite --stages 2 --devices /CPU:0,/CPU:1``, then ``vfgraph train`` in a fresh
    process (it makes the second logical CPU device) trains it to the parameters of the
    unpartitioned rewrite trained the same way; the result loads in stock TensorFlow, its
    variables keep their devices, and its serving export serves."""
    from vfgraph.testing.cli import vf

    src = models("mlp:sgd")
    out = tmp_path / "k2"
    res = vf("rewrite", src, "--vnodes", 4, "--vnode-batch", 8, "--allreduce", "none", "--stages", 2,
             "--devices", "/CPU:0,/CPU:1", "-o", out)
    assert res.returncode == 0, res.stderr
    assert "partition-stages{devices=/device:CPU:0;/device:CPU:1},split-vnodes" in res.stdout
    ins = vf("inspect", out)
    assert ins.returncode == 0 and "pipeline stages: 2 (1f1b" in ins.stdout, ins.stdout + ins.stderr
    assert "stage 2 on /device:CPU:1" in ins.stdout
    base = tmp_path / "base"
    assert vf("rewrite", src, "--vnodes", 4, "--vnode-batch", 8, "--allreduce", "none", "-o", base).returncode == 0
    common = ["--data", digits["train"], "--steps", 4, "--batch-size", 32, "--no-progress"]
    for model, trained in ((out, tmp_path / "trained"), (base, tmp_path / "trained_base")):
        res = vf("train", model, *common, "-o", trained)
        assert res.returncode == 0, res.stderr[-2000:]
    code = ("import json, sys, tensorflow as tf\n"
            "pol = tf.saved_model.experimental.VariablePolicy.SAVE_VARIABLE_DEVICES\n"
            "ma = tf.saved_model.load(sys.argv[1]); a = ma.signatures['train']\n"
            "mb = tf.saved_model.load(sys.argv[2], options=tf.saved_model.LoadOptions("
            "experimental_variable_policy=pol)); b = mb.signatures['train']\n"
            "want = {v.name: v.numpy() for v in a.variables}\n"
            "print(json.dumps({'diff': max(float(abs(want[v.name] - v.numpy()).max()) for v in b.variables),"
            " 'devices': sorted({v.device.split('/device:')[-1] for v in b.variables})}))\n")
    res = subprocess.run([sys.executable, "-c", code, str(tmp_path / "trained_base"), str(tmp_path / "trained")],
                         capture_output=True, text=True, timeout=300)
    assert res.returncode == 0, res.stderr[-2000:]
    got = json.loads(res.stdout.strip().splitlines()[-1])
    # loaded without logical devices, a variable saved on CPU:1 lands on CPU:0 (soft placement)
    assert got["diff"] == 0.0 and got["devices"] == ["CPU:0"], got
    assert os.path.isdir(tmp_path / "trained.serving" / "1")
    import vfgraph

    saved = vfgraph.load(tmp_path / "trained").meta_graph.object_graph_def
    kept = {o.variable.device.split("/device:")[-1] for o in saved.nodes if o.WhichOneof("kind") == "variable"}
    assert kept >= {"CPU:0", "CPU:1"}, kept


@pytest.mark.parametrize("argv, match", [
    (["--stages", 2, "--devices", "/CPU:0"], "--stages 2 with 1 device(s)"),
    (["--stages", 2, "--devices", "/CPU:0,CPU"], "--devices: device 'CPU'"),
    (["--stages", 3, "--devices", "/CPU:0,/CPU:1,/CPU:2", "--split-at", "a"], "--split-at names 1 op(s)"),
    (["--stages", 2, "--devices", "/CPU:0,/CPU:1", "--pipeline", "split-vnodes"], "give them in the pipeline"),
])
def test_command_line_mistakes_are_one_line(models, tmp_path, capsys, argv, match):
    from vfgraph.testing.cli import error_line, run_in_process

    code, err = run_in_process(capsys, "rewrite", models("mlp:sgd"), *argv, "-o", tmp_path / "o")
    assert code == 2 and match in error_line(err), err
    assert not (tmp_path / "o").exists()
