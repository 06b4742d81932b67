"""The same step, cut or not: every model with a training step, cut into 2 and 3 pipeline
stages, trains the parameters of the unpartitioned step with the same virtual nodes (within
1e-6 relative after 2 steps, batch norm included: it is the same computation), at V=1 and at
V=8 virtual nodes of 2 examples, at one intra-op thread per device (the thread count changes
the order of float reductions). Over logical CPU devices in one worker process
(stage_diff_worker.py); over MPI ranks (``mpiexec -n 2 vfgraph train``) for a few models; and
every single cut of a small model, each training equal to the uncut step or refused with one
line, never a wrong result nor a hang."""
import json
import os
import queue
import signal
import subprocess
import sys
import threading

import numpy as np
import pytest

import corpus
from vfgraph.errors import VfgraphError
from vfgraph.testing import stage_models

HERE = os.path.dirname(os.path.abspath(__file__))
BIN = os.path.dirname(sys.executable)
ENV = dict(os.environ, TF_CPP_MIN_LOG_LEVEL="2", TF_ENABLE_ONEDNN_OPTS="0", OMP_NUM_THREADS="1")
RTOL = 1e-6
STEPS = 2
VNODE_BATCH = 2
VNODES = (1, 8)
STAGES = (2, 3)
WORKER_TIMEOUT = 240  # a worker that reports nothing for this long is hung on its current case

# the models: ours (vfgraph/testing/stage_models.py) and the corpus models with a TF2 training
# step (the TF1 graphs are refused by name: test_tf1_corpus_models_are_refused)
CORPUS = sorted(n for n, e in corpus.CORPUS.items() if e.optimizer and not e.tags)
# what CI runs of the corpus: one model of each family (decoder, encoder with dropout, recurrent,
# batch norm, vision transformer, encoder-decoder with a summed loss and clipping) at V=8 and 2
# stages; VFGRAPH_STAGE_SWEEP=full runs every corpus model at every V and K (about 10x the time)
FULL_SWEEP = os.environ.get("VFGRAPH_STAGE_SWEEP") == "full"
CORPUS_CI = ("bart-sum-clipped", "bert", "gpt2", "gru", "resnet-hub", "vit")
TF1 = sorted(n for n, e in corpus.CORPUS.items() if e.tags)
OURS = sorted(stage_models.MODELS)
# cuts that make a stage of its own of a construct: the parameter-free middle
SPLITS = {("stateless-stage", 3): ("/free_a", "/last")}
# (model, V, K) -> why it fails today (seen failing)
FAILING_ON_DEVICES = {}


def _devices(k):
    return [f"/CPU:{i}" for i in range(k)]


@pytest.fixture(scope="module")
def source(exported, tmp_path_factory):
    """``get(name)``: the SavedModel of one of ours or of a corpus model, written once."""
    root = tmp_path_factory.mktemp("stage_models")
    made = {}

    def get(name):
        if name not in made:
            made[name] = exported(name) if name in corpus.ALL else stage_models.MODELS[name](str(root / name))
        return made[name]

    return get


def forward_ops(path):
    """The forward ops of ``path``'s training step, in the order the stage planner cuts them."""
    import vfgraph
    from vfgraph.analysis.phases import train_steps
    from vfgraph.analysis.stages import plan_stages
    from vfgraph.ir.graph import FunctionGraph

    item = vfgraph.load(path)
    sig = item.training_signature()
    g = FunctionGraph(item.library[sig.function], item.library)
    return plan_stages(g, train_steps(g, sig, stages=True)[0], 1).order


def _split_at(path, name, k):
    """The split points of ``SPLITS`` (name fragments) as ops of ``path``'s forward order."""
    if (name, k) not in SPLITS:
        return ()
    order = forward_ops(path)
    return tuple(next(op for op in order if frag in op) for frag in SPLITS[name, k])


