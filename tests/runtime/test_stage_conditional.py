"""Updates applied under a condition, cut into pipeline stages: Keras' LossScaleOptimizer
(over SGD, over Adam with ``global_clipnorm``, under ``mixed_float16``), Keras'
``gradient_accumulation_steps`` and an update under ``tf.cond`` on the gradients' global norm
train the parameters of the unpartitioned step with the same virtual nodes, over logical CPU
devices in one process and over MPI ranks (``mpiexec -n K vfgraph train``).

Their update is one functional op (an ``If``) writing the variables of both stages together.
On devices it runs where TensorFlow puts it, reading each stage's variables there. On ranks each
stage holds a copy of every variable that op writes and runs it whole, on every gradient (each
broadcast from the stage computing it): the copies stay identical, as the shared weights of
test_stage_shared.py do. Measured here: 0.0 relative difference for every kind, mixed_float16
included (each stage runs the same float16 ops on the same values as one process)."""
import json
import os
import subprocess
import sys

import numpy as np
import pytest

sys.path.insert(0, os.path.join(os.path.dirname(os.path.dirname(os.path.abspath(__file__))), "rewrites"))

from test_conditional_updates import export_conditional_sgd, export_loss_scaled  # noqa: E402
from test_training_semantics import data, export  # noqa: E402

HERE = os.path.dirname(os.path.abspath(__file__))
WORKER = os.path.join(os.path.dirname(HERE), "rewrites", "stage_diff_worker.py")
ENV = dict(os.environ, TF_CPP_MIN_LOG_LEVEL="2", TF_ENABLE_ONEDNN_OPTS="0", OMP_NUM_THREADS="1")
RTOL = 1e-6
STEPS = 4  # the scale doubles after steps 2 and 4; the accumulated gradients apply at steps 2 and 4
RANK_STEPS = 3  # over ranks: ends between two applies, the accumulators holding step 3's gradients
VNODES = 4
EXPORTS = {
    "loss_scale_sgd": lambda p: export_loss_scaled(p),
    "loss_scale_adam_clipped": lambda p: export_loss_scaled(p, inner="adam_clipped"),
    "loss_scale_mixed_float16": lambda p: export_loss_scaled(p, "mixed_float16"),
    "gradient_accumulation": lambda p: export(p, gradient_accumulation_steps=2),
    "cond_on_gradient_norm": lambda p: export_conditional_sgd(p, "gradient_norm"),
}
ON_DEVICES_ONLY = {  # an embedding's rows under the loss scale: refused over ranks (see the last test)
    "loss_scale_embedding": lambda p: export_loss_scaled(p, embedding=True),
    "loss_scale_embedding_sum": lambda p: export_loss_scaled(p, embedding=True, loss="sum"),
}
KINDS = sorted(EXPORTS)


@pytest.fixture(scope="module")
def source(tmp_path_factory):
    """``get(kind)``: the exported model of ``kind``, written once."""
    import keras

    root = tmp_path_factory.mktemp("stage_conditional")
    made = {}

    def get(kind):
        if kind not in made:
            made[kind] = {**EXPORTS, **ON_DEVICES_ONLY}[kind](str(root / kind))
            keras.backend.clear_session()
        return made[kind]

    return get


def _rewrite(original: str, out: str, **options) -> str:
    import vfgraph

    vfgraph.save(vfgraph.rewrite(original, vnodes=VNODES, allreduce="none", **options), out)
    return out


def test_stages_on_devices_train_the_unpartitioned_step(source, tmp_path):
    """Each kind (and an embedding under the loss scale), cut into 2 and into 3 stages on
    /CPU:0.. (one intra-op thread each), against its unpartitioned rewrite with the same V, on
    the same random batches (stage_diff_worker.py)."""
    from vfgraph import records
    from vfgraph.records import Stages

    cases = []
    for kind in KINDS + sorted(ON_DEVICES_ONLY):
        base = _rewrite(source(kind), str(tmp_path / f"{kind}_base"))
        for k in (2, 3):
            devices = [f"/CPU:{i}" for i in range(k)]
            staged = _rewrite(source(kind), str(tmp_path / f"{kind}_k{k}"), stages=k, devices=devices)
            cases.append({"name": f"{kind}_k{k}", "baseline": base, "model": staged, "batch": 16})
            parts = records.read(staged, Stages)["train"].parts
            assert [p.device for p in parts] == [f"/device:CPU:{i}" for i in range(k)], parts
            assert sum(bool(p.variables) for p in parts) == 2, parts  # (of 3 stages, one holds none)
    config = tmp_path / "config.json"
    config.write_text(json.dumps({"devices": 3, "steps": STEPS, "cases": cases}))
    res = subprocess.run([sys.executable, WORKER, str(config)], env=ENV, capture_output=True, text=True, timeout=600)
    reports = {r["name"]: r for r in map(json.loads, (ln for ln in res.stdout.splitlines() if ln.startswith("{")))
               if "start" not in r}
    assert sorted(reports) == sorted(c["name"] for c in cases), res.stderr[-2000:]
    for kind, rep in reports.items():
        assert "error" not in rep, rep
        assert rep["same_names"] and rep["params"] <= RTOL and rep["loss"] <= RTOL, rep


