"""vfgraph's MPI ops on real MPI: two ranks under the venv's mpiexec, single processes, the build.

The multi-rank checks live in mpi_ops_worker.py (many checks per launch: every launch imports
TensorFlow on each rank).
"""
from __future__ import annotations

import os
import signal
import subprocess
import sys

import pytest

pytest.importorskip("mpi4py")

HERE = os.path.dirname(os.path.abspath(__file__))
ROOT = os.path.dirname(os.path.dirname(HERE))
WORKER = os.path.join(HERE, "mpi_ops_worker.py")
MPIEXEC = os.path.join(os.path.dirname(sys.executable), "mpiexec")


def _env(**extra):
    env = dict(os.environ, TF_CPP_MIN_LOG_LEVEL="2", TF_ENABLE_ONEDNN_OPTS="0")
    env["PYTHONPATH"] = os.pathsep.join(p for p in (ROOT, env.get("PYTHONPATH")) if p)
    env.update(extra)
    return env


def _run(args, timeout=240, env=None):
    """Run a command in its own process group; kill the whole group if it outlives timeout."""
    proc = subprocess.Popen(args, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True,
                            env=env or _env(), cwd=ROOT, start_new_session=True)
    try:
        out, _ = proc.communicate(timeout=timeout)
    except subprocess.TimeoutExpired:
        os.killpg(proc.pid, signal.SIGKILL)
        out, _ = proc.communicate()
        pytest.fail(f"{' '.join(args)} timed out after {timeout} s:\n{out[-4000:]}")
    return proc.returncode, out


def _worker(mode, path, ranks):
    args = [sys.executable, WORKER, mode, path]
    if ranks:
        if not os.path.exists(MPIEXEC):
            pytest.skip(f"no mpiexec beside {sys.executable} (pip install mpich)")
        args = [MPIEXEC, "-n", str(ranks)] + args
    code, out = _run(args)
    assert code == 0 and "ALL OK" in out, out[-6000:]
    return out


@pytest.fixture(scope="module")
def saved_model(tmp_path_factory):
    """Runs every collective check on two ranks; rank 0 saves a model using the ops."""
    path = str(tmp_path_factory.mktemp("mpi_ops") / "model")
    _worker("collectives", path, ranks=2)
    return path


@pytest.mark.mpi
def test_collectives_on_two_ranks(saved_model):
    """allreduce (every dtype, eager and graph), broadcast (root 0 and 1), broadcast of variables
    in place, uneven allgather,
    check, rank/size, communicators, and the errors of each: see mpi_ops_worker.collectives."""
    assert os.path.isdir(saved_model)


@pytest.mark.mpi
def test_saved_model_runs_after_import_vfgraph(saved_model):
    _worker("load-saved", saved_model, ranks=2)


def test_unregistered_without_library_then_single_process_identity(saved_model):
    """A fresh process cannot load the model before the library is registered; after
    ``import vfgraph`` every collective of a one-rank world is the identity."""
    _worker("unregistered", saved_model, ranks=0)


def test_missing_mpi_wrapper_is_explained(tmp_path, monkeypatch):
    from vfgraph.ops import OpsUnavailableError, build

    monkeypatch.setenv("VFGRAPH_CACHE_DIR", str(tmp_path / "cache"))
    monkeypatch.setenv("VFGRAPH_MPICXX", str(tmp_path / "no" / "mpicxx"))
    with pytest.raises(OpsUnavailableError) as e:
        build(force=True)
    msg = str(e.value)
    assert str(tmp_path / "no" / "mpicxx") in msg
    assert "pip install mpich, or set VFGRAPH_MPICXX to your cluster's mpicxx" in msg
    assert not os.path.exists(tmp_path / "cache" / "ops") or not any(
        name.endswith(".so") for _, _, names in os.walk(tmp_path / "cache") for name in names)


def test_failed_import_build_is_recorded_once(tmp_path):
    """A failing import-time build warns once and records a marker; a later registration
    finds the marker and does not compile again; ``vfgraph build-ops`` retries and explains."""
    script = (
        "import logging, sys; logging.basicConfig(level=logging.INFO, stream=sys.stdout)\n"
        "import vfgraph, vfgraph.ops as ops\n"
        "print('AVAILABLE', ops.available())\n"
        "print('SECOND IMPORT')\n"
        "ops.register_at_import()\n"
        "print('CODE', ops.build_ops_main([]))\n")
    cache = tmp_path / "cache"
    code, out = _run([sys.executable, "-c", script],
                     env=_env(VFGRAPH_CACHE_DIR=str(cache), CXX=str(tmp_path / "no-such-c++")))
    assert code == 0, out
    first, second = out.split("SECOND IMPORT")
    assert first.count("WARNING:vfgraph.ops:vfgraph MPI ops unavailable") == 1, first
    assert "cannot run the C++ compiler" in first and "AVAILABLE False" in first, first
    assert first.count("building vfgraph MPI ops") == 1, first
    markers = [n for n in os.listdir(cache / "ops") if n.endswith(".failed")]
    assert len(markers) == 1, markers
    assert "WARNING" not in second and "an earlier build failed" in second, second
    assert second.count("building vfgraph MPI ops") == 1, second  # build-ops only
    assert "vfgraph build-ops: cannot run the C++ compiler" in second and "CODE 2" in second, second


def test_concurrent_builds_share_one_compile(tmp_path):
    """Two processes building into an empty cache at once: one compiles, the other waits for
    the lock and loads the same library."""
    script = (
        "import logging, sys; logging.basicConfig(level=logging.INFO, stream=sys.stdout)\n"
        "import vfgraph.ops as ops\n"
        "path = ops.build()\n"
        "ops.load()\n"
        "print('LIB', path)\n"
        "print('RESULT', ops.allreduce([1.0, 2.0]).numpy().tolist())\n")
    env = _env(VFGRAPH_CACHE_DIR=str(tmp_path / "cache"))
    args = [sys.executable, "-c", script]
    procs = [subprocess.Popen(args, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True, env=env,
                              cwd=ROOT, start_new_session=True) for _ in range(2)]
    outs = []
    for p in procs:
        try:
            outs.append(p.communicate(timeout=300)[0])
        except subprocess.TimeoutExpired:
            for q in procs:
                os.killpg(q.pid, signal.SIGKILL)
            pytest.fail("concurrent builds timed out")
    for p, out in zip(procs, outs):
        assert p.returncode == 0, out[-4000:]
        assert "RESULT [1.0, 2.0]" in out, out[-4000:]
    libs = {line.split(" ", 1)[1] for out in outs for line in out.splitlines() if line.startswith("LIB ")}
    assert len(libs) == 1 and all(lib.startswith(str(tmp_path / "cache")) for lib in libs), libs
    assert sum(out.count("building vfgraph MPI ops") for out in outs) == 1, outs
