"""The stage plan: forward ops cut into K balanced stages, backward ops and every variable's
gradient, update and optimizer state placed with the forward ops that read the variable."""
import pytest

from vfgraph.errors import InputError

MODELS = ["mlp:sgd", "mlp:adam", "cnn", "transformer"]


_analysed = {}


def analysed(path):
    """(graph, train step) of the model at ``path``, analysed once."""
    if path not in _analysed:
        import vfgraph
        from vfgraph.analysis.train_step import analyze_train_step
        from vfgraph.ir.graph import FunctionGraph

        item = vfgraph.load(path)
        sig = item.training_signature()
        g = FunctionGraph(item.library[sig.function], item.library)
        _analysed[path] = g, analyze_train_step(g, sig)
    return _analysed[path]


@pytest.fixture(scope="module")
def step_of(models):
    return lambda name: analysed(models(name))


@pytest.fixture(scope="module")
def deep_mlp(tmp_path_factory):
    """An MLP of six equal hidden layers (64 -> 64), and a small output layer."""
    import export
    import keras

    keras.utils.set_random_seed(0)
    model = keras.Sequential([keras.Input((64,))] + [keras.layers.Dense(64, activation="relu") for _ in range(6)]
                             + [keras.layers.Dense(10)])
    path = str(tmp_path_factory.mktemp("deep") / "mlp6")
    export._digits_module(path, model, "adam", 0.01)
    return path


def plan(step_of, name, k, split_at=()):
    from vfgraph.analysis.stages import plan_stages

    g, step = step_of(name) if isinstance(name, str) else analysed(name[0])
    return plan_stages(g, step, k, split_at)


def stage_of_tensor(p, ref):
    if ref.node in p.split_nodes:
        return p.split_nodes[ref.node][int(ref.index) if ref.arg == "output" else 0]
    return p.node_stage[ref.node]


def owners(p):
    """Variable name -> the stages that hold it as their own (variables or optimizer state)."""
    found = {}
    for st in p.stages:
        for v in st.variables + st.optimizer_state:
            found.setdefault(v, []).append(st.index)
    return found


def test_one_stage_holds_everything(step_of):
    g, step = step_of("mlp:adam")
    p = plan(step_of, "mlp:adam", 1)
    sig = step.signature
    (st,) = p.stages
    assert p.cuts == () and p.shared == () and p.misplaced == ()
    assert set(st.variables + st.optimizer_state + p.replicated) == {v.name for v in sig.variables.values()}
    assert set(st.variables) == {sig.variables[r].name for r in step.trainable}
    assert st.forward_ops + st.backward_ops - 1 == len(p.node_stage)  # the gradients' IdentityN counted once
    assert st.flops == p.flops and st.parameter_bytes == (64 * 32 + 32 + 32 * 10 + 10) * 4
    assert st.optimizer_state_bytes == 2 * st.parameter_bytes  # Adam's two moments
    assert p.placement["unplaced"] == 0


@pytest.mark.parametrize("k", [2, 3])
def test_equal_layers_are_balanced(step_of, deep_mlp, k):
    p = plan(step_of, (deep_mlp,), k)
    assert len(p.stages) == k
    assert p.max_stage_flops <= 1.25 * p.flops / k, [s.flops for s in p.stages]
    kernels = [[v for v in st.variables if v.endswith("kernel")] for st in p.stages]
    assert all(kernels) and sum(map(len, kernels)) == 7  # the dense layers, split between the stages
    for c in p.cuts:  # an activation of 64 floats (and little else) crosses each cut
        assert 64 * 4 <= c.bytes <= 3 * 64 * 4, c


@pytest.mark.parametrize("k", [2, 3, 4])
def test_cuts_keep_a_layer_fused(step_of, deep_mlp, k):
    """No stage starts between a matrix product and the bias and activation TensorFlow fuses
    into it: each stage starts at a layer's MatMul."""
    g, _ = analysed(deep_mlp)
    p = plan(step_of, (deep_mlp,), k)
    assert [g.op_types()[c.before] for c in p.cuts] == ["MatMul"] * (k - 1), [c.before for c in p.cuts]