def _reports(proc, timeout):
    """The JSON lines of the worker ``proc`` as they come; it is killed when ``timeout`` s pass
    without one."""
    lines = queue.Queue()
    threading.Thread(target=lambda: [lines.put(ln) for ln in proc.stdout] + [lines.put(None)], daemon=True).start()
    while True:
        try:
            line = lines.get(timeout=timeout)
        except queue.Empty:
            os.killpg(proc.pid, signal.SIGKILL)
            proc.wait()
            return
        if line is None:
            proc.wait()
            return
        if line.startswith("{"):
            yield json.loads(line)


def run_worker(cases, root, timeout=WORKER_TIMEOUT):
    """Run the cases in stage_diff_worker.py: name -> its report, or {"error": ...} for a case
    that reported nothing within ``timeout`` s (a hang: its worker is killed and the cases after
    it run in a new one) or that the worker died in."""
    results, todo = {}, list(cases)
    while todo:
        config = os.path.join(root, f"config_{len(results)}.json")
        with open(config, "w") as f:
            json.dump({"devices": max(STAGES), "steps": STEPS, "cases": todo}, f)
        proc = subprocess.Popen([sys.executable, os.path.join(HERE, "stage_diff_worker.py"), config], env=ENV,
                                stdout=subprocess.PIPE, stderr=subprocess.DEVNULL, text=True, start_new_session=True)
        current = None
        for rep in _reports(proc, timeout):
            if "start" in rep:
                current = rep["start"]
            else:
                results[rep["name"]], current = rep, None
        hung = proc.returncode == -signal.SIGKILL
        why = f"hang: no result within {timeout} s" if hung else f"the worker died (exit {proc.returncode})"
        if current is None:  # between cases (or before the first): what it did not run, a new one would not either
            for c in todo:
                results.setdefault(c["name"], {"name": c["name"], "error": f"not run: {why}"})
            break
        results[current] = {"name": current, "error": why}
        todo = [c for c in todo if c["name"] not in results]
    return results


def _device_cases(names, source, root, vnodes=VNODES, stages=STAGES):
    """Rewrite each model at each V unpartitioned and cut into each K on devices: (worker
    cases, refusals: case name -> the message)."""
    import vfgraph

    cases, refused = [], {}
    for name in names:
        src = source(name)
        for v in vnodes:
            base = os.path.join(root, f"{name}_v{v}")
            try:
                vfgraph.save(vfgraph.rewrite(src, vnodes=v, vnode_batch=VNODE_BATCH, allreduce="none"), base)
            except VfgraphError as e:
                for k in stages:
                    refused[f"{name}/v{v}/k{k}"] = f"unpartitioned: {e}"
                continue
            for k in stages:
                out = os.path.join(root, f"{name}_v{v}_k{k}")
                try:
                    item = vfgraph.rewrite(src, vnodes=v, vnode_batch=VNODE_BATCH, allreduce="none", stages=k,
                                           devices=_devices(k), split_at=_split_at(src, name, k))
                    vfgraph.save(item, out)
                except VfgraphError as e:
                    refused[f"{name}/v{v}/k{k}"] = str(e)
                    continue
                cases.append({"name": f"{name}/v{v}/k{k}", "baseline": base, "model": out,
                              "batch": v * VNODE_BATCH, "corpus": name in corpus.ALL})
    return cases, refused


@pytest.fixture(scope="module")
def on_devices(source, tmp_path_factory):
    """``get(group)``: every model of ``group`` (OURS or CORPUS, as a tuple) at every V and K over
    devices, once: case name -> the worker's report, or {"refused": message}."""
    root = tmp_path_factory.mktemp("stage_diff")
    made = {}

    def get(group, vnodes=VNODES, stages=STAGES):
        if group not in made:
            sub = str(root / f"group{len(made)}")
            os.makedirs(sub)
            cases, refused = _device_cases(group, source, sub, vnodes, stages)
            made[group] = run_worker(cases, sub)
            made[group].update({n: {"name": n, "refused": m} for n, m in refused.items()})
            with open(os.path.join(sub, "table.json"), "w") as f:  # (the whole table, for a reader of a failure)
                json.dump(made[group], f, indent=1, sort_keys=True)
        return made[group]

    return get


