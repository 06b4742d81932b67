"""Pipeline stages on MPI ranks under real ``mpiexec``: ``mpiexec -n K vfgraph train`` runs stage
k on rank k-1, tensors crossing the cuts sent with VfSend / VfRecv, and trains the parameters
one process trains with the same rewritten model (the unpartitioned step with the same V);
``mpiexec -n K*D`` runs D replicas of the pipeline."""
import json
import os
import re
import signal
import subprocess

import pytest

from test_mpi_train import ENV, _rank_pid, assert_same_params, losses, run_train, train_cmd, wait_for_checkpoint

pytestmark = pytest.mark.mpi

# (model, stages, schedule): ours, and transformers of the real-architecture corpus (Llama,
# ViT: keras-hub). The first two stages of a 3-stage cut receive gradients, so they run their
# virtual nodes as a forward and a backward call.
# (The MLP under GPipe and at K=3 runs in one process over devices, test_partition_stages.py.)
CASES = [("mlp:adam", 2, "1f1b"), ("cnn", 2, "1f1b"), ("llama", 3, "1f1b"), ("vit", 2, "gpipe")]
EXAMPLES = 8 * 8 * 3  # 3 steps of 8 virtual nodes of 8 examples


@pytest.fixture(scope="module")
def staged(models, tmp_path_factory):
    """Models rewritten with 8 virtual nodes of 8 examples cut into stages on ranks."""
    import vfgraph

    root = tmp_path_factory.mktemp("staged")
    made = {}

    def get(name, k, schedule):
        key = (name, k, schedule)
        if key not in made:
            out = str(root / f"{name.replace(':', '_')}_k{k}_{schedule}")
            vfgraph.save(vfgraph.rewrite(models(name), vnodes=8, vnode_batch=8, stages=k, schedule=schedule), out)
            made[key] = out
        return made[key]

    return get


@pytest.mark.parametrize("name, k, schedule", [("transformer:sgd", 3, "1f1b"), ("mlp:adam", 2, "gpipe")])
def test_stage_loops_overlap_their_virtual_nodes(models, name, k, schedule):
    """Each stage's virtual-node loop lets consecutive virtual nodes run at once: its body has
    no control outputs (lowered, they would hold the next iteration until the whole call, sends
    and receives included, was done) and waits for the call through a carried token; under 1F1B
    stage s (from 0) > 0 starts virtual node i's messages once virtual node i - (K - s) has
    finished, under GPipe no stage waits. A stage that receives gradients (all but the last)
    calls a forward and then a backward, its forward once the last virtual node's forward has
    finished (the last token the loop carries), so that the forwards run in order."""
    import vfgraph
    from vfgraph.ir.graph import FunctionGraph

    item = vfgraph.rewrite(models(name), vnodes=8, vnode_batch=8, stages=k, schedule=schedule)
    for s in range(k):
        (body,) = [f for name, f in item.library.items() if name.endswith(f"_vnodes_stage{s + 1}_body")]
        assert not body.control_ret and not body.signature.control_output
        g = FunctionGraph(body, item.library)
        args = [a.name for a in body.signature.input_arg]
        calls = sorted(n for n in g.nodes if g.nodes[n].op == "StatefulPartitionedCall")
        assert calls == (["vnode"] if s == k - 1 else ["forward", "vnode"])
        if s < k - 1:
            (after,) = [t.node for t, ctl in g.inputs("forward") if ctl]
            assert g.data_inputs(after)[0].node == args[args.index("nv") - 1]  # the forward's token
            assert any(t.node == "forward" for t in g.data_inputs("vnode"))  # what it left the backward
        (finished,) = [n for n in g.nodes if n.startswith("finished")]
        assert {t.node for t, ctl in g.inputs(finished) if ctl} >= set(calls)
        waits = [t.node for t, ctl in g.inputs("tags") if ctl]
        if schedule == "1f1b" and s:
            (after,) = waits
            token = g.data_inputs(after)[0]
            assert token.is_function_arg
            # the token of virtual node i - (K - s): the last of the K - s the loop carries
            # (before the forward's)
            assert args.index(token.node) == args.index("nv") - 1 - (s < k - 1)
            assert sum(1 for a in args[:args.index("nv")] if a.startswith("carried_")) >= k - s
        else:
            assert not waits


