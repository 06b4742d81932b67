"""Pipeline stages on MPI ranks for the steps people write by hand and the layers whose tensors
the messages cannot carry: a plain ``tf.Module`` step updating its variables with
``assign_sub`` trains cut into 2 stages on 2 ranks (both schedules) to the parameters one
process trains; a bidirectional LSTM, whose recurrent loops pass TensorLists (variants), is
cut where only numbers cross and trains the same; and the stage functions' messages are
checked at rewrite time, so a plan whose ranks would wait forever is refused instead."""
import json
import os
import subprocess
import sys

import numpy as np
import pytest

from test_mpi_train import ENV, MPIEXEC, assert_same_params, losses

pytestmark = pytest.mark.mpi

V, B = 8, 2  # virtual nodes of B examples: a batch of 16


def _train(ranks, model, data, out, steps=2, batch=V * B):
    cmd = ([MPIEXEC, "-n", str(ranks)] if ranks else []) + [
        sys.executable, "-m", "vfgraph.cli", "train", model, "--data", data, "--steps", str(steps),
        "--batch-size", str(batch), "-o", out, "--no-progress"]
    res = subprocess.run(cmd, capture_output=True, text=True, env=ENV, timeout=120)
    assert res.returncode == 0, res.stderr[-3000:]


def _module_assign_sub(path):
    """Two dense layers, four variables, gradients from a tape, each variable updated with
    ``assign_sub``: no optimizer object."""
    import tensorflow as tf

    from vfgraph.testing.steps import save_step

    init = tf.random.stateless_normal
    vs = [tf.Variable(init([8, 16], seed=[1, 2]) * 0.3, name="w1"), tf.Variable(tf.zeros([16]), name="b1"),
          tf.Variable(init([16, 10], seed=[3, 4]) * 0.3, name="w2"), tf.Variable(tf.zeros([10]), name="b2")]

    def logits(x):
        return tf.matmul(tf.nn.relu(tf.matmul(x, vs[0]) + vs[1]), vs[2]) + vs[3]

    def train(batch):
        with tf.GradientTape() as tape:
            loss = tf.reduce_mean(tf.nn.sparse_softmax_cross_entropy_with_logits(batch["y"], logits(batch["x"])))
        for v, g in zip(vs, tape.gradient(loss, vs)):
            v.assign_sub(0.1 * g)
        return {"loss": loss}

    specs = {"x": tf.TensorSpec([None, 8], tf.float32, name="x"), "y": tf.TensorSpec([None], tf.int32, name="y")}
    return save_step(path, train, specs, vs, serve=lambda x: {"logits": logits(x)}, serve_spec=specs["x"])


def _bilstm(path):
    import keras
    import tensorflow as tf

    from vfgraph.testing.steps import save_step

    keras.utils.set_random_seed(0)
    model = keras.Sequential([keras.Input((6, 4)), keras.layers.Bidirectional(keras.layers.LSTM(8)),
                              keras.layers.Dense(10)])
    opt = keras.optimizers.SGD(0.1)
    opt.build(model.trainable_variables)
    specs = {"x": tf.TensorSpec([None, 6, 4], tf.float32, name="x"), "y": tf.TensorSpec([None], tf.int32, name="y")}

    def train(batch):
        with tf.GradientTape() as tape:
            out = model(batch["x"], training=True)
            loss = tf.reduce_mean(tf.nn.sparse_softmax_cross_entropy_with_logits(batch["y"], out))
        opt.apply_gradients(zip(tape.gradient(loss, model.trainable_variables), model.trainable_variables))
        return {"loss": loss}

    return save_step(path, train, specs, list(model.variables) + list(opt.variables), (model, opt),
                     lambda x: {"logits": model(x, training=False)}, specs["x"])


@pytest.fixture(scope="module")
def data(tmp_path_factory):
    root = tmp_path_factory.mktemp("family_data")
    rng = np.random.default_rng(0)
    out = {}
    for name, shape in (("flat", (8,)), ("seq", (6, 4))):
        out[name] = str(root / f"{name}.npz")
        np.savez(out[name], x=rng.normal(size=(64,) + shape).astype("float32"),
                 y=rng.integers(0, 10, 64).astype("int32"))
    return out