def test_best_cuts_avoid_closed_positions():
    from vfgraph.analysis.stages import _best_cuts

    w, live = [4, 1, 4, 1], [0] * 4
    assert _best_cuts(w, w, live, 2) == [2]
    assert _best_cuts(w, w, live, 2, [False, False, True, False]) == [1]  # the next best balance
    assert _best_cuts(w, w, live, 2, [False, True, True, True]) == [2]  # none open: as if none were closed


@pytest.mark.parametrize("name", MODELS)
def test_every_variable_and_its_state_on_one_stage(step_of, name):
    g, step = step_of(name)
    sig = step.signature
    for k in (2, 3):
        p = plan(step_of, name, k)
        assert len(p.stages) == k and p.placement["unplaced"] == 0 and p.misplaced == ()
        held = owners(p)
        assert all(len(s) == 1 for s in held.values()), held
        assert set(held) | set(p.replicated) == {v.name for v in sig.variables.values()}
        assert not set(held) & set(p.replicated) and p.shared == ()
        assert sum(s.forward_ops for s in p.stages) == len(p.order)
        bounds = [p.order.index(s.first) for s in p.stages] + [len(p.order)]
        assert bounds == sorted(bounds) and all(p.node_stage[n] == i + 1 for i in range(k)
                                                for n in p.order[bounds[i]:bounds[i + 1]])
        for c in step.cut:  # each gradient is computed on its variable's stage, with its update's state
            names = [sig.variables[r].name for r in [c.variable] + list(c.writes) if r]
            stages = {held[n][0] for n in names if n in held}
            assert stages == {stage_of_tensor(p, c.ref)}, (c.ref, names, stages)


@pytest.mark.parametrize("name", ["mlp:sgd", "cnn", "transformer"])
def test_backward_ops_go_with_the_forward_op_they_differentiate(step_of, name):
    g, step = step_of(name)
    for k in (2, 3):
        p = plan(step_of, name, k)
        checked = 0
        for n, st in p.node_stage.items():
            if not n.startswith("gradient_tape/"):
                continue
            parts = n.split("/")[1:]
            for j in range(len(parts) - 1, 0, -1):  # ops in a forward op's scope
                fwd = "/".join(parts[:j])
                if fwd in p.node_stage and not fwd.startswith("gradient_tape/"):
                    assert st == p.node_stage[fwd], (n, fwd)
                    checked += 1
                    break
        assert checked >= 5
        # the weight gradient of each dense layer lands on that layer's stage
        for n, st in p.node_stage.items():
            if n.endswith("/MatMul/MatMul_1") and n.startswith("gradient_tape/"):
                assert st == p.node_stage[n[len("gradient_tape/"):-len("/MatMul_1")]]


def test_split_at_is_honoured(step_of):
    g, step = step_of("mlp:sgd")
    auto = plan(step_of, "mlp:sgd", 2)
    second = next(n for n in auto.order if n.endswith("/MatMul") and n != auto.stages[0].first)
    p = plan(step_of, "mlp:sgd", 2, [second])
    assert p.chosen == "split-at" and p.stages[1].first == second
    assert [len(s.variables) for s in p.stages] == [2, 2] and p.misplaced == ()
    assert p.cuts[0].tensors == ((p.cuts[0].tensors[0][0], 32 * 4),) and "Relu" in p.cuts[0].tensors[0][0]
    assert p.to_json()["stages"][1]["first"] == second


