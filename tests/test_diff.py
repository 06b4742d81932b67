"""vfgraph.diff: the graph diff names each hunk's function, and variables are compared by value."""
import os
import re
import shutil

import numpy as np
import pytest

from vfgraph.diff import _value_diff, diff_models
from vfgraph.errors import InputError

KERNEL = "model_variables/0/.ATTRIBUTES/VARIABLE_VALUE"  # Dense(32) kernel, [64, 32]: summarised
BIAS = "model_variables/1/.ATTRIBUTES/VARIABLE_VALUE"    # its bias, [32]: printed in full
HUNK = re.compile(r"^@@ -(\d+)(?:,(\d+))? \+(\d+)(?:,(\d+))? @@(?: (function (\S+)|signature \S+: function (\S+)))?\n$")


def _copy(src, dst):
    shutil.copytree(src, dst)
    return str(dst)


def _change_weights(model_dir, changes):
    """Write the SavedModel's checkpoint again (SaveV2, as tf.train.Checkpoint does) with
    ``changes`` (key -> function of the value) applied, every other entry as it was."""
    import tensorflow as tf

    prefix = os.path.join(model_dir, "variables", "variables")
    reader = tf.train.load_checkpoint(prefix)
    keys = sorted(reader.get_variable_to_shape_map())
    values = [changes.get(k, lambda v: v)(reader.get_tensor(k)) for k in keys]
    del reader
    for f in os.listdir(os.path.dirname(prefix)):
        os.remove(os.path.join(os.path.dirname(prefix), f))
    tf.raw_ops.SaveV2(prefix=prefix, tensor_names=keys, shape_and_slices=[""] * len(keys),
                      tensors=[tf.constant(v) for v in values])


def _bump(indices, delta):
    def change(v):
        v = v.copy()
        v.reshape(-1)[list(indices)] += delta
        return v
    return change


@pytest.fixture(scope="module")
def retrained(models, tmp_path_factory):
    """The MLP with three kernel entries and one bias entry changed: equal graphs, other weights."""
    out = _copy(models("mlp:sgd"), tmp_path_factory.mktemp("diff") / "retrained")
    _change_weights(out, {KERNEL: _bump([0, 7, 2047], 0.5), BIAS: _bump([3], -0.25)})
    return out


def _sections(lines):
    """(graph diff lines, variables section lines)."""
    at = next((i for i, s in enumerate(lines) if s.startswith("--- variables ")), len(lines))
    return lines[:at], lines[at:]


def test_identical_models_have_no_lines(models, tmp_path):
    a = models("mlp:sgd")
    for b in (a, _copy(a, tmp_path / "copy")):
        d = diff_models(a, b)
        assert d.lines == [] and d.differs is False


def test_different_weights_differ_by_value(models, retrained):
    a = models("mlp:sgd")
    d = diff_models(a, retrained, fromfile="A", tofile="B")
    assert d.differs is True
    graph, variables = _sections(d.lines)
    assert graph == []  # the same graphs: only the values tell the models apart
    assert variables[:2] == ["--- variables A\n", "+++ variables B\n"]
    assert all(s.endswith("\n") for s in d.lines)
    kernel = [s for s in variables if s.startswith(f"~ {KERNEL} ")]
    assert len(kernel) == 1
    assert re.fullmatch(rf"~ {re.escape(KERNEL)} float32 \[64, 32\]: 3 of 2048 values differ, max abs difference 0\.5 "
                        r"\(sha256 [0-9a-f]{12} -> [0-9a-f]{12}\)\n", kernel[0])
    at = variables.index(f"~ {BIAS} float32 [32]: 1 of 32 values differ, max abs difference 0.25\n")
    before, after = variables[at + 1], variables[at + 2]
    assert before.startswith("-   [") and after.startswith("+   [")
    assert before.count(",") == after.count(",") == 31
    # only the two changed entries are named, sorted by key
    assert [s.split()[1] for s in variables[2:] if s.startswith("~ ")] == [KERNEL, BIAS]
    assert len(variables) == 2 + 1 + 3