@pytest.fixture(scope="module")
def sources(tmp_path_factory):
    root = tmp_path_factory.mktemp("family")
    return {"module": _module_assign_sub(str(root / "module")), "bilstm": _bilstm(str(root / "bilstm"))}


@pytest.mark.parametrize("schedule", ["1f1b", "gpipe"])
def test_an_assign_sub_module_trains_on_stage_ranks_as_in_one_process(sources, data, tmp_path, schedule):
    import vfgraph

    model = str(tmp_path / "model")
    vfgraph.save(vfgraph.rewrite(sources["module"], vnodes=V, vnode_batch=B, stages=2, schedule=schedule), model)
    one, ranks = str(tmp_path / "one"), str(tmp_path / "ranks")
    _train(0, model, data["flat"], one)
    _train(2, model, data["flat"], ranks)
    assert_same_params(one, ranks, 1e-6)
    assert losses(ranks) == pytest.approx(losses(one), rel=1e-6)


@pytest.mark.parametrize("split_at,schedule,vnode_batch", [("Relu", "1f1b", 8), ("MatMul_1", "gpipe", B)])
def test_an_assign_sub_module_trains_on_stage_ranks_at_other_cuts(sources, data, tmp_path, split_at, schedule,
                                                                   vnode_batch):
    """The same step cut after the first layer's activation and before the second layer's
    matmul, under both schedules, with 2 and 8 examples per virtual node: the stage ranks
    train what one process trains."""
    import vfgraph
    from vfgraph import records
    from vfgraph.records import Stages

    model = str(tmp_path / "model")
    vfgraph.save(vfgraph.rewrite(sources["module"], vnodes=V, vnode_batch=vnode_batch, stages=2,
                                 split_at=[split_at], schedule=schedule), model)
    assert tuple(records.read(model, Stages)["train"].split_at) == (split_at,)
    one, ranks = str(tmp_path / "one"), str(tmp_path / "ranks")
    _train(0, model, data["flat"], one, batch=V * vnode_batch)
    _train(2, model, data["flat"], ranks, batch=V * vnode_batch)
    assert_same_params(one, ranks, 1e-6)
    assert losses(ranks) == pytest.approx(losses(one), rel=1e-6)


def test_a_bilstm_is_cut_where_only_numbers_cross_and_trains_the_same(sources, data, tmp_path):
    """The balanced cut of the BiLSTM (between its two recurrent loops, where their TensorLists
    would cross) moves to where only float tensors cross; the stages train what one process
    trains."""
    import vfgraph
    from vfgraph import records
    from vfgraph.analysis.phases import train_steps
    from vfgraph.analysis.stages import carried, plan_stages
    from vfgraph.analysis.train_step import training_signature
    from vfgraph.ir.graph import FunctionGraph, parse_input
    from vfgraph.records import Stages
    from vfgraph.testing.cli import vf

    item = vfgraph.load(sources["bilstm"])
    sig = training_signature(item, "")
    g = FunctionGraph.over(item.function(sig.function), item.library)
    step = train_steps(g, sig, stages=True)[0]
    anywhere, on_ranks = plan_stages(g, step, 2), plan_stages(g, step, 2, ranks=True)

    def dtypes(plan):
        return {g.dtype(parse_input(t)[0]) for c in plan.cuts for t, _ in c.tensors}
    assert not all(map(carried, dtypes(anywhere)))  # the cut devices may take: a variant crosses it
    assert all(map(carried, dtypes(on_ranks))) and on_ranks.split_at != anywhere.split_at

    model = str(tmp_path / "model")
    vfgraph.save(vfgraph.rewrite(sources["bilstm"], vnodes=V, vnode_batch=B, stages=2), model)
    assert records.read(model, Stages)["train"].split_at == on_ranks.split_at
    shown = vf("inspect", sources["bilstm"], "--stages", 2, "--json")  # inspect previews that cut
    assert shown.returncode == 0, shown.stderr
    assert [c["before"] for c in json.loads(shown.stdout)["stages"]["cuts"]] == list(on_ranks.split_at)
    one, ranks = str(tmp_path / "one"), str(tmp_path / "ranks")
    _train(0, model, data["seq"], one)
    _train(2, model, data["seq"], ranks)
    assert_same_params(one, ranks, 1e-6)


