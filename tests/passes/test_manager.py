"""The pass manager and the registry: a pass is one module (here, one class in a test), and
the manager holds every pass to its contract (requires, produces, edits, errors, verify)."""
import dataclasses
import os
from dataclasses import dataclass
from typing import ClassVar

import pytest

import vfgraph
from vfgraph import records
from vfgraph.errors import DetectionError, InternalError, PipelineError, VfgraphError
from vfgraph.ir.canonical import canonical_text
from vfgraph.passes import base
from vfgraph.passes.base import Pass, PassResult, option, parse_pipeline, register, registered
from vfgraph.passes.manager import PassManager
from vfgraph.records import Microbatch, VirtualNodes
from vfgraph import cli

GOLDENS = os.path.join(os.path.dirname(os.path.dirname(os.path.abspath(__file__))), "goldens")
MODEL = os.path.join(GOLDENS, "split-vnodes", "linear_manual.before.pbtxt")


def _rename_pass(toy_passes):
    @toy_passes
    @dataclass(frozen=True)
    class RenameOutputPass(Pass):
        """Tag the serving signature's function with an attribute (a toy pass)."""

        name: ClassVar[str] = "tag-serving"
        produces: ClassVar[tuple] = (Microbatch,)
        tag: str = option("toy", "the attribute's value")

        def call(self, item):
            sig = next(s for s in item.inference_signatures())
            item.function(sig.function).attr["_vfgraph_tag"].s = self.tag.encode()
            records.put(item, sig.key, Microbatch(function=sig.function, vnode_batch=1))
            return PassResult(item, True, [f"tagged {sig.key}"])

    return RenameOutputPass


def test_a_pass_is_one_class_registered_by_its_decorator(toy_passes, capsys):
    cls = _rename_pass(toy_passes)
    assert registered()["tag-serving"] is cls
    assert parse_pipeline("tag-serving{tag=x}") == [cls(tag="x")]
    out = vfgraph.rewrite(MODEL, pipeline="tag-serving{tag=x}")
    fn = next(s for s in out.inference_signatures()).function
    assert out.function(fn).attr["_vfgraph_tag"].s == b"x"
    assert out.metadata["notes"] == [f"tagged {next(iter(records.get(out, Microbatch)))}"]
    assert out.metadata["history"][-1]["pipeline"] == "tag-serving{tag=x}"
    capsys.readouterr()
    code, stdout = cli.main(["passes"]), capsys.readouterr().out
    assert code == 0 and "tag-serving  (produces Microbatch)" in stdout and "the attribute's value" in stdout


def test_passes_lists_every_builtin_pass_with_its_options(capsys):
    import json

    capsys.readouterr()
    assert cli.main(["passes", "--json"]) == 0
    listed = {d["name"]: d for d in json.loads(capsys.readouterr().out)}
    assert {"split-vnodes", "insert-allreduce", "microbatch-inference"} <= set(listed)
    sv = listed["split-vnodes"]
    assert [o["name"] for o in sv["options"]] == ["vnodes", "vnode-batch", "signature", "stepwise", "deterministic",
                                                  "memory-budget", "memory-margin", "profile"]
    assert all(o["help"] for d in listed.values() for o in d["options"])
    assert listed["insert-allreduce"]["requires"] == ["VirtualNodes"]
    assert sv["produces"] == ["VirtualNodes"] and sv["summary"].startswith("Run the training step")


def test_the_callers_item_is_copied_once_unless_handed_over(toy_passes):
    _rename_pass(toy_passes)
    item = vfgraph.load(MODEL)
    text = canonical_text(item)
    seen = []
    manager = PassManager(parse_pipeline("tag-serving,microbatch-inference{vnode-batch=1}"),
                          after_each=lambda p, it: seen.append(it))
    out, _ = manager.run(item)
    assert canonical_text(item) == text and out is not item
    assert seen[0] is seen[1] is out  # the second pass edited the first one's result in place
    owned, _ = PassManager(parse_pipeline("tag-serving")).run(item, owned=True)
    assert owned is item and canonical_text(item) != text


def test_requires_is_checked_before_the_pass_runs():
    item = vfgraph.load(MODEL)
    with pytest.raises(PipelineError, match=r"pass insert-allreduce: needs the VirtualNodes record; run split-vnodes "
                                            r"before it in the pipeline"):
        PassManager(parse_pipeline("insert-allreduce")).run(item)


