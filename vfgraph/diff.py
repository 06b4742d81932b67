"""Differences between two models: their canonical graphs and their variables' values.

The graph part is a unified diff of :func:`vfgraph.ir.canonical.canonical_text` whose hunk
headers name the function each hunk is in (like git's funcname), so a change deep in a long
library says where it is. It compares generated names by content (``generated_names``): the
numbers tracing puts in function names, and custom gradients' numbers, differ between two
exports of one model and are not shown as differences. The variables part compares the checkpoints key by key: two exports
of one model trained differently have equal graphs, and only their values tell them apart.

Variables are read one checkpoint entry at a time (its tensor from each side), so comparing
models of many GB needs memory for the largest variable twice, not for the models.
"""
from __future__ import annotations

import difflib
import hashlib
import math
import os
import re
from dataclasses import dataclass, field
from typing import Dict, List, Optional, Sequence, Tuple

import numpy as np

import vfgraph
from vfgraph.errors import InputError

# Checkpoint entries that are not variables, or whose value is bookkeeping of how the file was
# written rather than model state: the serialized object graph (node ids and attribute lists
# change with any rewrite that adds objects; the structure it records is in the graph diff) and
# tf.train.Checkpoint's count of saves (a model saved once more is the same model).
SKIPPED_KEYS = ("_CHECKPOINTABLE_OBJECT_GRAPH", "save_counter/.ATTRIBUTES/VARIABLE_VALUE")

# A differing tensor with fewer elements than this is printed in full; a larger one is
# summarised by its differing elements, largest difference and sha256 digests.
SMALL_ELEMENTS = 64

# Elements compared per step of a large tensor: bounds the temporaries of the comparison.
_CHUNK = 1 << 20
_CONTEXT = 3
_FUNCTION_NAME = re.compile(r'^    name: "(.*)"$')
_SIGNATURE_COMMENT = re.compile(r"^# (signature \S+: function \S+)$")


@dataclass
class ModelDiff:
    """What ``vfgraph diff`` prints (``lines``, each ending in a newline) and whether the models differ."""

    lines: List[str] = field(default_factory=list)
    differs: bool = False


def diff_models(a: str, b: str, graphs_only: bool = False, fromfile: Optional[str] = None,
                tofile: Optional[str] = None) -> ModelDiff:
    """Compare the models at paths ``a`` and ``b`` (anything :func:`vfgraph.load` reads).

    The lines are a unified diff of the canonical graph texts (labelled ``fromfile`` and
    ``tofile``, default the paths), each hunk header naming its function, then, unless
    ``graphs_only``, a variables section: ``--- variables A`` / ``+++ variables B`` and one
    line per differing checkpoint key, sorted by key::

        - KEY DTYPE [SHAPE]                      only in a
        + KEY DTYPE [SHAPE]                      only in b
        ~ KEY DTYPE [SHAPE] -> DTYPE [SHAPE]     dtype or shape changed
        ~ KEY DTYPE [SHAPE]: N of M values differ, max abs difference X (sha256 D -> D)
        ~ KEY DTYPE [SHAPE]: N of M values differ, max abs difference X
        -   [a's values]                         (a tensor of fewer than SMALL_ELEMENTS)
        +   [b's values]

    Equal models give no lines. A model vfgraph rewrote has variables its original lacks
    (virtual-node gradient accumulators): they show as ``+`` lines.
    """
    from vfgraph.ir.canonical import canonical_text

    fromfile = a if fromfile is None else fromfile
    tofile = b if tofile is None else tofile
    items = [vfgraph.load(p) for p in (a, b)]
    texts = [canonical_text(item, generated_names=True).splitlines(keepends=True) for item in items]
    lines = graph_diff(texts[0], texts[1], fromfile, tofile)
    if not graphs_only:
        lines += variables_diff(checkpoint_prefix(items[0]), checkpoint_prefix(items[1]), fromfile, tofile)
    return ModelDiff(lines, bool(lines))


# --- graphs -----------------------------------------------------------------------------------

