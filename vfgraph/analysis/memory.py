"""The memory of a training step, measured, and the virtual-node batch a memory budget allows.

A budget is a size (:func:`parse_size`: ``2GiB``, ``512MiB``, ``1.5GB``, plain bytes). The
step's memory is measured, not estimated: :func:`measure_peaks` runs the training step of a
SavedModel at a few small batches ``b`` in a process of its own (TensorFlow's BFC allocator
turned on for the CPU with ``TF_CPU_ALLOCATOR_USE_BFC``, which must be set before TensorFlow
starts), as :mod:`vfgraph.analysis.profile` runs a step: one graph in a session of its own,
one intra-op and one inter-op thread, a synthetic batch, the model's variables copied in. For
each ``b`` it runs one step, resets the allocator's statistics, runs a second step and reads
the allocator's peak (``tf.config.experimental.get_memory_info``): the variables, the
optimizer's state and everything the step allocates. On a GPU (``device="GPU"``) the same
reads the GPU allocator's peak; that path is written for a machine with a GPU and not tested
where there is none.

:func:`fit_budget` fits memory = fixed + per_example x b by least squares (over the largest
batches measured, those nearest the ones a budget chooses among) and chooses the largest ``b``
whose fitted memory is within the budget less the margin. :func:`measure_budget` measures the
step once more at that ``b`` and fits again, so that the final line runs through a
measurement near the budget (a profile's file holds the batches ``vfgraph profile`` measured:
:data:`DEFAULT_BATCHES`).
"""
from __future__ import annotations

import json
import math
import os
import re
import subprocess
import sys
from dataclasses import dataclass
from typing import Dict, List, Optional, Sequence, Tuple

from vfgraph.analysis.profile import Peaks
from vfgraph.errors import InputError, VfgraphError
from vfgraph.io.outputs import size_text

DEFAULT_BATCHES = (1, 2, 4, 8, 16, 32)  # the virtual-node batches the step is measured at
DEFAULT_MARGIN = 0.1  # the share of the budget kept free: the fit chooses within budget x (1 - margin)
MAX_BATCH = 65536  # the largest b a budget chooses (a fit is a line through small b's: not trusted further)
_UNITS = {"": 1, "B": 1, "KB": 10 ** 3, "MB": 10 ** 6, "GB": 10 ** 9, "TB": 10 ** 12,
          "KIB": 2 ** 10, "MIB": 2 ** 20, "GIB": 2 ** 30, "TIB": 2 ** 40}
_SIZE = re.compile(r"\s*([0-9]+(?:\.[0-9]+)?)\s*([A-Za-z]*)\s*")
_TIMEOUT = 1800  # seconds a measurement may take before it is given up (never hang)


def parse_size(text: str) -> int:
    """The bytes a size names: a number and a unit, ``2GiB``, ``512MiB``, ``1.5GB``, ``64KB``,
    or plain bytes (``1048576``); units B, KB, MB, GB, TB (powers of 1000) and KiB, MiB, GiB,
    TiB (powers of 1024), any case. Raises ValueError saying what to give."""
    m = _SIZE.fullmatch(text)
    unit = m.group(2).upper() if m else None
    if m is None or unit not in _UNITS:
        raise ValueError(f"not a size; give a number and a unit, e.g. 2GiB, 512MiB, 1.5GB, or bytes")
    if not unit and "." in m.group(1):
        raise ValueError("a number of bytes is whole; give e.g. 1048576, or a unit (1.5GB)")
    size = int(float(m.group(1)) * _UNITS[unit]) if "." in m.group(1) else int(m.group(1)) * _UNITS[unit]
    if size < 1:
        raise ValueError("a budget is at least 1 byte; give e.g. 2GiB")
    return size


def size_problem(text: str) -> str:
    """What is wrong with size ``text`` ('' for none, and for '': no budget): the check of a
    memory-budget option, where it is declared."""
    if text == "":
        return ""
    try:
        parse_size(text)
    except ValueError as e:
        return str(e)
    return ""


@dataclass(frozen=True)
class Fit:
    """memory = ``fixed`` + ``per_example`` x b (bytes, :func:`fit_line` of ``peaks``), the
    ``budget`` and ``margin`` it was held to and the ``chosen`` b."""

    fixed: int
    per_example: int
    budget: int
    margin: float
    chosen: int
    peaks: Peaks


def fit_line(batches: Sequence[int], peaks: Sequence[int]) -> Tuple[float, float]:
    """(fixed, per_example) of the least-squares line through the points (batch, peak) of the
    largest batches: those of at least a quarter of the largest (two at least), where the
    step's memory is of the size a budget chooses among."""
    points = sorted(zip(batches, peaks))
    top = points[-1][0]
    used = [pt for pt in points if pt[0] * 4 >= top]
    used = used if len(used) >= 2 else points[-2:]
    n = len(used)
    mb, mp = sum(b for b, _ in used) / n, sum(p for _, p in used) / n
    var = sum((b - mb) ** 2 for b, _ in used)
    per = sum((b - mb) * (p - mp) for b, p in used) / var
    return mp - per * mb, per