def test_a_failure_names_the_pass_and_the_passes_before_it_and_keeps_its_cause(toy_passes):
    @toy_passes
    @dataclass(frozen=True)
    class BrokenPass(Pass):
        """Fails (a toy pass)."""

        name: ClassVar[str] = "broken"
        how: str = option("bug", "bug: a KeyError; user: a DetectionError")

        def call(self, item):
            if self.how == "bug":
                return {}["missing"]
            raise DetectionError("no such construct")

    item = vfgraph.load(MODEL)
    with pytest.raises(InternalError, match=r"pass broken \(after microbatch-inference\) failed: KeyError: "
                                            r"'missing'") as e:
        PassManager(parse_pipeline("microbatch-inference{vnode-batch=2},broken")).run(item)
    assert isinstance(e.value.__cause__, KeyError) and e.value.exit_code == 3
    with pytest.raises(DetectionError, match=r"^pass broken: no such construct$") as e:
        PassManager(parse_pipeline("broken{how=user}")).run(item)
    assert isinstance(e.value.__cause__, DetectionError) and e.value.exit_code == 2


def test_a_pass_that_changes_the_model_publishes_what_it_produces(toy_passes):
    @toy_passes
    @dataclass(frozen=True)
    class ForgetfulPass(Pass):
        """Changes the model but records nothing (a toy pass)."""

        name: ClassVar[str] = "forgetful"
        produces: ClassVar[tuple] = (VirtualNodes,)

        def call(self, item):
            item.preserve.add("x")
            return PassResult(item, True)

    with pytest.raises(InternalError, match="pass forgetful changed the model but published no VirtualNodes record"):
        PassManager(parse_pipeline("forgetful")).run(vfgraph.load(MODEL))


def test_a_reading_pass_gets_the_callers_item_and_may_not_change_it(toy_passes):
    @toy_passes
    @dataclass(frozen=True)
    class CountPass(Pass):
        """Counts functions (a toy pass that only reads)."""

        name: ClassVar[str] = "count"
        edits: ClassVar[bool] = False
        claim: bool = option(False, "claim a change")

        def call(self, item):
            return PassResult(item, self.claim, [f"{len(item.library)} functions"])

    item = vfgraph.load(MODEL)
    out, notes = PassManager(parse_pipeline("count")).run(item)
    assert out is item and notes == [f"{len(item.library)} functions"]
    with pytest.raises(InternalError, match="declares edits = False but changed the item"):
        PassManager(parse_pipeline("count{claim=true}")).run(item)


def test_verify_each_names_the_pass_that_broke_the_model(toy_passes):
    @toy_passes
    @dataclass(frozen=True)
    class DropServingPass(Pass):
        """Removes the serving function from the library (a toy pass that breaks the model)."""

        name: ClassVar[str] = "drop-serving"

        def call(self, item):
            fn = next(s for s in item.inference_signatures()).function
            lib = item.meta_graph.graph_def.library.function
            del lib[[f.signature.name for f in lib].index(fn)]
            return PassResult(item, True)

    spec = "drop-serving,microbatch-inference{vnode-batch=2}"
    with pytest.raises(InternalError, match=r"pass drop-serving made a model TensorFlow would not load: .*is used but "
                                            r"not in the library"):
        vfgraph.rewrite(MODEL, pipeline=spec, verify_each=True)
    with pytest.raises(VfgraphError):  # without it, the end's verify (or the next pass) finds it
        vfgraph.rewrite(MODEL, pipeline=spec)


def test_verify_each_leaves_the_output_as_it_is():
    spec = "split-vnodes{vnodes=4,vnode-batch=2},microbatch-inference{vnode-batch=2}"
    plain = vfgraph.rewrite(MODEL, pipeline=spec)
    checked = vfgraph.rewrite(MODEL, pipeline=spec, verify_each=True)
    assert canonical_text(plain) == canonical_text(checked)


