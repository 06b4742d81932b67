"""A measured profile of a training step, and stage cuts that balance it (partition-stages
with balance=profile; vfgraph inspect --balance profile)."""
import json

import pytest

from vfgraph.errors import InputError

pytestmark = pytest.mark.alone  # the profiles time the step: not beside another test (pytest-xdist)

SINES = 80


@pytest.fixture(scope="module")
def sine_mlp(tmp_path_factory):
    """Three Dense(256), 80 sines, Dense(10): the sines cost far more than the estimate (one
    operation an element) says, so the estimate cuts between the second and third layer and
    leaves them all to stage 2."""
    import export
    import keras

    keras.utils.set_random_seed(0)
    layers = ([keras.Input((64,))] + [keras.layers.Dense(256, activation="relu") for _ in range(3)]
              + [keras.layers.Lambda(_sine, name=f"sine_{i}") for i in range(SINES)] + [keras.layers.Dense(10)])
    path = str(tmp_path_factory.mktemp("sine") / "sine_mlp")
    export._digits_module(path, keras.Sequential(layers), "sgd", 0.01)
    return path


def _sine(t):
    """x + sin(x) / 10: a sine whose gradient (1 + cos(x) / 10) keeps its size through 80 of them."""
    import tensorflow as tf

    return t + 0.1 * tf.sin(t)


def loaded(path):
    import vfgraph
    from vfgraph.analysis.train_step import analyze_train_step
    from vfgraph.ir.graph import FunctionGraph

    item = vfgraph.load(path)
    sig = item.training_signature()
    g = FunctionGraph(item.library[sig.function], item.library)
    return item, sig, g, analyze_train_step(g, sig)


def test_a_profile_times_each_op_and_leaves_the_model_alone(models):
    from vfgraph.analysis.profile import function_costs, profile_step
    from vfgraph.analysis.stages import op_flops
    from vfgraph.io.savedmodel import source_fingerprint

    path = models("mlp:adam")
    before = source_fingerprint(path)
    item, sig, g, step = loaded(path)
    prof = profile_step(path, sig, batch=64, steps=5)
    assert prof.batch == 64 and prof.steps == 5 and prof.step_us > 0
    per_example = {n: op_flops(g, n) for n in step.batch_dependent if n in g.nodes}
    cost = function_costs(prof, g, per_example)
    matmuls = [n for n, op in g.op_types().items() if op == "MatMul" and n in per_example]
    assert len(matmuls) == 2 + 3  # two layers' forward products, their weight gradients, one input gradient
    # Grappler fuses each forward MatMul with its BiasAdd (and ReLU): the product gets its share
    assert all(cost.get(n, 0) > 0 for n in matmuls), {n: cost.get(n) for n in matmuls}
    # one thread runs the ops one after another: their times fit in the step's
    assert 0 < sum(cost.values()) / 1000 <= 1.05 * prof.step_us
    assert source_fingerprint(path) == before


def test_profiled_cuts_balance_what_the_estimate_misjudges(sine_mlp):
    from vfgraph.analysis.profile import profile_step
    from vfgraph.analysis.stages import plan_stages

    item, sig, g, step = loaded(sine_mlp)
    estimate = plan_stages(g, step, 2)
    # the estimate sees the sines as nothing beside the products: it cuts between two layers
    assert estimate.chosen == "balanced" and not any("/sine_" in c for c in (estimate.cuts[0].after,
                                                                               estimate.cuts[0].before))
    assert all(st.forward_ns == -1 for st in estimate.stages)
    tries = []
    for _ in range(2):  # times on a shared machine: a second profile where a burst of load skewed the first
        prof = profile_step(sine_mlp, sig, batch=64, steps=5)
        measured = plan_stages(g, step, 2, profile=prof)
        timed = plan_stages(g, step, 2, [c.before for c in estimate.cuts], prof)
        assert measured.chosen == "measured" and measured.profile_batch == 64
        assert all(st.measured_ns > 0 for st in measured.stages)
        worst, worst_estimate = (max(st.measured_ns for st in p.stages) for p in (measured, timed))
        tries.append((measured.cuts[0].before, worst / worst_estimate))
        if "/sine_" in measured.cuts[0].before and worst < 0.8 * worst_estimate:
            break
    else:
        raise AssertionError(f"the profile's cut and its largest stage against the estimate's: {tries}")
    js = measured.to_json()
    assert js["chosen"] == "measured" and js["stages"][0]["measured_us"] == measured.stages[0].measured_ns / 1000


