"""Compiling the MPI op library for the TensorFlow and MPI of this process, once, into a cache.

The library is built from ``mpi_ops.cc`` (shipped with the package) by the C++ compiler
(``$CXX`` or ``g++``) with TensorFlow's compile and link flags and the include and library
flags of the MPI compiler wrapper (``$VFGRAPH_MPICXX``, else ``mpicxx`` beside the Python
executable, else ``mpicxx`` on ``PATH``). It lands in
``$VFGRAPH_CACHE_DIR`` (default ``~/.cache/vfgraph``) under ``ops/<key>/vf_mpi_ops.so``, where
the key digests the source, the TensorFlow version, the compile command and the MPI library
version: a change of any of them builds a new library beside the old ones. Only :func:`build`
compiles; :func:`built_library` finds a library already built, for ``import vfgraph``.
"""
from __future__ import annotations

import contextlib
import fcntl
import functools
import glob
import hashlib
import logging
import os
import shlex
import shutil
import subprocess
import sys
import tempfile
from dataclasses import dataclass
from typing import Iterator, List, Optional, Tuple

from vfgraph.errors import VfgraphError

log = logging.getLogger("vfgraph.ops")

SOURCE = os.path.join(os.path.dirname(os.path.abspath(__file__)), "mpi_ops.cc")
LIBRARY_NAME = "vf_mpi_ops.so"
_FAILED_SUFFIX = ".failed"


class OpsUnavailableError(VfgraphError):
    """The MPI op library cannot be built or loaded here; the message says what is missing."""


class RecordedBuildFailure(OpsUnavailableError):
    """A build that records its failure (``retry_failed=False``, as :func:`vfgraph.ops.available`
    builds) failed before in this environment (its marker file says why)."""


@dataclass(frozen=True)
class BuildPlan:
    """Everything that determines one build: the command, and where its result lives."""

    command: Tuple[str, ...]  # with "{src}" and "{out}" in place of the source and output paths
    key: str
    directory: str

    @property
    def library(self) -> str:
        return os.path.join(self.directory, LIBRARY_NAME)

    @property
    def log_file(self) -> str:
        return os.path.join(self.directory, "build.log")


def cache_dir() -> str:
    """The root of vfgraph's cache: ``$VFGRAPH_CACHE_DIR``, else ``~/.cache/vfgraph``."""
    return os.environ.get("VFGRAPH_CACHE_DIR") or os.path.join(os.path.expanduser("~"), ".cache", "vfgraph")


def import_mpi():
    """``mpi4py.MPI`` (importing it initialises MPI); OpsUnavailableError without mpi4py."""
    try:
        import mpi4py  # noqa: F401
    except ImportError as e:
        raise OpsUnavailableError(
            f"vfgraph's MPI ops need mpi4py, which cannot be imported here ({e}); "
            "install it with: pip install 'vfgraph[mpi]'") from e
    try:
        from mpi4py import MPI
    except Exception as e:  # mpi4py raises RuntimeError when it finds no MPI library
        raise OpsUnavailableError(
            f"mpi4py is installed but cannot start MPI ({type(e).__name__}: {e}); install an MPI "
            "library (pip install mpich) or load your cluster's MPI module") from e
    return MPI


def find_mpicxx() -> Optional[str]:
    """The MPI C++ compiler wrapper to take MPI's flags from, or None when there is none."""
    explicit = os.environ.get("VFGRAPH_MPICXX")
    if explicit:
        return explicit
    beside = os.path.join(os.path.dirname(sys.executable), "mpicxx")
    if os.path.isfile(beside) and os.access(beside, os.X_OK):
        return beside
    return shutil.which("mpicxx")


def find_cxx() -> Optional[str]:
    """The C++ compiler: ``$CXX`` (a command, possibly with arguments), else ``g++``."""
    cxx = os.environ.get("CXX")
    if cxx:
        return cxx
    return shutil.which("g++")


