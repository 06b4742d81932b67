"""``vfgraph.rewrite``'s pass options are the passes' own: each keyword is the option of a pass of
the default pipeline that declares the ``vfgraph rewrite`` flag of that name, with its default,
its check (the same problem text as the command line's) and its help; nothing in the API repeats
them. ``vfgraph.export``'s slice size is checked by microbatch-inference's declaration."""
import dataclasses
import inspect
import os
import pydoc
import re
import sys

import pytest

import vfgraph
from vfgraph import api
from vfgraph.errors import InputError
from vfgraph.passes.base import OptionError, flags, parse_pipeline, registered
from vfgraph.testing.cli import error_line, run_in_process

MODEL = os.path.join(os.path.dirname(os.path.abspath(__file__)), "goldens", "split-vnodes",
                     "linear_manual.before.pbtxt")
ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


def _declared(pass_name: str, field: str) -> dataclasses.Field:
    """Option ``field`` of pass ``pass_name``, as its pass declares it."""
    return next(f for f in dataclasses.fields(registered()[pass_name]) if f.name == field)


def _bad_value(declared: dataclasses.Field):
    """A value the declaration ``declared`` refuses (below its bounds; of another type)."""
    meta = declared.metadata
    if meta.get("choices"):
        return "none-of-these"
    if meta.get("low") is not None:
        return type(declared.default)(meta["low"] - 1)
    if meta.get("above") is not None:
        return type(declared.default)(meta["above"])
    return 1.5


def test_the_keywords_are_the_default_pipeline_passes_flags():
    """Every option of a default-pipeline pass with a flag is a keyword of ``vfgraph.rewrite`` (and
    nothing else is), keyword-only, None by default (its pass's default)."""
    params = inspect.signature(vfgraph.rewrite).parameters
    declared = {(cls.name, f.name): f for cls in api.DEFAULT_PASSES for f in dataclasses.fields(cls)
                if f.metadata.get("flag")}
    options = api.pass_options()
    assert {s for f in options.values() for s in f.sets} == set(declared)
    assert {"vnodes", "vnode_batch", "fusion_mb", "stages", "devices", "split_at", "schedule", "balance",
            "profile_batch", "profile", "deterministic", "train_signature", "memory_budget", "memory_margin"} == set(options)
    for key in options:
        assert params[key].kind is inspect.Parameter.KEYWORD_ONLY and params[key].default is None, key
    own = [p for p in params if p not in options]
    assert own[0] == "model" and "pipeline" in own and "allreduce" in own


def test_an_option_left_out_keeps_its_pass_default():
    """The default pipeline built for no options, and for every option at once, holds the passes'
    declared defaults in each option not given (read from the declarations, not from the API)."""
    for given in ({}, {"split_at": ["a"], "stages": 2}):
        passes = parse_pipeline(api.default_pipeline(True, True, **given))
        assert [p.name for p in passes] == [cls.name for cls in api.DEFAULT_PASSES[0 if given else 1:]]
        for p in passes:
            for f in dataclasses.fields(p):
                if f.name not in ("split_at", "stages"):
                    assert getattr(p, f.name) == _declared(p.name, f.name).default, (p.name, f.name, given)
    # each keyword given reaches every option it sets, and only those
    values = {"vnodes": 3, "vnode_batch": 5, "fusion_mb": 8.0, "stages": 3, "devices": ["/CPU:0", "/CPU:1", "/CPU:2"],
              "split_at": ["a", "b"], "schedule": "gpipe", "balance": "profile", "profile_batch": 7,
              "deterministic": True, "train_signature": "step"}
    passes = {p.name: p for p in parse_pipeline(api.default_pipeline(True, True, **values))}
    assert list(passes) == [cls.name for cls in api.DEFAULT_PASSES]
    for key, flag in api.pass_options().items():
        for pass_name, field in flag.sets:
            want = ";".join(values[key]) if key in ("devices", "split_at") else values.get(key, flag.default)
            assert getattr(passes[pass_name], field) == want, (key, pass_name, field)


def test_a_rewrite_without_options_runs_the_passes_at_their_defaults(models):
    from vfgraph import records
    from vfgraph.records import VirtualNodes

    item = vfgraph.rewrite(models("mlp:sgd"), allreduce="none")
    assert item.metadata["history"][-1]["pipeline"] == "split-vnodes,microbatch-inference"
    assert records.get(item, VirtualNodes)["train"].vnodes == _declared("split-vnodes", "vnodes").default