@pytest.mark.parametrize("make, problem", [
    (lambda: type("NotAPass", (), {"name": "x"}), "a @dataclass\\(frozen=True\\) subclass"),
    (lambda: dataclass(type("Loose", (Pass,), {"name": "loose"})), "frozen"),
    (lambda: dataclass(frozen=True)(type("Bad", (Pass,), {"name": "Bad_Name"})), "kebab-case"),
    (lambda: dataclass(frozen=True)(type("Taken", (Pass,), {"name": "split-vnodes"})), "taken by"),
    (lambda: dataclass(frozen=True)(type("NoDefault", (Pass,), {"name": "no-default",
                                                                "__annotations__": {"n": int}})), "need defaults"),
    (lambda: dataclass(frozen=True)(type("Listy", (Pass,), {"name": "listy", "__annotations__": {"n": list},
                                                            "n": dataclasses.field(default_factory=list)})),
     "bool, int, float or str"),
    (lambda: dataclass(frozen=True)(type("Needy", (Pass,), {"name": "needy", "requires": (int,)})),
     "not record types"),
])
def test_register_refuses_what_a_pipeline_could_not_run(make, problem):
    registered()  # the built-in passes are known
    with pytest.raises(TypeError, match=problem):
        register(make())
    assert set(registered()) >= {"split-vnodes"} and "needy" not in registered()


def test_a_pass_of_another_package_is_found_through_its_entry_point(tmp_path, monkeypatch):
    """An installed package declares its pass module under the ``vfgraph.passes`` group."""
    pkg = tmp_path / "vf_plugin_demo"
    pkg.mkdir()
    (pkg / "__init__.py").write_text("")
    (pkg / "count_nodes.py").write_text(
        "from dataclasses import dataclass\nfrom typing import ClassVar\n"
        "from vfgraph.passes.base import Pass, PassResult, register\n\n\n"
        "@register\n@dataclass(frozen=True)\nclass CountNodesPass(Pass):\n"
        '    """Counts nodes."""\n\n    name: ClassVar[str] = "count-nodes"\n    edits: ClassVar[bool] = False\n\n'
        "    def call(self, item):\n        return PassResult(item, False, [str(len(item.library))])\n")
    info = tmp_path / "vf_plugin_demo-1.0.dist-info"
    info.mkdir()
    (info / "METADATA").write_text("Metadata-Version: 2.1\nName: vf-plugin-demo\nVersion: 1.0\n")
    (info / "entry_points.txt").write_text("[vfgraph.passes]\ncount-nodes = vf_plugin_demo.count_nodes\n")
    monkeypatch.syspath_prepend(str(tmp_path))
    monkeypatch.setattr(base, "_discovered", False)
    try:
        assert "count-nodes" in registered()
        _, notes = PassManager(parse_pipeline("count-nodes")).run(vfgraph.load(MODEL))
        assert notes and int(notes[0]) > 0
        (info / "entry_points.txt").write_text("[vfgraph.passes]\nbroken = vf_plugin_demo.nowhere\n")
        base.unregister("count-nodes")
        monkeypatch.setattr(base, "_discovered", False)
        with pytest.raises(PipelineError, match=r"pass plug-in 'broken' \(vf_plugin_demo.nowhere\) .* failed to load: "
                                                r"ModuleNotFoundError"):
            registered()
    finally:
        base.unregister("count-nodes")
        base._discovered = True


def test_the_worked_example_pass_runs_in_a_pipeline_and_in_tensorflow(models, tmp_path):
    """examples/check_outputs.py, the pass docs/architecture.md walks through: registered by
    importing it, listed by ``vfgraph passes``, and its output served by stock TensorFlow."""
    import numpy as np
    import tensorflow as tf

    import check_outputs  # examples/ is on the tests' path

    try:
        assert registered()["check-outputs"] is check_outputs.CheckOutputsPass
        out = vfgraph.rewrite(models("mlp:sgd"), pipeline="check-outputs{message=bad logits},"
                                                         "split-vnodes{vnodes=2},microbatch-inference{vnode-batch=4}")
        path = vfgraph.export(out, str(tmp_path / "serve"))
        serve = tf.saved_model.load(path).signatures["serving_default"]
        key = next(iter(serve.structured_input_signature[1]))
        fine = serve(**{key: tf.constant(np.ones((5, 64), np.float32))})
        assert all(np.isfinite(v.numpy()).all() for v in fine.values())
        with pytest.raises(tf.errors.InvalidArgumentError, match="bad logits"):
            serve(**{key: tf.constant(np.full((5, 64), np.nan, np.float32))})
    finally:
        base.unregister("check-outputs")