def test_bad_split_and_stage_counts(step_of):
    order = plan(step_of, "mlp:sgd", 1).order
    matmuls = [n for n in order if n.endswith("/MatMul")]
    with pytest.raises(InputError, match="'nonsense': not a forward op"):
        plan(step_of, "mlp:sgd", 2, ["nonsense"])
    with pytest.raises(InputError, match="not a forward op"):
        plan(step_of, "mlp:sgd", 2, ["gradient_tape/" + matmuls[1] + "/MatMul"])  # a backward op
    with pytest.raises(InputError, match=f"split at '{matmuls[1]}'.*does not come after"):
        plan(step_of, "mlp:sgd", 3, [order[-1], matmuls[1]])
    with pytest.raises(InputError, match="first forward op"):
        plan(step_of, "mlp:sgd", 2, [order[0]])
    with pytest.raises(InputError, match="1 split point.*3 stages"):
        plan(step_of, "mlp:sgd", 3, [matmuls[1]])
    with pytest.raises(InputError, match="at least 1 stage"):
        plan(step_of, "mlp:sgd", 0)
    with pytest.raises(InputError, match=r"only \d+ forward op\(s\) with an estimated cost"):
        plan(step_of, "mlp:sgd", 99)


def test_the_plan_is_deterministic(step_of, models):
    a = plan(step_of, "transformer", 3).to_json()
    assert plan(step_of, "transformer", 3).to_json() == a
    _analysed.pop(models("transformer"))
    assert plan(step_of, "transformer", 3).to_json() == a  # loaded and analysed again


def test_cost_estimates():
    from vfgraph.analysis.stages import _einsum_size, _elements

    assert _elements([-1, 8, 16]) == 128 and _elements(None) == 1
    assert _einsum_size("abc,cde->abde", [[-1, 8, 16], [16, 2, 8]]) == 8 * 16 * 2 * 8


def inspect(capsys, *argv):
    """``vfgraph inspect ARGV`` in this process: (exit code, stdout)."""
    from vfgraph import cli

    capsys.readouterr()
    code = cli.main(["inspect", *map(str, argv)])
    return code, capsys.readouterr().out


def test_inspect_prints_the_plan(models, step_of, capsys):
    import json

    code, out = inspect(capsys, models("mlp:adam"), "--stages", 2)
    assert code == 0
    table = out[out.index("stages of signature 'train': 2"):].splitlines()
    assert table[1].split()[:4] == ["stage", "fwd", "ops", "bwd"]
    assert [r.split()[0] for r in table[2:4]] == ["1", "2"] and table[4].startswith("  cut 1|2: 1 tensor(s), 128 B")
    assert "on every stage: adam/learning_rate, adam/iteration" in out and "unplaced" not in out
    second = [n for n in plan(step_of, "mlp:adam", 1).order if n.endswith("/MatMul")][1]  # the output layer
    code, out = inspect(capsys, models("mlp:adam"), "--split-at", second, "--json")
    assert code == 0
    got = json.loads(out)["stages"]
    assert got["count"] == 2 and got["chosen"] == "split-at" and got["stages"][1]["first"] == second
    (crossing,) = got["cuts"][0]["tensors"]
    assert crossing["tensor"].endswith("/Relu:activations:0") and crossing["bytes"] == 32 * 4
    assert [v.rsplit("/", 1)[1] for v in got["stages"][0]["variables"]] == ["kernel", "bias"]
    assert got == plan(step_of, "mlp:adam", 2, [second]).to_json()


def test_inspect_refuses_bad_stages(models, capsys):
    from vfgraph.testing.cli import error_line, run_in_process

    mlp = models("mlp:sgd")
    for argv, want in [(["--stages", 0], "--stages 0: out of range; give a whole number at least 1"),
                       (["--stages", 99], "99 stages: signature 'train' has only"),
                       (["--stages", 2, "--split-at", "nope"], "split at 'nope': not a forward op"),
                       (["--stages", 3, "--split-at", "Mean"], "1 split point(s) for 3 stages"),
                       (["--stages", 2, "--train-signature", "nope"], "--stages: ")]:
        code, err = run_in_process(capsys, "inspect", mlp, *argv)
        assert code == 2 and want in error_line(err), (argv, err)
    code, err = run_in_process(capsys, "inspect", mlp, "--split-at", "Mean", "--train-signature", "nope")
    assert code == 2 and "--split-at: " in error_line(err) and "no training signature 'nope'" in error_line(err)