def test_graphs_only_ignores_variables(models, retrained):
    d = diff_models(models("mlp:sgd"), retrained, graphs_only=True)
    assert d.lines == [] and d.differs is False


def test_rewritten_hunks_name_their_function(models, rewritten):
    import vfgraph
    from vfgraph.ir.canonical import canonical_text

    a, b = models("mlp:sgd"), rewritten("mlp:sgd", 2)
    d = diff_models(a, b, fromfile="A", tofile="B")
    assert d.differs is True
    graph, variables = _sections(d.lines)
    assert graph[:2] == ["--- A\n", "+++ B\n"]
    texts = {p: canonical_text(vfgraph.load(p), generated_names=True) for p in (a, b)}
    # a valid unified diff: every hunk's lines match the counts in its header
    i, hunks = 2, 0
    while i < len(graph):
        m = HUNK.match(graph[i])
        assert m, graph[i]
        hunks += 1
        name = m.group(6) or m.group(7)
        assert name and any(f'name: "{name}"\n' in t for t in texts.values()), graph[i]
        old = 1 if m.group(2) is None else int(m.group(2))
        new = 1 if m.group(4) is None else int(m.group(4))
        i += 1
        while i < len(graph) and not graph[i].startswith("@@"):
            assert graph[i][0] in " +-", graph[i]
            old -= graph[i][0] in " -"
            new -= graph[i][0] in " +"
            i += 1
        assert old == new == 0
    assert hunks > 1
    # the split training step's functions are named where they are added
    assert any(re.search(r" @@ function __vf_\S+_vnode", s) for s in graph)
    # virtual-node accumulators are new variables; the original's are unchanged
    assert variables[:2] == ["--- variables A\n", "+++ variables B\n"]
    added = [s for s in variables[2:] if s.startswith("+ ")]
    assert added and all(s.startswith("+ vf_accumulators/") for s in added)
    assert added == sorted(added) and len(added) == len(variables) - 2
    assert "+ vf_accumulators/grad_0/.ATTRIBUTES/VARIABLE_VALUE float32 [64, 32]\n" in added


def test_unreadable_checkpoint_is_an_input_error(models, tmp_path):
    broken = _copy(models("mlp:sgd"), tmp_path / "broken")
    with open(os.path.join(broken, "variables", "variables.index"), "wb") as f:
        f.write(b"not a checkpoint index")
    with pytest.raises(InputError) as e:
        diff_models(models("mlp:sgd"), broken)
    message = str(e.value)
    assert "\n" not in message and os.path.join(broken, "variables", "variables") in message
    assert diff_models(models("mlp:sgd"), broken, graphs_only=True).differs is False


def test_value_comparison():
    entry = ("float32", [3])
    f = np.array([1.0, np.nan, 0.0], np.float32)
    assert _value_diff("k", entry, f, f.copy()) == []  # NaN equals NaN
    signed = _value_diff("k", entry, f, np.array([1.0, np.nan, -0.0], np.float32))
    assert len(signed) == 1 and "values equal, bytes differ" in signed[0]
    nan = _value_diff("k", entry, f, np.array([1.0, 2.0, 0.0], np.float32))
    assert nan[0] == "~ k float32 [3]: 1 of 3 values differ, max abs difference nan\n"
    i = np.arange(100, dtype=np.int64).reshape(10, 10)
    j = i.copy()
    j[9, 9] = -5
    (line,) = _value_diff("k", ("int64", [10, 10]), i, j)
    assert re.fullmatch(r"~ k int64 \[10, 10\]: 1 of 100 values differ, max abs difference 104 "
                        r"\(sha256 [0-9a-f]{12} -> [0-9a-f]{12}\)\n", line)
    s = np.array([b"a", b"bc"], object)
    assert _value_diff("k", ("string", [2]), s, s.copy()) == []
    assert _value_diff("k", ("string", [2]), s, np.array([b"ab", b"c"], object)) == [
        "~ k string [2]: 2 of 2 values differ\n", "-   [b'a', b'bc']\n", "+   [b'ab', b'c']\n"]
