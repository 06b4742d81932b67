"""Draw several training runs' loss curves into one PNG, from their TensorBoard event files.

    python tools/plot_runs.py 1x8=runs/a 2x4=runs/b elastic=runs/c -o curves.png [--tag batch_loss]

Each ``LABEL=LOGDIR`` is the ``--logdir`` of a ``vfgraph train`` run; its ``train/`` event files
are read with TensorBoard's own reader (``EventAccumulator``) and the scalar ``--tag`` (default
``batch_loss``) drawn against the step. Curves that coincide (the same trajectory on another
layout, as the deterministic mode gives) are drawn over each other, the first widest, so each
stays visible. Drawn with Pillow (which TensorBoard requires), no plotting library; the PNG is
written whole or not at all.
"""
from __future__ import annotations

import argparse
import math
import os
import sys
import tempfile
from typing import Dict, List, Tuple

COLOURS = ["#1f77b4", "#ff7f0e", "#2ca02c", "#d62728", "#9467bd", "#8c564b", "#e377c2", "#7f7f7f"]
W, H, LEFT, RIGHT, TOP, BOTTOM = 900, 520, 80, 30, 50, 60


def read_curve(logdir: str, tag: str, run: str = "train") -> List[Tuple[int, float]]:
    """(step, value) of scalar ``tag`` in the event files of ``logdir/run``, by step."""
    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator
    from tensorboard.util import tensor_util

    path = os.path.join(logdir, run)
    if not os.path.isdir(path):
        raise SystemExit(f"plot_runs: {path}: no such directory (give the --logdir of a vfgraph train run)")
    acc = EventAccumulator(path, size_guidance={"tensors": 0, "scalars": 0})
    acc.Reload()
    tags = acc.Tags()
    if tag in tags.get("tensors", []):
        points = [(e.step, float(tensor_util.make_ndarray(e.tensor_proto))) for e in acc.Tensors(tag)]
    elif tag in tags.get("scalars", []):
        points = [(e.step, float(e.value)) for e in acc.Scalars(tag)]
    else:
        have = sorted(tags.get("tensors", []) + tags.get("scalars", []))
        raise SystemExit(f"plot_runs: {path}: no scalar {tag!r} (has: {', '.join(have) or 'none'})")
    return sorted(dict(points).items())


def ticks(lo: float, hi: float, count: int = 6) -> List[float]:
    """Round values between ``lo`` and ``hi``, about ``count`` of them."""
    if hi <= lo:
        return [lo]
    raw = (hi - lo) / count
    step = 10 ** math.floor(math.log10(raw))
    step *= next(m for m in (1, 2, 5, 10) if raw <= m * step)
    first = math.ceil(lo / step) * step
    return [first + i * step for i in range(int((hi - first) / step + 1e-9) + 1)]


def draw(curves: Dict[str, List[Tuple[int, float]]], tag: str, out: str) -> None:
    """Draw ``curves`` (label -> points) into the PNG ``out``."""
    from PIL import Image, ImageDraw, ImageFont

    points = [p for c in curves.values() for p in c if math.isfinite(p[1])]
    x0, x1 = min(p[0] for p in points), max(p[0] for p in points)
    y0, y1 = min(p[1] for p in points), max(p[1] for p in points)
    x1, y1 = (x1 if x1 > x0 else x0 + 1), (y1 if y1 > y0 else y0 + 1)
    pad = (y1 - y0) * 0.05
    y0, y1 = y0 - pad, y1 + pad

    def at(step, value):
        return (LEFT + (step - x0) / (x1 - x0) * (W - LEFT - RIGHT),
                H - BOTTOM - (value - y0) / (y1 - y0) * (H - TOP - BOTTOM))

    img = Image.new("RGB", (W, H), "white")
    d = ImageDraw.Draw(img)
    font = ImageFont.load_default(size=14)
    d.rectangle([LEFT, TOP, W - RIGHT, H - BOTTOM], outline="black")
    for v in ticks(y0, y1):
        _, y = at(x0, v)
        d.line([LEFT, y, W - RIGHT, y], fill="#e8e8e8")
        d.text((LEFT - 8, y), f"{v:g}", fill="black", font=font, anchor="rm")
    for s in ticks(x0, x1):
        x, _ = at(s, y0)
        d.line([x, H - BOTTOM, x, H - BOTTOM + 5], fill="black")
        d.text((x, H - BOTTOM + 8), f"{s:g}", fill="black", font=font, anchor="ma")
    d.text((LEFT + (W - LEFT - RIGHT) / 2, H - 18), "step", fill="black", font=font, anchor="mm")
    d.text((LEFT, TOP - 12), tag, fill="black", font=font, anchor="ls")
    for i, (label, curve) in enumerate(curves.items()):
        colour, width = COLOURS[i % len(COLOURS)], max(1, 2 * (len(curves) - i) - 1)
        xy = [at(s, v) for s, v in curve if math.isfinite(v)]
        if len(xy) > 1:
            d.line(xy, fill=colour, width=width, joint="curve")
        lx, ly = W - RIGHT - 170, TOP + 12 + 20 * i
        d.line([lx, ly, lx + 28, ly], fill=colour, width=3)
        d.text((lx + 36, ly), label, fill="black", font=font, anchor="lm")
    fd, tmp = tempfile.mkstemp(suffix=".png", dir=os.path.dirname(os.path.abspath(out)))
    try:
        with os.fdopen(fd, "wb") as f:
            img.save(f, format="PNG")
        umask = os.umask(0)
        os.umask(umask)
        os.chmod(tmp, 0o666 & ~umask)  # (as a file opened for writing would be, not mkstemp's 0600)
        os.replace(tmp, out)
    except BaseException:
        os.unlink(tmp)
        raise


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("runs", nargs="+", metavar="LABEL=LOGDIR")
    p.add_argument("-o", "--output", required=True, help="the PNG to write")
    p.add_argument("--tag", default="batch_loss", help="the scalar to draw (default batch_loss)")
    a = p.parse_args(argv)
    curves = {}
    for given in a.runs:
        label, sep, logdir = given.partition("=")
        if not sep or not label or not logdir:
            raise SystemExit(f"plot_runs: {given}: give LABEL=LOGDIR")
        curves[label] = read_curve(logdir, a.tag)
        if not curves[label]:
            raise SystemExit(f"plot_runs: {logdir}: no {a.tag} values")
    draw(curves, a.tag, a.output)
    print(f"wrote {a.output} ({', '.join(f'{k}: {len(v)} steps' for k, v in curves.items())})")
    return 0


if __name__ == "__main__":
    sys.exit(main())
