"""Golden graph-diff tests: tests/goldens/<pass>/<case>.before.pbtxt -> .after.pbtxt.

The before files are SavedModels in protobuf text form, of two kinds:

- generated: small models exported by tf.saved_model.save in tools/make_golden_inputs.py
  (linear_manual, linear_momentum), thousands of lines each, which cover what a real export
  holds;
- hand-written: the first line is ``# Hand-written golden input``, and a comment header says
  what the model is and what the pass should make of it (matmul_sgd, matmul_serve,
  matmul_assign_sub). They hold only what vfgraph's loader and TensorFlow's need: the
  signature_def and its graph call, the variable handles, the function library and an
  object graph with the signatures' concrete functions (which the generated inputs lack, so
  only these reach the step-wise and broadcast signatures), in under 200 lines a reviewer
  reads whole beside a golden's diff. They are not generated; make_golden_inputs.py refuses
  to overwrite them. tests/rewrites/test_golden_inputs.py loads each in TensorFlow, before and
  after its rewrite.

The after files are the canonical text (vfgraph.ir.canonical) of what the pass produced. A
missing or different golden fails with a unified diff; ``pytest --update-goldens`` rewrites
them (``-k CASE`` for one case) for review.
"""
import difflib
import glob
import os

import pytest

import vfgraph
from vfgraph.ir.canonical import canonical_text
from vfgraph.passes.base import parse_pipeline
from vfgraph.passes.manager import PassManager

HERE = os.path.join(os.path.dirname(os.path.dirname(os.path.abspath(__file__))), "goldens")
OPTIONS = {  # pass -> options used for every case of that pass
    "split-vnodes": "{vnodes=4,vnode-batch=2}",
    "microbatch-inference": "{vnode-batch=2}",
    "insert-allreduce": "{fusion-mb=0.00001}",  # tiny buffers: more than one, in a chain
    "partition-stages": "{stages=2,devices=/CPU:0;/CPU:1}",
}
PREFIX = {  # passes that rewrite what another pass made
    "insert-allreduce": "split-vnodes{vnodes=4,vnode-batch=2},",
}
CASES = sorted(glob.glob(os.path.join(HERE, "*", "*.before.pbtxt")))
HAND_WRITTEN_MARK = "# Hand-written golden input"  # first line of a hand-written before file


def is_hand_written(path: str) -> bool:
    with open(path) as f:
        return f.readline().startswith(HAND_WRITTEN_MARK)


HAND_WRITTEN = [c for c in CASES if is_hand_written(c)]


def pipeline_spec(pass_name: str) -> str:
    """The pipeline every golden case of ``pass_name`` runs."""
    return PREFIX.get(pass_name, "") + pass_name + OPTIONS.get(pass_name, "")


def test_every_pass_has_goldens():
    from vfgraph.passes.base import registered

    covered = {os.path.basename(os.path.dirname(c)) for c in CASES}
    assert set(registered()) <= covered, f"passes without golden cases: {set(registered()) - covered}"


@pytest.mark.parametrize("before", CASES, ids=lambda p: os.path.relpath(p, HERE)[: -len(".before.pbtxt")])
def test_golden(before, update_goldens):
    pass_name = os.path.basename(os.path.dirname(before))
    after_path = before.replace(".before.pbtxt", ".after.pbtxt")
    spec = pipeline_spec(pass_name)
    item = vfgraph.load(before)
    out, _ = PassManager(parse_pipeline(spec)).run(item)
    vfgraph.verify(out)
    got = canonical_text(out)
    if update_goldens:
        with open(after_path, "w") as f:
            f.write(got)
    if not os.path.exists(after_path):
        pytest.fail(f"missing golden {os.path.relpath(after_path)}; run pytest --update-goldens and review it")
    with open(after_path) as f:
        want = f.read()
    if got != want:
        diff = "".join(difflib.unified_diff(want.splitlines(True), got.splitlines(True),
                                            "golden", "produced", n=3))
        pytest.fail(f"{spec} on {os.path.basename(before)} differs from its golden:\n{diff[:20000]}")
    # Idempotence: running the pass again changes nothing more.
    again, _ = PassManager(parse_pipeline(spec)).run(out)
    assert canonical_text(again) == got
    assert canonical_text(out) == got  # a pipeline's result is not edited by the next pipeline
    # The input item is untouched.
    assert canonical_text(vfgraph.load(before)) == canonical_text(item)