def test_rewrite_with_a_profile_names_its_cuts_to_repeat_it(sine_mlp):
    import vfgraph
    from vfgraph.ir.canonical import canonical_text

    out = vfgraph.rewrite(sine_mlp, vnodes=2, allreduce="none", stages=2, balance="profile", profile_batch=32)
    (note,) = [n for n in out.metadata.get("notes", []) if "profiled step" in n]
    split = note.rsplit("split at ", 1)[1]
    again = vfgraph.rewrite(sine_mlp, vnodes=2, allreduce="none", stages=2, split_at=[split])
    assert canonical_text(again) == canonical_text(out)


def test_the_cli_profiles_a_virtual_nodes_batch(models, capsys, tmp_path):
    from vfgraph.testing.cli import run_in_process

    code, err = run_in_process(capsys, "rewrite", models("mlp:sgd"), "--vnodes", 2, "--vnode-batch", 8, "--stages", 2,
                               "--balance", "profile", "--allreduce", "none", "-o", tmp_path / "out")
    assert code == 0, err
    (note,) = [line for line in err if "profiled step" in line]
    assert "per step of 8 examples" in note and "split at " in note


def test_inspect_with_a_profile(models, capsys):
    from vfgraph import cli

    capsys.readouterr()
    assert cli.main(["inspect", models("mlp:sgd"), "--stages", "2", "--balance", "profile",
                     "--profile-batch", "16"]) == 0
    out = capsys.readouterr().out
    assert "balanced by measured time" in out and "time per step of 16 examples" in out
    assert "the estimate's cuts (" in out and " ms measured" in out
    assert cli.main(["inspect", models("mlp:sgd"), "--stages", "2", "--balance", "profile", "--json"]) == 0
    got = json.loads(capsys.readouterr().out)
    assert got["stages"]["chosen"] == "measured" and got["stages"]["profile_batch"] == 32
    assert all(s["measured_us"] > 0 for s in got["stages"]["stages"])
    assert len(got["stages_by_estimate"]["stages"]) == 2


def test_profile_options_are_checked(models, capsys):
    from vfgraph.testing.cli import error_line, run_in_process

    mlp = models("mlp:sgd")
    for cmd, argv, want in [("inspect", ["--stages", 2, "--balance", "profile", "--profile-batch", 0],
                             "--profile-batch 0: out of range; give"),
                            ("inspect", ["--balance", "profile"], "--balance profile without --stages"),
                            ("rewrite", ["--vnodes", 2, "--balance", "profile"], "--balance profile without --stages")]:
        code, err = run_in_process(capsys, cmd, mlp, *argv)
        assert code == 2 and want in error_line(err), (cmd, argv, err)
    meta = models("tf1ckpt")  # a MetaGraphDef and its checkpoint: no SavedModel to run
    code, err = run_in_process(capsys, "inspect", meta, "--stages", 2, "--balance", "profile")
    assert code == 2 and f"{meta} is not one (balance by the estimate" in error_line(err), err


def test_a_profile_file_gives_the_same_rewrite_anywhere(models, capsys, tmp_path):
    """vfgraph profile writes a step's profile once; rewrite and inspect with --profile balance
    its times: the same file, the same cuts and byte-identical models, the profile untouched."""
    from vfgraph.analysis.profile import read_profile
    from vfgraph.analysis.stages import plan_stages
    from vfgraph.testing.cli import run_in_process, tree_digest

    mlp = models("mlp:sgd")
    prof = tmp_path / "mlp.json"
    code, err = run_in_process(capsys, "profile", mlp, "-o", prof, "--batch", 16, "--steps", 3)
    assert code == 0, err
    got = read_profile(str(prof))
    assert (got.signature, got.batch, got.steps) == ("train", 16, 3) and got.step_us > 0
    assert got.measured_on["tensorflow"] and got.measured_on["cpu"]
    item, sig, g, step = loaded(mlp)
    cuts = plan_stages(g, step, 2, profile=got).split_at
    written = prof.read_bytes()
    digests = []
    for k in range(2):
        out = tmp_path / f"out{k}"
        code, err = run_in_process(capsys, "rewrite", mlp, "--vnodes", 2, "--stages", 2, "--profile", prof,
                                   "--allreduce", "none", "-o", out)
        assert code == 0, err
        (note,) = [line for line in err if "profiled step" in line]
        assert f"per step of 16 examples, profile {prof}" in note and note.endswith("split at " + ";".join(cuts))
        digests.append(tree_digest(out))
    assert digests[0] == digests[1] and prof.read_bytes() == written
    capsys.readouterr()
    from vfgraph import cli

    assert cli.main(["inspect", mlp, "--stages", "2", "--profile", str(prof), "--json"]) == 0
    plan = json.loads(capsys.readouterr().out)["stages"]
    assert plan["chosen"] == "measured" and plan["profile_batch"] == 16
    assert [c["before"] for c in plan["cuts"]] == list(cuts)
    # written by vfgraph: replaced with --force only
    code, err = run_in_process(capsys, "profile", mlp, "-o", prof, "--batch", 8, "--steps", 1)
    assert code == 2 and "profile exists; choose another path, or pass --force" in err[-1], err
    code, err = run_in_process(capsys, "profile", mlp, "-o", prof, "--batch", 8, "--steps", 1, "--force")
    assert code == 0 and read_profile(str(prof)).batch == 8, err