def test_a_split_where_a_variant_would_cross_is_one_line(sources, tmp_path):
    import vfgraph
    from vfgraph.analysis.phases import train_steps
    from vfgraph.analysis.stages import plan_stages
    from vfgraph.analysis.train_step import training_signature
    from vfgraph.ir.graph import FunctionGraph
    from vfgraph.testing.cli import error_line, tree_digest, vf

    item = vfgraph.load(sources["bilstm"])
    sig = training_signature(item, "")
    g = FunctionGraph.over(item.function(sig.function), item.library)
    (at,) = plan_stages(g, train_steps(g, sig, stages=True)[0], 2).split_at  # between the loops
    before = tree_digest(sources["bilstm"])
    res = vf("rewrite", sources["bilstm"], "--vnodes", V, "--vnode-batch", B, "--stages", 2, "--split-at", at,
             "-o", tmp_path / "out")
    assert res.returncode == 2
    line = error_line(res)
    assert f"split at {at!r}" in line and "variant" in line and "cannot carry" in line and "--devices" in line
    assert not os.path.exists(tmp_path / "out") and tree_digest(sources["bilstm"]) == before


def test_stage_functions_whose_messages_would_hang_are_refused(sources):
    """The check split-vnodes runs on the stage functions it writes, given real stage functions
    put together wrongly: a stage whose peer sends nothing, and a stage that runs its backward
    (waiting for the next stage's gradient) before its forward (which sends what that stage
    needs to compute it)."""
    import vfgraph
    from vfgraph.errors import PipelineError
    from vfgraph.rewrites.split_vnodes import check_stage_messages

    item = vfgraph.rewrite(sources["module"], vnodes=V, vnode_batch=B, stages=2)
    lib = item.library

    def fn(suffix):
        (name,) = [n for n in lib if n.endswith(suffix)]
        return lib[name]
    forward, backward, last = fn("_vnode_stage1_forward"), fn("_vnode_stage1_backward"), fn("_vnode_stage2")
    check_stage_messages([[forward, backward], [last]], [], "train", lib)  # as written: passes
    unmatched = r"message 0 .* from stage 1 to stage 2 is sent 1 time\(s\) and received 0 time"
    with pytest.raises(PipelineError, match=unmatched):
        check_stage_messages([[forward, backward], []], [], "train", lib)
    with pytest.raises(PipelineError, match="would deadlock: message .* is sent only after its receiver has waited"):
        check_stage_messages([[backward, forward], [last]], [], "train", lib)


def test_a_forward_never_waits_for_a_message_sent_from_a_backward(models):
    """In a 3-stage transformer, stage 1 computes in its backward the gradient of a bias stage 2
    holds (a residual connection carries it past the cut): stage 2 receives it in its backward,
    not in the forward whose end its own gradients wait for. Every receive in a stage's forward
    matches a send in another stage's forward."""
    import re

    import vfgraph

    item = vfgraph.rewrite(models("transformer:sgd"), vnodes=8, vnode_batch=8, stages=3)
    where = {}  # message -> (op, function kind) of its send and receive
    for name, fdef in item.library.items():
        kind = re.search(r"_vnode_stage\d(_forward|_backward)?$", name)
        for node in fdef.node_def if kind else ():
            m = re.fullmatch(r"vf/stage/(send|recv)_(\d+)", node.name)
            if m:
                where.setdefault(int(m.group(2)), {})[m.group(1)] = kind.group(1) or "whole"
    assert where and all(set(ends) == {"send", "recv"} for ends in where.values())
    late = [m for m, ends in where.items() if ends["send"] == "_backward" and ends["recv"] != "whole"]
    assert late  # the case this test is about
    assert all(where[m]["recv"] == "_backward" for m in late), where