def fit_budget(peaks: Peaks, budget: int, margin: float = DEFAULT_MARGIN, most: int = MAX_BATCH,
               where: str = "", extra: int = 0) -> Fit:
    """The largest b (at most ``most``) whose memory, ``extra`` bytes more than the step's (the
    virtual-node loop's sums), is within ``budget`` x (1 - ``margin``): the fitted memory
    (:func:`fit_line`), and no b at or above a batch measured over it (the step's memory grows
    with b). Raises InputError when even b = 1 does not fit, naming the smallest budget that
    would (``where``: what the message is about)."""
    fixed, per = fit_line(peaks.batches, peaks.peaks)
    # (a step whose measured memory does not grow with b: at least one byte per example)
    fixed, per = int(math.ceil(fixed)), max(int(math.ceil(per)), 1)
    usable = budget * (1 - margin) - extra
    chosen = min(int((usable - fixed) // per), most)
    over = [b for b, p in zip(peaks.batches, peaks.peaks) if p > usable and b <= chosen]
    chosen = min(over) - 1 if over else chosen
    if chosen < 1:
        one = dict(zip(peaks.batches, peaks.peaks)).get(1, 0)  # (measured at b=1: no less than that)
        need = max(fixed + per, one) + extra
        smallest = int(math.ceil(need / (1 - margin)))
        while smallest * (1 - margin) < need:  # (rounding)
            smallest += 1
        sums = f" + {size_text(extra)} of the virtual nodes' sums" if extra else ""
        raise InputError(f"{where}memory budget {size_text(budget)} ({budget} bytes) is below what a step of one "
                         f"example needs: {size_text(fixed)} fixed{sums} + {size_text(per)} per example, with a "
                         f"{margin:.0%} margin; give at least {smallest} bytes ({size_text(smallest)})")
    return Fit(fixed, per, budget, margin, chosen, peaks)


def measure_budget(path: str, signature: str, budget: int, margin: float = DEFAULT_MARGIN,
                   device: str = "CPU", where: str = "", extra: int = 0) -> Fit:
    """:func:`fit_budget` of the step measured here (:func:`measure_peaks`) at
    :data:`DEFAULT_BATCHES`, then once more at the b that fit chose, where it is larger than
    them: the final fit is of the measurements nearest the budget (``extra``: as there)."""
    peaks = measure_peaks(path, signature, DEFAULT_BATCHES, device, loop=True)
    fit = fit_budget(peaks, budget, margin, where=where, extra=extra)
    if fit.chosen <= max(peaks.batches):
        return fit
    more = measure_peaks(path, signature, (fit.chosen,), device, loop=True)
    both = Peaks(peaks.batches + more.batches, peaks.peaks + more.peaks, peaks.device, peaks.measured_on)
    return fit_budget(both, budget, margin, where=where, extra=extra)


def measure_peaks(path: str, signature: str, batches: Sequence[int] = DEFAULT_BATCHES,
                  device: str = "CPU", loop: bool = False) -> Peaks:
    """The peak memory of a training step of signature ``signature`` of the SavedModel at
    ``path`` at each of ``batches`` examples (see the module's note), measured in a process of
    its own; ``loop``: of the step as split-vnodes runs it (the model rewritten there with one
    virtual node of the fed batch, no all-reduce: the loop and its sums with the step). Raises
    InputError when the step cannot be run there (the message the step's failure gave)."""
    root = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))  # (vfgraph's parent)
    env = dict(os.environ, TF_CPU_ALLOCATOR_USE_BFC="true", TF_CPP_MIN_LOG_LEVEL="3",
               PYTHONPATH=os.pathsep.join([root] + [p for p in os.environ.get("PYTHONPATH", "").split(os.pathsep)
                                                    if p]))
    cmd = [sys.executable, "-m", "vfgraph.analysis.memory", path, signature, ",".join(map(str, batches)), device,
           "loop" if loop else "step"]
    try:
        res = subprocess.run(cmd, capture_output=True, text=True, env=env, timeout=_TIMEOUT)
    except subprocess.TimeoutExpired:
        raise InputError(f"{path}: measuring the memory of signature {signature!r} took over {_TIMEOUT} s; give a "
                         "measured profile with --profile FILE ('vfgraph profile MODEL -o FILE')") from None
    lines = res.stdout.strip().splitlines()
    try:
        out = json.loads(lines[-1]) if lines else {}
    except ValueError:
        out = {}
    if res.returncode != 0 or "peaks" not in out:
        why = out.get("error") or ((res.stderr.strip().splitlines() or ["no output"])[-1][:300])
        raise InputError(f"{path}: measuring the memory of signature {signature!r} failed: {why}")
    return Peaks(tuple(out["batches"]), tuple(out["peaks"]), out["device"],
                 tuple(sorted(out["measured_on"].items())))