def function_owners(lines: Sequence[str]) -> List[str]:
    """For each line of a canonical text, what it is in: ``function NAME`` (the nearest
    preceding ``function {`` of the library), ``signature KEY: function NAME`` (the leading
    comments), or "" (before either)."""
    from google.protobuf import text_encoding

    owners: List[str] = []
    current = ""
    for i, line in enumerate(lines):
        if line.rstrip("\n") == "function {":
            current = "function ?"
            for nxt in lines[i + 1:]:
                if nxt.rstrip("\n") == "}":
                    break
                m = _FUNCTION_NAME.match(nxt.rstrip("\n"))
                if m:
                    current = "function " + text_encoding.CUnescape(m.group(1)).decode("utf-8", "replace")
                    break
        else:
            m = _SIGNATURE_COMMENT.match(line.rstrip("\n"))
            if m:
                current = m.group(1)
        owners.append(current)
    return owners


def _unified_range(start: int, stop: int) -> str:
    """A hunk's range as unified diff writes it (difflib's convention: 1-based, the length
    left out when it is 1, the line before for an empty range)."""
    length = stop - start
    begin = start + 1
    if length == 1:
        return f"{begin}"
    if not length:
        begin -= 1
    return f"{begin},{length}"


def graph_diff(a: Sequence[str], b: Sequence[str], fromfile: str, tofile: str) -> List[str]:
    """Unified diff of two canonical texts (lists of lines with their newlines), each hunk
    header followed by the function its first changed line is in: found on a's side, or on
    b's when the hunk only adds lines."""
    out: List[str] = []
    owners_a: Optional[List[str]] = None
    owners_b: Optional[List[str]] = None
    for group in difflib.SequenceMatcher(None, a, b).get_grouped_opcodes(_CONTEXT):
        if not out:
            out += [f"--- {fromfile}\n", f"+++ {tofile}\n"]
            owners_a, owners_b = function_owners(a), function_owners(b)
        changes = [op for op in group if op[0] != "equal"]
        deletes = [op for op in changes if op[0] in ("replace", "delete")]
        if deletes:
            owner = owners_a[deletes[0][1]]
        else:
            owner = owners_b[changes[0][3]] if changes else ""
        first, last = group[0], group[-1]
        header = f"@@ -{_unified_range(first[1], last[2])} +{_unified_range(first[3], last[4])} @@"
        out.append(header + (f" {owner}" if owner else "") + "\n")
        for tag, i1, i2, j1, j2 in group:
            if tag == "equal":
                out += [" " + _line(s) for s in a[i1:i2]]
                continue
            if tag in ("replace", "delete"):
                out += ["-" + _line(s) for s in a[i1:i2]]
            if tag in ("replace", "insert"):
                out += ["+" + _line(s) for s in b[j1:j2]]
    return out


def _line(s: str) -> str:
    return s if s.endswith("\n") else s + "\n"


# --- variables --------------------------------------------------------------------------------

def checkpoint_prefix(item) -> str:
    """The checkpoint holding ``item``'s variables, or "" for a model without one (a frozen
    GraphDef, whose constants are in its graph, or a SavedModel without variables)."""
    if item.variables_prefix:
        return item.variables_prefix
    if item.kind not in ("saved_model", "tf1_saved_model") or not os.path.isdir(item.source):
        return ""
    prefix = os.path.join(item.source, "variables", "variables")
    if not os.path.isfile(prefix + ".index") and any(s.variables for s in item.signatures.values()):
        raise InputError(f"{prefix}.index: the SavedModel's signatures read variables but it has no checkpoint; "
                         "copy the model's whole variables/ directory with it")
    return prefix if os.path.isfile(prefix + ".index") else ""


class _Checkpoint:
    """Names, dtypes and shapes of a checkpoint's entries, and one entry's value on request."""

    def __init__(self, prefix: str):
        from vfgraph.io.checkpoint import CheckpointReader

        self.prefix = prefix
        self.reader = None
        self.entries: Dict[str, Tuple[str, List[int]]] = {}
        if not prefix:
            return
        self.reader = CheckpointReader(prefix)
        shapes, dtypes = self.reader.get_variable_to_shape_map(), self.reader.get_variable_to_dtype_map()
        for key in shapes:
            if key not in SKIPPED_KEYS:
                self.entries[key] = (dtypes[key].name, [int(d) for d in shapes[key]])

    def value(self, key: str) -> np.ndarray:
        return np.asarray(self.reader.get_tensor(key))


def _describe(entry: Tuple[str, List[int]]) -> str:
    dtype, shape = entry
    return f"{dtype} [{', '.join(str(d) for d in shape)}]"