@pytest.fixture(scope="module")
def on_ranks(source, tmp_path_factory):
    """``get(kind, k=2)``: ``kind`` rewritten with 4 virtual nodes cut into k stages on MPI ranks."""
    root = tmp_path_factory.mktemp("stage_conditional_ranks")
    made = {}

    def get(kind, k=2):
        if (kind, k) not in made:
            made[kind, k] = _rewrite(source(kind), str(root / f"{kind}_k{k}"), stages=k)
        return made[kind, k]

    return get


def test_the_conditional_update_is_held_by_both_stages(on_ranks):
    """Over ranks the variables the conditional update writes are held by both stages (each
    stage's forward still reads only its own layer), and each stage runs the whole update."""
    import vfgraph
    from vfgraph import records
    from vfgraph.records import Stages

    rec = records.read(on_ranks("loss_scale_adam_clipped"), Stages)["train"]
    first, second = (set(p.variables) for p in rec.parts)
    assert first == second and len(first) == 4, rec.parts
    assert set(rec.shared) == first
    slots = [set(p.optimizer_state) for p in rec.parts]
    assert slots[0] == slots[1] and len(slots[0]) == 8, slots  # Adam's two moments of each parameter
    item = vfgraph.load(on_ranks("loss_scale_adam_clipped"))
    for s in (1, 2):
        (update,) = [f for n, f in item.library.items() if n.endswith(f"_update_stage{s}")]
        assert [n.op for n in update.node_def].count("If") == 1, s


@pytest.fixture(scope="module")
def npz(tmp_path_factory):
    path = str(tmp_path_factory.mktemp("stage_conditional_data") / "train.npz")
    d = data(256)
    np.savez(path, batch=d["batch"], batch_1=d["batch_1"])
    return path


@pytest.mark.mpi
@pytest.mark.parametrize("kind, k", [(kind, 2) for kind in KINDS]
                         + [("loss_scale_adam_clipped", 3), ("gradient_accumulation", 3)])
def test_stages_on_ranks_train_what_one_process_trains(on_ranks, npz, tmp_path, kind, k):
    """K stages on K ranks (``mpiexec -n K vfgraph train``) against the same model trained in
    one process, which runs the unpartitioned step with the same V."""
    from test_mpi_train import losses, params, run_train
    from vfgraph.testing.compare import rel_diff

    model = on_ranks(kind, k)
    one, ranks = str(tmp_path / "one"), str(tmp_path / "ranks")
    run_train(0, model, npz, one, RANK_STEPS)
    run_train(k, model, npz, ranks, RANK_STEPS)
    a, b, before = params(one), params(ranks), params(model)
    assert sorted(a) == sorted(b)
    worst = max((rel_diff(a[k], b[k]), k) for k in a)
    assert worst[0] <= RTOL, worst
    assert losses(ranks) == pytest.approx(losses(one), rel=RTOL)
    trained = [k for k in before if k.endswith(("kernel:0", "bias:0"))]
    assert trained and all(not np.array_equal(before[k], b[k]) for k in trained), kind
    scale = [k for k in b if k.endswith("/dynamic_scale:0")]
    if scale:  # doubled after 2 finite steps, once per step on every stage
        assert b[scale[0]] == 2.0 ** 9, b[scale[0]]
    accumulators = [k for k in b if k.endswith("_gradient_accumulator:0")]
    assert all(np.abs(b[k]).max() > 0 for k in accumulators)  # (both stages' copies gathered mid-accumulation)
    assert len(accumulators) == (4 if kind == "gradient_accumulation" else 0)


@pytest.mark.parametrize("loss", ["mean", "sum"])
def test_an_embedding_applied_under_the_loss_scale_is_refused_over_ranks(source, tmp_path, capsys, loss):
    """An embedding's sparse gradient applied inside the loss-scale optimizer's conditional:
    every stage runs that update, and its rows (of no static count) cannot be broadcast between
    ranks. Refused at rewrite time naming the variable and the conditional, nothing written;
    over devices it trains as the unpartitioned step (the embedding cases of the device test)."""
    from vfgraph.testing.cli import one_error, run_in_process

    original, out = str(tmp_path / f"embedded_{loss}"), tmp_path / "staged"
    export_loss_scaled(original, embedding=True, loss=loss)
    code, err = run_in_process(capsys, "rewrite", original, "-o", out, "--vnodes", "4", "--stages", "2")
    one_error(code, err, "the sparse gradient (rows) of variable 'sequential", "/embeddings'",
              "the update 'cond' (If)", "stages 1, 2 under one condition", "LossScaleOptimizer", "--devices")
    assert not out.exists()