def _params(names, seen, marks=(), vnodes=VNODES, stages=STAGES):
    out = []
    for name in names:
        for v in vnodes:
            for k in stages:
                why = seen.get((name, v, k))
                failing = [pytest.mark.xfail(strict=True, reason=why)] if why else []
                out.append(pytest.param(name, v, k, marks=[*marks, *failing], id=f"{name}-v{v}-k{k}"))
    return out


def assert_equal_step(rep):
    assert "refused" not in rep, rep["refused"]
    assert "error" not in rep, rep["error"]
    assert rep["same_names"], rep
    assert rep["params"] <= RTOL, f"{rep['worst']} differs by {rep['params']:.3g}"
    assert rep["loss"] <= 10 * RTOL, rep


def _check_on_devices(results, name, v, k):
    rep = results[f"{name}/v{v}/k{k}"]
    if "refused" in rep and "forward op(s) with" in rep["refused"] and k > 2:
        pytest.skip(f"no room for {k} stages: {rep['refused']}")
    assert_equal_step(rep)


@pytest.mark.parametrize("name, v, k", _params(OURS, FAILING_ON_DEVICES))
def test_stages_on_devices_train_the_unpartitioned_step(on_devices, name, v, k):
    """Plain tf.Module steps, non-trainable state, a stage without variables, a BiLSTM, L2
    regularizers, a shared layer, recompute_grad, global-norm clipping."""
    _check_on_devices(on_devices(tuple(OURS)), name, v, k)


CORPUS_SWEEP = {"names": CORPUS, "vnodes": VNODES, "stages": STAGES} if FULL_SWEEP else \
    {"names": CORPUS_CI, "vnodes": (8,), "stages": (2,)}


@pytest.mark.parametrize("name, v, k", _params(CORPUS_SWEEP["names"], FAILING_ON_DEVICES, [pytest.mark.corpus],
                                               CORPUS_SWEEP["vnodes"], CORPUS_SWEEP["stages"]))
def test_corpus_stages_on_devices_train_the_unpartitioned_step(on_devices, name, v, k):
    """The real-architecture corpus (examples/corpus.py), batch norm included."""
    _check_on_devices(on_devices(tuple(CORPUS_SWEEP["names"]), CORPUS_SWEEP["vnodes"], CORPUS_SWEEP["stages"]),
                      name, v, k)


def test_a_stage_without_variables(source):
    """The parameter-free middle of stateless-stage is a stage of its own, holding no variable
    (what test_stages_on_devices_train_the_unpartitioned_step trains at K=3)."""
    import vfgraph
    from vfgraph import records
    from vfgraph.analysis.phases import train_steps
    from vfgraph.analysis.stages import plan_stages
    from vfgraph.ir.graph import FunctionGraph
    from vfgraph.records import Stages

    src = source("stateless-stage")
    item = vfgraph.rewrite(src, vnodes=8, vnode_batch=VNODE_BATCH, allreduce="none", stages=3, devices=_devices(3),
                           split_at=_split_at(src, "stateless-stage", 3))
    assert records.get(item, Stages)["train"].count == 3
    loaded = vfgraph.load(src)
    sig = loaded.training_signature()
    g = FunctionGraph(loaded.library[sig.function], loaded.library)
    report = plan_stages(g, train_steps(g, sig, stages=True)[0], 3, _split_at(src, "stateless-stage", 3))
    assert report.stages[1].variables == () and report.stages[0].variables and report.stages[2].variables


@pytest.mark.corpus
@pytest.mark.parametrize("name", TF1)
def test_tf1_corpus_models_are_refused(source, name):
    """A TF1 graph's step is not cut: refused up front, naming why."""
    import vfgraph

    with pytest.raises(VfgraphError) as e:
        vfgraph.rewrite(source(name), vnodes=8, vnode_batch=VNODE_BATCH, stages=2, devices=_devices(2))
    assert "\n" not in str(e.value) and "takes TF2 SavedModels" in str(e.value), str(e.value)