@pytest.mark.parametrize("name, k, schedule", CASES, ids=[f"{n}-k{k}-{s}" for n, k, s in CASES])
def test_stages_on_ranks_train_what_one_process_trains(staged, digits, corpus_data, tmp_path, name, k, schedule):
    import corpus

    model = staged(name, k, schedule)
    data = corpus_data(name, EXAMPLES) if name in corpus.CORPUS else digits["train"]
    one, ranks = str(tmp_path / "one"), str(tmp_path / "ranks")
    run_train(0, model, data, one, 3)
    run_train(k, model, data, ranks, 3)
    # ViT's attention key biases have a zero gradient but for rounding (softmax does not see a
    # shift of every key): after 3 steps they hold ~1e-9, which the two runs' summation orders
    # round differently (relative to the 1e-3 floor: ~1e-6); a real difference is far larger
    assert_same_params(one, ranks, 3e-6 if name == "vit" else 1e-6)
    for a, b in zip(losses(one), losses(ranks)):
        assert b == pytest.approx(a, rel=1e-6)
    from vfgraph import records
    from vfgraph.records import Stages

    rec = records.read(model, Stages)["train"]
    assert rec.on_ranks and rec.signatures == tuple(f"train_stage_{i + 1}" for i in range(k))
    assert os.path.isdir(ranks + ".serving/1")


def test_a_wrong_number_of_ranks_is_one_line(staged, digits, tmp_path):
    model = staged("mlp:adam", 2, "1f1b")
    res = subprocess.run(train_cmd(3, model, digits["train"], str(tmp_path / "o"), 1), capture_output=True, text=True,
                         env=ENV, timeout=300)
    assert res.returncode == 2, res.stderr[-2000:]
    assert "cut into 2 pipeline stages, one per MPI rank" in res.stderr and "start 2 ranks" in res.stderr
    assert not os.path.exists(tmp_path / "o")


def test_replicas_of_the_stages_train_what_one_process_trains(staged, digits, tmp_path):
    """2 replicas x 2 stages on 4 ranks: each replica runs half the virtual nodes, each stage's
    gradients are summed over its two ranks (in another order than one process adds them:
    momentum, as the data-parallel tests, keeps that rounding within 1e-6)."""
    model = staged("mlp:momentum", 2, "1f1b")
    one, ranks = str(tmp_path / "one"), str(tmp_path / "ranks")
    run_train(0, model, digits["train"], one, 3)
    res = run_train(4, model, digits["train"], ranks, 3)
    assert_same_params(one, ranks, 1e-6)
    for a, b in zip(losses(one), losses(ranks)):
        assert b == pytest.approx(a, rel=1e-6)
    held = {int(r): (int(s), int(d), int(n)) for r, s, d, n in re.findall(
        r"rank (\d) \(stage (\d) of 2, replica (\d)\): holds .* \((\d+) of \d+ bytes\)", res.stderr)}
    assert sorted(held) == [0, 1, 2, 3], res.stderr[-2000:]
    assert [(s, d) for s, d, _ in map(held.get, range(4))] == [(1, 1), (2, 1), (1, 2), (2, 2)]
    assert held[0][2] == held[2][2] and held[1][2] == held[3][2]