def test_profile_files_are_checked(models, sine_mlp, capsys, tmp_path):
    from vfgraph.testing.cli import error_line, run_in_process

    mlp = models("mlp:sgd")
    prof = tmp_path / "mlp.json"
    code, err = run_in_process(capsys, "profile", mlp, "-o", prof, "--batch", 8, "--steps", 1)
    assert code == 0, err
    record = json.loads(prof.read_text())
    other = tmp_path / "other.json"
    other.write_text(json.dumps({"format": "something else"}))
    damaged = tmp_path / "damaged.json"
    damaged.write_text(json.dumps({**record, "ops": "none"}))
    renamed = tmp_path / "renamed.json"
    renamed.write_text(json.dumps({**record, "signature": "fit"}))
    text = tmp_path / "text.json"
    text.write_text("not json")
    stages = ["--stages", 2, "--profile"]
    for cmd, argv, want in [
            ("inspect", stages + [tmp_path / "none.json"], "none.json: no such profile; write one with 'vfgraph "
                                                           "profile MODEL -o"),
            ("inspect", stages + [text], "text.json: cannot read a profile from it"),
            ("inspect", stages + [other], 'other.json: not a step profile (no "format": "vfgraph-step-profile")'),
            ("rewrite", ["--vnodes", 2] + stages + [damaged], "damaged.json: a damaged profile"),
            ("rewrite", ["--vnodes", 2, "--allreduce", "none", "-o", tmp_path / "out"] + stages + [renamed],
             "renamed.json: a profile of signature 'fit', and the step to cut into stages is 'train'"),
            ("inspect", stages + [prof, "--balance", "estimate"], "--profile with --balance estimate"),
            ("inspect", stages + [prof, "--profile-batch", 8], "--profile-batch with --profile: the profile in"),
            ("rewrite", ["--vnodes", 2, "--profile", prof], "--profile without --stages"),
            ("rewrite", ["--pipeline", f"partition-stages{{profile={prof}}},split-vnodes{{vnodes=2}}"],
             "the cuts balance a profile's times with balance=profile only; give both"),
            ("profile", ["-o", tmp_path / "p.txt"], "a profile is a JSON file; give a path ending in .json"),
            ("profile", ["-o", tmp_path / "p.json", "--batch", 0], "--batch 0: give at least 1"),
            ("profile", ["-o", other], "other.json: exists and was not written by vfgraph")]:
        code, err = run_in_process(capsys, cmd, mlp, *argv)
        assert code == 2 and want in error_line(err), (cmd, argv, err)
    assert not (tmp_path / "out").exists() and json.loads(other.read_text()) == {"format": "something else"}
    # a profile of another model: few of its ops found
    code, err = run_in_process(capsys, "inspect", sine_mlp, "--stages", 2, "--profile", prof)
    assert code == 2 and "it is of another model or version" in error_line(err), err


def test_a_batch_for_the_profile():
    from tensorflow.core.framework import types_pb2

    from vfgraph.analysis.profile import synthetic_batch

    specs = [("x", types_pb2.DT_FLOAT, [-1, 3]), ("y", types_pb2.DT_INT64, [-1]), ("mask", types_pb2.DT_BOOL, [-1, 3])]
    b = synthetic_batch(specs, 5, "train")
    assert b["x"].shape == (5, 3) and b["x"].std() > 0 and not b["y"].any() and b["mask"].all()
    assert (synthetic_batch(specs, 5, "train")["x"] == b["x"]).all()  # seeded
    for spec, want in [(("tokens", types_pb2.DT_INT32, [-1, -1]), r"input 'tokens' has shape \[5, -1\], unknown past"),
                       (("text", types_pb2.DT_STRING, [-1]), "input 'text' is of type string, for which the profile"),
                       (("any", types_pb2.DT_FLOAT, None), "input 'any' has an unknown rank")]:
        with pytest.raises(InputError, match=want):
            synthetic_batch(specs + [spec], 5, "train")