# ---------------------------------------------------------------------------- over MPI ranks
RANKS = ["module-assign-sub", "module-momentum", "nontrainable-state", "bilstm", "l2", "shared-layer",
         "recompute-grad", "global-clip"]
# the corpus: batch norm (ResNet), a recurrent model with an embedding (GRU), an encoder-decoder
# with a summed loss and global_clipnorm (BART)
CORPUS_RANKS = ["resnet-hub", "gru", "bart-sum-clipped"]
RANK_VNODES = 8
RANK_TIMEOUT = 240  # mpiexec -n 2, 2 steps: ~25 s for ours, ~100 s for the ResNet, on 2 busy cores
FAILING_ON_RANKS = {}


def _data(name, model, path, rows):
    """An .npz of ``rows`` random examples for ``model``'s training signature (corpus model
    ``name``'s own inputs for one of the corpus)."""
    import tensorflow as tf

    from vfgraph.testing.compare import make_inputs

    sample = corpus.sample if name in corpus.ALL else make_inputs
    np.savez(path, **sample(tf.saved_model.load(model).signatures["train"], rows, seed=3))
    return path


@pytest.fixture(scope="module")
def one_process(source, tmp_path_factory):
    """``get(names)``: each model of ``names`` rewritten unpartitioned with 8 virtual nodes of 2
    examples and trained by ``vfgraph train`` in one process at one intra-op thread (the
    worker's), once: name -> (its data, the trained model, or an error)."""
    root = tmp_path_factory.mktemp("one_process")
    made = {}

    def get(names):
        if names not in made:
            made[names] = _train_one_process(names, source, root / f"group{len(made)}")
        return made[names]

    return get


def _train_one_process(names, source, root):
    import vfgraph

    os.makedirs(root)
    cases = []
    for name in names:
        src = source(name)
        base = vfgraph.save(vfgraph.rewrite(src, vnodes=RANK_VNODES, vnode_batch=VNODE_BATCH, allreduce="none"),
                            str(root / name))
        cases.append({"name": name, "train": base, "data": _data(name, src, str(root / f"{name}.npz"), 64),
                      "batch": RANK_VNODES * VNODE_BATCH, "out": str(root / f"{name}_trained")})
    done = run_worker(cases, str(root))
    return {c["name"]: (c["data"], done[c["name"]].get("trained") or done[c["name"]]["error"]) for c in cases}


def _params_of(path):
    import tensorflow as tf

    loaded = tf.saved_model.load(path)  # (a signature needs its object alive)
    return {v.name: v.numpy() for v in loaded.signatures["train"].variables}


def _mpi_train(model, data, out, timeout=RANK_TIMEOUT):
    """``mpiexec -n 2 vfgraph train`` at one intra-op thread per rank: (exit code, stderr), or
    (None, ...) when it had not ended after ``timeout`` s (then killed)."""
    cmd = [os.path.join(BIN, "mpiexec"), "-n", "2", sys.executable, "-m", "vfgraph.cli", "train", model, "--data",
           data, "--steps", str(STEPS), "--batch-size", str(RANK_VNODES * VNODE_BATCH), "-o", out, "--no-progress",
           "--threads", "1"]
    proc = subprocess.Popen(cmd, env=ENV, stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, text=True,
                            start_new_session=True)
    try:
        _, err = proc.communicate(timeout=timeout)
    except subprocess.TimeoutExpired:
        os.killpg(proc.pid, signal.SIGKILL)  # a hung job does not end on SIGTERM
        proc.communicate()
        return None, f"no end after {timeout} s"
    return proc.returncode, err


def _rank_params(names, marks=()):
    return [pytest.param(n, marks=[*marks, *([pytest.mark.xfail(strict=True, reason=FAILING_ON_RANKS[n])]
                                             if n in FAILING_ON_RANKS else [])]) for n in names]