def _measure_here(path: str, key: str, batches: Sequence[int], device: str) -> Dict[str, object]:
    """:func:`measure_peaks` of the step as it is, in this process (started with the BFC
    allocator turned on)."""
    import gc

    import numpy as np
    import tensorflow as tf

    from vfgraph.analysis.profile import _machine, _session_graph, synthetic_batch
    from vfgraph.io.savedmodel import is_saved_model_dir, load_to_run

    if not is_saved_model_dir(path):
        raise InputError(f"{path} is not a SavedModel directory: a memory budget measures a SavedModel's training "
                         "step; export the model as one")
    loaded = load_to_run(path)
    fn = loaded.signatures.get(key) if hasattr(loaded, "signatures") else None
    if fn is None:
        raise InputError(f"{path}: no signature {key!r} to measure")
    structured = fn.structured_input_signature[1]
    specs = [(k, structured[k].dtype.as_datatype_enum,
              None if structured[k].shape.rank is None else [-1 if d is None else d for d in structured[k].shape])
             for k in sorted(structured)]
    fixed = sorted({s[2][0] for s in specs if s[2] and s[2][0] >= 0})
    if fixed:
        raise InputError(f"signature {key!r} of {path} takes a fixed batch of {fixed[0]} examples, so its step cannot "
                         "be measured at other batches; export it with an unknown batch dimension (None), or give "
                         "--vnode-batch instead of a memory budget")
    where = "/GPU:0" if device == "GPU" else "/CPU:0"
    graphs = []
    for b in batches:
        g, fetches, init, feeds, initial = _session_graph(fn, synthetic_batch(specs, b, key), device=where)
        graphs.append((b, g, fetches, init, feeds, {k: np.array(v, copy=True) for k, v in initial.items()}))
        initial.clear()
    del loaded, fn
    gc.collect()
    config = tf.compat.v1.ConfigProto(intra_op_parallelism_threads=1, inter_op_parallelism_threads=1,
                                      device_count={"GPU": 1 if device == "GPU" else 0}, allow_soft_placement=True)
    stats = "GPU:0" if device == "GPU" else "CPU:0"
    peaks = []
    for b, g, fetches, init, feeds, initial in graphs:
        with tf.compat.v1.Session(graph=g, config=config) as session:
            try:
                session.run(init, initial)
                initial.clear()
                session.run(fetches, feeds)
                tf.config.experimental.reset_memory_stats(stats)
                session.run(fetches, feeds)
            except tf.errors.OpError as e:
                first = (str(getattr(e, "message", "") or e).strip().splitlines() or [type(e).__name__])[0][:300]
                raise InputError(f"signature {key!r} fails on a synthetic batch of {b} examples ({first})") from None
            peaks.append(int(tf.config.experimental.get_memory_info(stats)["peak"]))
    return {"batches": list(batches), "peaks": peaks, "device": device, "measured_on": _machine()}


def _measure_loop(path: str, key: str, batches: str, device: str) -> Dict[str, object]:
    """:func:`measure_peaks` of the step of ``path`` rewritten by split-vnodes (one virtual
    node of the fed batch, no all-reduce), saved in a temporary directory."""
    import tempfile

    with tempfile.TemporaryDirectory() as tmp:  # (rewritten by the command: this layer is below the API)
        res = subprocess.run([sys.executable, "-m", "vfgraph.cli", "rewrite", path, "--vnodes", "1", "--allreduce",
                              "none", "--train-signature", key, "-o", os.path.join(tmp, "loop")],
                             capture_output=True, text=True, timeout=_TIMEOUT)
        if res.returncode:
            raise InputError((res.stderr.strip().splitlines() or ["the rewrite failed"])[-1])
        return _measure_here(os.path.join(tmp, "loop"), key, [int(b) for b in batches.split(",")], device)


def main(argv: Optional[List[str]] = None) -> int:
    """``python -m vfgraph.analysis.memory PATH SIGNATURE B1,B2,... DEVICE loop|step``: the peaks as one
    line of JSON (``{"error": ...}`` and exit 2 for a step that cannot be measured)."""
    path, key, batches, device, what = argv if argv is not None else sys.argv[1:]
    if os.environ.get("TF_CPU_ALLOCATOR_USE_BFC") != "true" and device == "CPU":
        print(json.dumps({"error": "TF_CPU_ALLOCATOR_USE_BFC=true is needed to read the CPU allocator's peak"}))
        return 2
    try:
        out = _measure_loop(path, key, batches, device) if what == "loop" else \
            _measure_here(path, key, [int(b) for b in batches.split(",")], device)
    except VfgraphError as e:  # (an input error; with loop, also a model split-vnodes refuses)
        print(json.dumps({"error": str(e)}))
        return 2
    print(json.dumps(out, sort_keys=True))
    return 0


if __name__ == "__main__":
    sys.exit(main())
