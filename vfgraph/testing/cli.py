"""Running the command line in tests as users run it, and what such tests compare: a tree's
digest (to show an input or an earlier output is untouched) and the one error line.

The top of vfgraph's layers: it runs :mod:`vfgraph.cli`, and nothing of vfgraph imports it
(tests/test_layering.py). The command line is imported when a command is first run in this
process, so the helpers that run it in a new process, or compare what it left, import no
more than they use."""
from __future__ import annotations

import hashlib
import os
import subprocess
import sys
from typing import Callable, List, Optional, Tuple

# TensorFlow quiet, and no oneDNN reordering (results the same on every machine)
ENV = dict(os.environ, TF_CPP_MIN_LOG_LEVEL="3", TF_ENABLE_ONEDNN_OPTS="0")


def vf(*args, cwd=None, env: Optional[dict] = None, preexec_fn: Optional[Callable[[], None]] = None,
       timeout: float = 300) -> subprocess.CompletedProcess:
    """``vfgraph ARGS`` in a new process (``python -m vfgraph.cli``), output captured."""
    return subprocess.run([sys.executable, "-m", "vfgraph.cli", *map(str, args)], capture_output=True, text=True,
                          env=ENV if env is None else env, cwd=cwd, timeout=timeout, preexec_fn=preexec_fn)


def run_in_process(capsys, *argv) -> Tuple[int, List[str]]:
    """``vfgraph ARGV`` through :func:`vfgraph.cli.main` in this process (one TensorFlow import
    for many cases), with pytest's ``capsys``: (exit code, non-empty stderr lines)."""
    from vfgraph import cli

    capsys.readouterr()
    try:
        code = cli.main([str(a) for a in argv])
    except SystemExit as e:  # argparse's usage errors
        code = e.code
    return code, [line for line in capsys.readouterr().err.splitlines() if line.strip()]


def tree_digest(path) -> str:
    """Digest of a tree: every directory, every file's relative path and bytes, every link's target."""
    h = hashlib.sha256()
    for root, dirs, files in os.walk(path):
        dirs.sort()
        h.update(b"d:" + os.path.relpath(root, path).encode() + b"\0")
        for f in sorted(files):
            p = os.path.join(root, f)
            h.update(b"f:" + os.path.relpath(p, path).encode() + b"\0")
            if os.path.islink(p):
                h.update(b"->" + os.readlink(p).encode() + b"\0")
            else:
                with open(p, "rb") as fh:
                    h.update(fh.read())
    return h.hexdigest()


def error_lines(stderr) -> List[str]:
    """The lines vfgraph printed as errors (TensorFlow's own logging left out)."""
    lines = stderr.splitlines() if isinstance(stderr, str) else list(stderr)
    return [line for line in lines if line.startswith("vfgraph")]


def error_line(res) -> str:
    """The single error line of a failed run (asserts there is exactly one and no traceback)."""
    stderr = res.stderr if hasattr(res, "stderr") else "\n".join(res)
    lines = error_lines(stderr)
    assert len(lines) == 1 and "Traceback" not in stderr, stderr
    return lines[0]


def one_error(code: int, err, *needles: str) -> str:
    """A run (exit code, stderr lines) that ended with exit 2 and one error line holding every
    one of ``needles``; that line."""
    assert code == 2, err
    line = error_line(err)
    for n in needles:
        assert n in line, line
    return line