def variables_diff(prefix_a: str, prefix_b: str, fromfile: str, tofile: str) -> List[str]:
    """Lines for the checkpoint entries that differ between the checkpoints at ``prefix_a``
    and ``prefix_b`` ("" for none), in the format :func:`diff_models` documents; no lines when
    all are equal."""
    ca, cb = _Checkpoint(prefix_a), _Checkpoint(prefix_b)
    body: List[str] = []
    for key in sorted(set(ca.entries) | set(cb.entries)):
        ea, eb = ca.entries.get(key), cb.entries.get(key)
        if eb is None:
            body.append(f"- {key} {_describe(ea)}\n")
        elif ea is None:
            body.append(f"+ {key} {_describe(eb)}\n")
        elif ea != eb:
            body.append(f"~ {key} {_describe(ea)} -> {_describe(eb)}\n")
        else:
            body += _value_diff(key, ea, ca.value(key), cb.value(key))
    if not body:
        return []
    return [f"--- variables {fromfile}\n", f"+++ variables {tofile}\n"] + body


def _digest(x: np.ndarray) -> str:
    """sha256 of a tensor's contents: its bytes, or for strings each element's length and bytes."""
    h = hashlib.sha256()
    if x.dtype == object:
        for v in x.reshape(-1):
            v = v if isinstance(v, bytes) else str(v).encode()
            h.update(len(v).to_bytes(8, "little"))
            h.update(v)
    else:
        h.update(np.ascontiguousarray(x).reshape(-1).view(np.uint8))
    return h.hexdigest()


def _compare(x: np.ndarray, y: np.ndarray) -> Tuple[int, Optional[float]]:
    """(elements that differ, largest absolute difference among them, None for strings),
    chunk by chunk; NaN equals NaN, and the largest difference is NaN when one side is NaN."""
    fx, fy = x.reshape(-1), y.reshape(-1)
    if x.dtype == object:
        return sum(1 for u, v in zip(fx, fy) if u != v), None
    kind = x.dtype.kind
    wide = np.complex128 if kind == "c" else np.float64
    count, worst = 0, 0.0
    for s in range(0, fx.size, _CHUNK):
        u, v = fx[s:s + _CHUNK], fy[s:s + _CHUNK]
        if kind in "biu":  # compared exactly; the difference's size in float64
            differ = u != v
        else:
            u, v = u.astype(wide), v.astype(wide)
            differ = ~((u == v) | (np.isnan(u) & np.isnan(v)))
        n = int(np.count_nonzero(differ))
        if n:
            count += n
            d = np.abs(u[differ].astype(wide) - v[differ].astype(wide))
            if np.isnan(d).any():
                worst = math.nan
            elif not math.isnan(worst):
                worst = max(worst, float(np.max(d)))
    return count, worst


def _format_values(x: np.ndarray) -> str:
    """A small tensor on one line, nested like its shape, each number as its own dtype prints it
    shortest (float32 0.1 as 0.1, not 0.10000000149011612)."""
    if not isinstance(x, np.ndarray) or x.ndim == 0:  # an element: a NumPy scalar, or bytes of a string tensor
        v = x.item() if isinstance(x, np.ndarray) and x.dtype == object else x
        return repr(v) if isinstance(v, bytes) else str(v)
    return "[" + ", ".join(_format_values(x[i]) for i in range(x.shape[0])) + "]"


def _value_diff(key: str, entry: Tuple[str, List[int]], x: np.ndarray, y: np.ndarray) -> List[str]:
    """Lines for one checkpoint entry of equal dtype and shape on both sides: none when its
    bytes are equal."""
    da, db = _digest(x), _digest(y)
    if da == db:
        return []
    what = f"~ {key} {_describe(entry)}"
    count, worst = _compare(x, y)
    if not count:
        return [f"{what}: values equal, bytes differ (signed zeros or NaN payloads; sha256 {da[:12]} -> {db[:12]})\n"]
    summary = f"{what}: {count} of {x.size} values differ"
    if worst is not None:
        summary += f", max abs difference {worst:.3g}"
    if x.size < SMALL_ELEMENTS:
        return [summary + "\n", f"-   {_format_values(x)}\n", f"+   {_format_values(y)}\n"]
    return [f"{summary} (sha256 {da[:12]} -> {db[:12]})\n"]
