"""tools/plot_runs.py: runs' batch_loss read back from TensorBoard event files (written as
``vfgraph train --logdir`` writes them, tf.summary scalars) and drawn into one PNG, each run's
curve in its colour; a missing run or scalar is one line."""
import os
import subprocess
import sys

import numpy as np

from tool_module import load_tool, tool_path

TOOL = tool_path("plot_runs")


def write_run(logdir, losses):
    import tensorflow as tf

    with tf.summary.create_file_writer(os.path.join(logdir, "train")).as_default():
        for step, loss in enumerate(losses, 1):
            tf.summary.scalar("batch_loss", loss, step=step)


def test_curves_of_several_runs_in_one_png(tmp_path):
    from PIL import Image

    plot = load_tool("plot_runs")
    steps = np.arange(1, 41)
    write_run(str(tmp_path / "a"), 2.3 * np.exp(-steps / 10))
    write_run(str(tmp_path / "b"), 2.3 * np.exp(-steps / 20) + 0.1)
    assert plot.read_curve(str(tmp_path / "a"), "batch_loss")[:2] == [(1, float(np.float32(2.3 * np.exp(-0.1)))),
                                                                      (2, float(np.float32(2.3 * np.exp(-0.2))))]
    out = str(tmp_path / "curves.png")
    assert plot.main([f"1x8={tmp_path / 'a'}", f"2x4={tmp_path / 'b'}", "-o", out]) == 0
    img = np.asarray(Image.open(out).convert("RGB"))
    assert img.shape == (plot.H, plot.W, 3)
    for colour in plot.COLOURS[:2]:  # (each curve drawn, in the plot's area)
        rgb = np.array([int(colour[i:i + 2], 16) for i in (1, 3, 5)])
        hits = np.argwhere((img == rgb).all(axis=2))
        assert (hits[:, 1] > plot.LEFT + 50).sum() > 100, colour
    assert [f for f in os.listdir(tmp_path) if f.endswith(".png")] == ["curves.png"]
    umask = os.umask(0)
    os.umask(umask)
    assert os.stat(out).st_mode & 0o777 == 0o666 & ~umask


def test_a_missing_run_or_scalar_is_one_line(tmp_path):
    import pytest

    plot = load_tool("plot_runs")
    write_run(str(tmp_path / "a"), [1.0, 0.5])
    for args, said in ((["x=" + str(tmp_path / "none")], "no such directory"),
                       (["x=" + str(tmp_path / "a"), "--tag", "epoch_loss"], "no scalar 'epoch_loss' (has: batch_loss)"),
                       (["nolabel"], "give LABEL=LOGDIR")):
        with pytest.raises(SystemExit) as stopped:  # (Python prints its message, one line, and exits 1)
            plot.main([*args, "-o", str(tmp_path / "p.png")])
        assert said in str(stopped.value) and "\n" not in str(stopped.value)
        assert not os.path.exists(tmp_path / "p.png")
    res = subprocess.run([sys.executable, TOOL, "nolabel", "-o", str(tmp_path / "p.png")], capture_output=True,
                         text=True, timeout=120)
    assert res.returncode == 1 and res.stderr.strip() == "plot_runs: nolabel: give LABEL=LOGDIR"