def mpi_flags(mpicxx: str) -> List[str]:
    """The include, library and linker flags the MPI wrapper would pass, plus an rpath per
    library directory (MPICH: ``-show``; Open MPI: ``--showme``)."""
    if os.sep in mpicxx and not os.path.isfile(mpicxx):
        raise OpsUnavailableError(
            f"the MPI compiler wrapper {mpicxx} does not exist (from $VFGRAPH_MPICXX); "
            "pip install mpich, or set VFGRAPH_MPICXX to your cluster's mpicxx")
    shown = None
    errors = []
    for option in ("-show", "--showme"):
        try:
            done = subprocess.run([mpicxx, option], capture_output=True, text=True, timeout=60)
        except OSError as e:
            raise OpsUnavailableError(
                f"cannot run the MPI compiler wrapper {mpicxx} ({e}); "
                "pip install mpich, or set VFGRAPH_MPICXX to your cluster's mpicxx") from e
        except subprocess.TimeoutExpired:
            errors.append(f"{mpicxx} {option}: timed out")
            continue
        if done.returncode == 0 and done.stdout.strip():
            shown = done.stdout
            break
        errors.append(f"{mpicxx} {option}: exit {done.returncode}: {(done.stderr or done.stdout).strip()[-300:]}")
    if shown is None:
        raise OpsUnavailableError(
            f"the MPI compiler wrapper {mpicxx} does not report its flags with -show or --showme "
            f"({'; '.join(errors)}); set VFGRAPH_MPICXX to an MPICH or Open MPI mpicxx")
    words = shlex.split(shown)[1:]  # the first word is the wrapped compiler
    flags: List[str] = []
    rpaths: List[str] = []
    i = 0
    while i < len(words):
        w = words[i]
        if w in ("-I", "-L") and i + 1 < len(words):
            w = w + words[i + 1]
            i += 1
        if w.startswith("-L"):
            rpaths.append(w[2:])
        if w.startswith(("-I", "-L", "-l", "-Wl,")):
            flags.append(w)
        i += 1
    flags += [f"-Wl,-rpath,{d}" for d in dict.fromkeys(rpaths)]
    return flags


def _tf():
    import tensorflow as tf

    return tf


def _digest(*parts: str) -> str:
    h = hashlib.sha256()
    for p in parts:
        h.update(p.encode())
        h.update(b"\0")
    return h.hexdigest()[:16]


def _source_text() -> str:
    try:
        with open(SOURCE) as f:
            return f.read()
    except OSError as e:
        raise OpsUnavailableError(f"the op source {SOURCE} is missing from the vfgraph installation ({e}); "
                                  "reinstall vfgraph") from e


def environment_key() -> str:
    """A digest of what a build attempt depends on that is known without running any tool
    (source, TensorFlow and MPI versions, which compiler and wrapper would be used); names the
    marker of a recorded build failure."""
    MPI = import_mpi()
    return _digest(_source_text(), _tf().__version__, MPI.Get_library_version(),
                   find_cxx() or "", find_mpicxx() or "", sys.executable)


def failure_marker() -> str:
    """Path of the marker a build with ``retry_failed=False`` leaves when it fails."""
    return os.path.join(cache_dir(), "ops", environment_key() + _FAILED_SUFFIX)


def _cached(pattern: str) -> bool:
    return bool(glob.glob(os.path.join(glob.escape(os.path.join(cache_dir(), "ops")), pattern)))


def built_library() -> Optional[str]:
    """The library built for this process's TensorFlow and MPI when the cache holds it, else
    None; never compiles. While the cache holds no library at all, it starts nothing (no MPI,
    no compiler wrapper); otherwise it plans the build (:func:`plan`: starts MPI, asks the
    wrapper for its flags) and raises OpsUnavailableError as that does."""
    if not _cached(os.path.join("*", LIBRARY_NAME)):
        return None
    library = plan().library
    return library if os.path.isfile(library) else None


def recorded_failure() -> Optional[str]:
    """What a failed build with ``retry_failed=False`` recorded for this environment, else
    None; starts nothing while the cache holds no such record."""
    if not _cached("*" + _FAILED_SUFFIX):
        return None
    marker = failure_marker()
    return _read_marker(marker) if os.path.isfile(marker) else None


def plan() -> BuildPlan:
    """The build for this process's TensorFlow and MPI; OpsUnavailableError naming what is
    missing (mpi4py, a C++ compiler, the MPI compiler wrapper)."""
    MPI = import_mpi()
    mpicxx = find_mpicxx()
    cxx = find_cxx()
    return _plan(cxx, mpicxx, MPI.Get_library_version(), cache_dir())