def test_each_stage_holds_and_checkpoints_only_its_variables(staged, digits, tmp_path):
    """A stage rank reads only its own variables from the model (the others are never
    allocated), writes them to its own checkpoint, and --resume restores each stage from its
    part: the resumed run ends where an uninterrupted one does."""
    from vfgraph import records
    from vfgraph.records import Stages

    model, steps = staged("mlp:adam", 2, "1f1b"), 600
    rec = records.read(model, Stages)["train"]
    whole = sum(p.parameter_bytes + p.optimizer_state_bytes for p in rec.parts)
    out = str(tmp_path / "stopped")
    state = out + ".ckpt/progress.json"
    proc = subprocess.Popen(train_cmd(2, model, digits["train"], out, steps, "--checkpoint-every", "5"),
                            stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, env=ENV)
    try:
        wait_for_checkpoint(proc, state, 10)
        os.kill(_rank_pid(1, out), signal.SIGINT)  # one rank's request stops every rank after the step
        err = proc.communicate(timeout=120)[1]
    finally:
        if proc.poll() is None:
            proc.kill()
    assert proc.returncode == 130, err[-2000:]
    held = dict((int(r), int(n)) for r, n in re.findall(r"rank (\d) \(stage .* \((\d+) of \d+ bytes\)", err))
    assert sorted(held) == [0, 1] and sum(held.values()) <= whole + 64, (held, whole)  # shares, not copies
    for k, h in held.items():  # its parameters and their Adam slots (and the step counter), no other stage's
        part = rec.parts[k]
        assert part.parameter_bytes + part.optimizer_state_bytes <= h <= \
            part.parameter_bytes + part.optimizer_state_bytes + 64, (k, h, part)
    with open(state) as f:
        saved = json.load(f)
    assert saved["step"] >= 10 and len(saved["stages"]) == 2  # the step it stopped after
    assert all(os.path.isfile(p + ".index") for p in saved["stages"])
    total = saved["step"] + 10
    run_train(2, model, digits["train"], out, total, "--checkpoint-every", "5", "--resume")
    reference = str(tmp_path / "uninterrupted")
    run_train(2, model, digits["train"], reference, total, "--checkpoint-every", "5")
    assert_same_params(reference, out, 1e-6)
    assert losses(out) == pytest.approx(losses(reference), rel=1e-6)


def test_a_killed_stage_rank_stops_the_job_naming_its_stage(staged, digits, tmp_path):
    """A stage rank killed mid-run ends the job within a minute (the other stage's wait for its
    messages ends with it), the report naming the rank's stage; the last checkpoint, one part
    per stage, is intact."""
    model = staged("mlp:adam", 2, "1f1b")
    out = str(tmp_path / "killed")
    state = out + ".ckpt/progress.json"
    proc = subprocess.Popen(train_cmd(2, model, digits["train"], out, 600, "--checkpoint-every", "5"),
                            stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, env=ENV)
    try:
        wait_for_checkpoint(proc, state, 10)
        victim = _rank_pid(1, out)
        assert victim is not None
        os.kill(victim, signal.SIGKILL)
        err = proc.communicate(timeout=60)[1]
    finally:
        if proc.poll() is None:
            proc.kill()
    assert proc.returncode != 0
    assert re.search(rf"rank 1 \(stage 2 of 2, replica 1; \S+ pid {victim}\) was killed by SIGKILL", err), err[-2000:]
    assert _rank_pid(0, out) is None  # the other stage's worker ended with the job
    with open(state) as f:
        saved = json.load(f)
    assert saved["step"] >= 10 and len(saved["stages"]) == 2
    assert all(os.path.isfile(p + ".index") for p in saved["stages"])


def test_deterministic_stages_and_replicas_train_bit_identical_parameters(models, digits, tmp_path):
    """With exact sums, 2 stages on 2 ranks and 2 replicas x 2 stages on 4 ranks train the very
    parameters one process trains, Adam's among them (whose default-mode replicas drift by
    rounding)."""
    import numpy as np

    import vfgraph
    from test_mpi_train import B, params

    model = str(tmp_path / "model")
    vfgraph.save(vfgraph.rewrite(models("mlp:adam"), vnodes=8, vnode_batch=B, stages=2, deterministic=True), model)
    outs = {ranks: str(tmp_path / f"ranks{ranks}") for ranks in (0, 2, 4)}
    for ranks, out in outs.items():
        run_train(ranks, model, digits["train"], out, 3)
    one = params(outs[0])
    for ranks in (2, 4):
        got = params(outs[ranks])
        assert [k for k in one if not np.array_equal(one[k], got[k])] == [], ranks
        assert losses(outs[ranks]) == losses(outs[0])