def _check_on_ranks(source, trained, tmp_path, name):
    import vfgraph

    from vfgraph.testing.compare import rel_diff

    data, want = trained[name]
    assert os.path.isdir(want), want
    staged = vfgraph.save(vfgraph.rewrite(source(name), vnodes=RANK_VNODES, vnode_batch=VNODE_BATCH, stages=2),
                          str(tmp_path / "staged"))
    code, err = _mpi_train(staged, data, str(tmp_path / "ranks"))
    assert code == 0, (err or "")[-2000:]
    a, b = _params_of(want), _params_of(str(tmp_path / "ranks"))
    assert sorted(a) == sorted(b)
    worst = max((rel_diff(a[k], b[k]), k) for k in a if a[k].dtype.kind == "f")
    print(f"{name}: largest relative difference {worst[0]:.3g} ({worst[1]})")  # (pytest -rP shows it)
    assert worst[0] <= RTOL, f"{worst[1]} differs by {worst[0]:.3g}"


@pytest.mark.mpi
@pytest.mark.parametrize("name", _rank_params(RANKS))
def test_stages_on_ranks_train_the_unpartitioned_step(source, one_process, tmp_path, name):
    """2 stages on 2 MPI ranks, 8 virtual nodes of 2 examples: the parameters one process trains
    with the unpartitioned rewrite, never a hang."""
    _check_on_ranks(source, one_process(tuple(RANKS)), tmp_path, name)


@pytest.mark.mpi
@pytest.mark.parametrize("name", _rank_params(CORPUS_RANKS, [pytest.mark.corpus]))
def test_corpus_stages_on_ranks_train_the_unpartitioned_step(source, one_process, tmp_path, name):
    _check_on_ranks(source, one_process(tuple(CORPUS_RANKS)), tmp_path, name)


# ---------------------------------------------------------------------------- every cut of a small model
CUT_MODEL = "stateless-stage"  # Keras layers, a parameter-free layer norm (moments, StopGradient): 20 forward ops


@pytest.fixture(scope="module")
def every_cut(source, tmp_path_factory):
    """``CUT_MODEL`` cut into 2 stages on devices at each of its forward ops in turn (8 virtual
    nodes of 2 examples): op -> the worker's report, or {"refused": message}."""
    import vfgraph

    root = str(tmp_path_factory.mktemp("every_cut"))
    src = source(CUT_MODEL)
    base = vfgraph.save(vfgraph.rewrite(src, vnodes=8, vnode_batch=VNODE_BATCH, allreduce="none"),
                        os.path.join(root, "base"))
    cases, out = [], {}
    for i, op in enumerate(forward_ops(src)):
        try:
            item = vfgraph.rewrite(src, vnodes=8, vnode_batch=VNODE_BATCH, allreduce="none", stages=2,
                                   devices=_devices(2), split_at=[op])
        except VfgraphError as e:
            out[op] = {"name": op, "refused": str(e)}
            continue
        cases.append({"name": op, "baseline": base, "model": vfgraph.save(item, os.path.join(root, f"cut{i}")),
                      "batch": 8 * VNODE_BATCH})
    out.update(run_worker(cases, root, timeout=120))
    return out


def test_every_cut_trains_the_step_or_is_refused_in_one_line(every_cut):
    """Each cut either trains equal to the uncut step or is refused with one line naming the
    op; never a wrong result, never a hang (the worker's timeout), and most cuts train."""
    trained = 0
    for op, rep in sorted(every_cut.items()):
        if "refused" in rep:
            assert "\n" not in rep["refused"] and op in rep["refused"], (op, rep["refused"])
            continue
        assert "error" not in rep, (op, rep["error"])
        assert rep["params"] <= RTOL and rep["loss"] <= 10 * RTOL, (op, rep)
        trained += 1
    assert trained >= len(every_cut) // 2, every_cut