@functools.lru_cache(maxsize=None)
def _plan(cxx: Optional[str], mpicxx: Optional[str], mpi_version: str, root: str) -> BuildPlan:
    if not cxx:
        raise OpsUnavailableError(
            "no C++ compiler found to build vfgraph's MPI ops: install g++ (e.g. apt-get install g++) "
            "or set CXX to a C++17 compiler")
    if not mpicxx:
        raise OpsUnavailableError(
            "no MPI compiler wrapper (mpicxx) found to build vfgraph's MPI ops: "
            "pip install mpich, or set VFGRAPH_MPICXX to your cluster's mpicxx")
    tf = _tf()
    command = tuple(shlex.split(cxx)) + (
        "-std=c++17", "-shared", "-fPIC", "-O2", "-Wno-deprecated-declarations",
        "-Wno-interference-size", "{src}", "-o", "{out}",
        *tf.sysconfig.get_compile_flags(), *mpi_flags(mpicxx), *tf.sysconfig.get_link_flags())
    key = _digest(_source_text(), tf.__version__, shlex.join(command), mpi_version)
    return BuildPlan(command=command, key=key, directory=os.path.join(root, "ops", key))


@contextlib.contextmanager
def _locked(path: str) -> Iterator[None]:
    """Holds an exclusive lock on ``path`` (created if missing) for the duration."""
    os.makedirs(os.path.dirname(path), exist_ok=True)
    with open(path, "a") as f:
        fcntl.flock(f.fileno(), fcntl.LOCK_EX)
        try:
            yield
        finally:
            fcntl.flock(f.fileno(), fcntl.LOCK_UN)


def build(force: bool = False, *, retry_failed: bool = True) -> str:
    """Build the op library unless the cache already holds it (``force``: build again);
    returns its path. Concurrent callers (several ranks on one file system) build it once.

    With ``retry_failed=False`` (:func:`vfgraph.ops.available`), a failure recorded by an
    earlier such call is raised again without compiling, and a new failure is recorded.
    """
    marker = failure_marker()
    if not retry_failed and os.path.isfile(marker):
        raise RecordedBuildFailure(_read_marker(marker))
    try:
        path = _build(force, None if retry_failed else marker)
    except OpsUnavailableError as e:
        if not retry_failed and not isinstance(e, RecordedBuildFailure):
            with contextlib.suppress(OSError):
                os.makedirs(os.path.dirname(marker), exist_ok=True)
                with open(marker, "w") as f:
                    f.write(f"{e}\n(recorded in {marker}; `vfgraph build-ops` builds again)\n")
        raise
    with contextlib.suppress(FileNotFoundError):
        os.remove(marker)
    return path


def _read_marker(marker: str) -> str:
    with open(marker, errors="replace") as f:
        return f.read().strip()


def _build(force: bool, marker: Optional[str]) -> str:
    p = plan()
    if not force and os.path.isfile(p.library):
        return p.library
    try:
        os.makedirs(p.directory, exist_ok=True)
    except OSError as e:
        raise OpsUnavailableError(f"cannot create the cache directory {p.directory} ({e}); "
                                  "set VFGRAPH_CACHE_DIR to a writable directory") from e
    with _locked(os.path.join(cache_dir(), "ops", "build.lock")):
        if not force and os.path.isfile(p.library):
            return p.library  # another process built it while this one waited for the lock
        if marker and os.path.isfile(marker):
            raise RecordedBuildFailure(_read_marker(marker))  # and that one failed
        _compile(p)
    return p.library


def _compile(p: BuildPlan) -> None:
    """Runs the compiler into a temporary file beside the library, then moves it into place."""
    log.info("building vfgraph MPI ops (once per TensorFlow/MPI version) ...")
    fd, tmp = tempfile.mkstemp(prefix=".vf_mpi_ops.", suffix=".so.tmp", dir=p.directory)
    os.close(fd)
    command = [w.replace("{src}", SOURCE).replace("{out}", tmp) for w in p.command]
    try:
        with open(p.log_file, "w") as logf:
            logf.write(shlex.join(command) + "\n\n")
            logf.flush()
            try:
                done = subprocess.run(command, stdout=logf, stderr=subprocess.STDOUT)
            except OSError as e:
                raise OpsUnavailableError(
                    f"cannot run the C++ compiler {command[0]} ({e}); install g++ or set CXX "
                    "to a C++17 compiler") from e
        if done.returncode != 0:
            with open(p.log_file, errors="replace") as f:
                tail = "".join(f.readlines()[-20:])
            raise OpsUnavailableError(
                f"compiling vfgraph's MPI ops failed (exit {done.returncode}); last lines of the "
                f"compiler output:\n{tail}\nfull log: {p.log_file}")
        os.chmod(tmp, 0o755)
        os.replace(tmp, p.library)
    finally:
        with contextlib.suppress(FileNotFoundError):
            os.remove(tmp)