@pytest.mark.parametrize("key", sorted(set(api.pass_options()) - {"deterministic"}))
def test_a_bad_value_is_refused_by_its_pass_as_on_the_command_line(capsys, tmp_path, key):
    """A value an option's declaration refuses raises its pass's OptionError before any work, with
    the problem the command line names for its flag."""
    flag = api.pass_options()[key]
    pass_name, field = flag.sets[0]
    declared = _declared(pass_name, field)
    bad = _bad_value(declared)
    with pytest.raises(OptionError) as refused:
        vfgraph.rewrite(MODEL, **{key: bad})
    e = refused.value
    assert (e.pass_name, e.option) == (pass_name, field.replace("_", "-")), e
    assert str(e) == f"pass {pass_name!r}: option {field.replace('_', '-')}={bad}: {e.problem}"
    if declared.metadata.get("choices"):  # (argparse refuses it on the command line; the pass, in Python)
        assert e.problem == f"choose {' or '.join(declared.metadata['choices'])}"
    if flag.type is str:  # (a command line's value is text: the same problem cannot arise there)
        return
    argv = [flag.flag, bad] + (["--stages", 2, "--balance", "profile"] if key == "profile_batch" else [])
    code, err = run_in_process(capsys, "rewrite", MODEL, *argv, "-o", tmp_path / "o")
    shown = f"{bad:g}" if isinstance(bad, float) else str(bad)
    assert code == 2 and error_line(err) == f"vfgraph rewrite: error: {flag.flag} {shown}: {e.problem}", err
    assert not (tmp_path / "o").exists()


def test_an_unknown_keyword_names_the_known_ones():
    with pytest.raises(TypeError) as refused:
        vfgraph.rewrite(MODEL, vnode=4)
    text = str(refused.value)
    assert "'vnode'" in text and all(k in text for k in api.pass_options()) and "pipeline" in text


def test_help_lists_each_pass_option_with_its_declared_help():
    text = " ".join(pydoc.render_doc(vfgraph.rewrite, renderer=pydoc.plaintext).split())
    for key, flag in api.pass_options().items():
        assert re.search(rf"\b{key}: '?Optional\[", text), key
        assert f"``{key}`` (" in text and " ".join(flag.help.split()) in text, key


def test_a_pass_option_with_a_pipeline_is_refused():
    with pytest.raises(InputError, match="--train-signature step, --deterministic with a pipeline"):
        vfgraph.rewrite(MODEL, pipeline="split-vnodes", deterministic=True, train_signature="step")
    with pytest.raises(InputError, match="--devices /CPU:0,/CPU:1 with a pipeline"):
        vfgraph.rewrite(MODEL, pipeline="split-vnodes", devices=["/CPU:0", "/CPU:1"])


def test_export_slices_are_checked_by_microbatch_inference(capsys, tmp_path):
    """``export``'s --vnode-batch is microbatch-inference's option: its check, its problem text."""
    (flag,) = [f for f in flags(["microbatch-inference"]) if f.flag == "--vnode-batch"]
    problem = flag.problem(-2).problem
    assert flag.problem(-2).pass_name == "microbatch-inference" and "out of range" in problem
    with pytest.raises(InputError, match=f"^--vnode-batch -2: {re.escape(problem)}$"):
        vfgraph.export(MODEL, tmp_path / "o", vnode_batch=-2)
    with pytest.raises(InputError, match="--vnode-batch 2.5: give a whole number"):
        vfgraph.export(MODEL, tmp_path / "o", vnode_batch=2.5)
    code, err = run_in_process(capsys, "export", MODEL, "-o", tmp_path / "o", "--vnode-batch", -2)
    assert code == 2 and error_line(err) == f"vfgraph export: error: --vnode-batch -2: {problem}", err
    code, err = run_in_process(capsys, "rewrite", MODEL, "--vnode-batch", -2, "-o", tmp_path / "r")
    assert code == 2 and error_line(err) == f"vfgraph rewrite: error: --vnode-batch -2: {problem}", err
    assert not (tmp_path / "o").exists() and not (tmp_path / "r").exists()


def test_bench_pipeline_reads_the_stage_signatures_from_the_record(models, tmp_path, monkeypatch):
    from vfgraph import records
    from vfgraph.records import Stages

    monkeypatch.syspath_prepend(os.path.join(ROOT, "tools"))
    sys.modules.pop("bench_pipeline", None)
    import bench_pipeline

    out = str(tmp_path / "staged")
    item = vfgraph.rewrite(models("mlp:sgd"), vnodes=4, vnode_batch=8, stages=2)
    vfgraph.save(item, out)
    names = records.read(out, Stages)["train"].signatures
    assert len(names) == 2 and set(names) <= set(item.meta_graph.signature_def)
    assert [bench_pipeline.stage_signature(out, rank) for rank in range(4)] == [*names, *names]
