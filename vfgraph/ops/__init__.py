"""MPI collectives as TensorFlow ops, for graphs that run on several processes at once.

Ops (registered by the library this package builds and loads):

- ``VfAllreduce(input: T, stages: int = 0) -> output: T``: elementwise sum over every rank
  (T: half, bfloat16, float, double, int32, int64); with ``stages`` > 0, over the ranks of
  this rank's pipeline stage (rank r is in stage r modulo ``stages``: the same stage of every
  replica of a pipeline), split by :func:`set_communicator`.
- ``VfBroadcast(input: T, root: int = 0, stages: int = 0) -> output: T``: rank ``root``'s value
  on every rank (T: the above and uint8, int8, bool); with ``stages`` > 0, among the ranks of
  this rank's replica of a pipeline only (its group of ``stages`` consecutive ranks, split by
  :func:`set_communicator`), from the one running stage ``root``.
- ``VfBroadcastVariables(resources: N * resource, root: int = 0)``: no outputs; assigns rank
  ``root``'s value of each variable to it on every rank, in place (dtypes as VfBroadcast).
- ``VfAllgather(input: T, stages: int = 0) -> output: T``: the inputs of all ranks concatenated
  along dimension 0 in rank order; dimension 0 may differ between ranks (T: as VfBroadcast);
  ``stages`` as VfAllreduce.
- ``VfCheck(fingerprint: string, what: string)``: no inputs or outputs; fails on every rank
  unless every rank has the same ``fingerprint`` (used as a control dependency).
- ``VfRank(stages: int = 0) -> int32``, ``VfSize(stages: int = 0) -> int32``: this process's
  rank, the number of ranks (``stages`` > 0: in its pipeline stage's communicator).
- ``VfExactAdd(sum: int64, values: N * T) -> output: int64``: no MPI; ``sum`` plus the exact
  fixed-point words of ``values`` (T: half, bfloat16, float, double), for deterministic sums.
- ``VfSend(input: T, tag: int32, stage: int, stages: int)``: no outputs; sends ``input`` as
  message ``tag`` to the rank of pipeline stage ``stage`` in this rank's group of ``stages``
  consecutive ranks (T: the above, int16, uint16).
- ``VfRecv(tag: int32, T: type, stage: int, stages: int, shape: shape) -> output: T``: receives
  message ``tag`` from the rank of stage ``stage`` (its shape travels with it).

Every op runs on the CPU; every op but VfExactAdd is stateful and uses one communicator per process (MPI_COMM_WORLD
unless :func:`set_communicator` chose another). Ranks must issue their collectives in the same
order, which a graph ensures with control dependencies. VfSend and VfRecv are asynchronous and
matched by tag, in any order (they need MPI_THREAD_MULTIPLE, mpi4py's default). MPI itself is initialised and finalised
by mpi4py, which :func:`load` imports.

The library is compiled for this process's TensorFlow and MPI and cached (see
:mod:`vfgraph.ops.toolchain`) by :func:`build`, by :func:`load` and the functions that make ops
(on first use), and by ``vfgraph build-ops``. ``import vfgraph`` registers a library that is
already built (:func:`register_at_import`, once TensorFlow is imported) and never compiles, so
a SavedModel containing these ops loads with ``tf.saved_model.load`` after ``import vfgraph``
once the library is built here.
"""
from __future__ import annotations

import argparse
import ctypes
import importlib.util
import logging
import sys
import threading
from typing import List, Optional

from vfgraph.errors import VfgraphError
from vfgraph.ops import toolchain as _toolchain
from vfgraph.ops.toolchain import OpsUnavailableError, cache_dir

__all__ = [
    "OpsUnavailableError", "abandon", "allgather", "allreduce", "allreduce_stats", "available", "blocked_seconds",
    "broadcast", "build", "build_ops_main", "cache_dir", "check", "exact_add", "library_path", "load", "rank",
    "register_at_import", "recv", "send", "set_communicator", "set_step", "size", "watch",
]

log = logging.getLogger("vfgraph.ops")

_lock = threading.RLock()
_module = None  # the loaded op module
_loaded_path: Optional[str] = None
_communicator = None  # kept alive while the library uses it
_warned = False
_blocked_ns = None  # the library's vf_mpi_blocked_ns, once looked up
_set_step = None  # the library's vf_mpi_set_step, once looked up


def build(force: bool = False) -> str:
    """Build the op library unless the cache already holds it (``force``: build again, even
    after a failed import-time build); returns the library's path. Raises OpsUnavailableError
    saying what is missing (mpi4py, a C++ compiler, an MPI compiler wrapper) or why the
    compiler failed."""
    return _toolchain.build(force=force)


def library_path() -> str:
    """Path of the op library this process uses: the one loaded, else where a build for this
    TensorFlow and MPI puts it. Raises OpsUnavailableError when no build is possible here."""
    if _loaded_path is not None:
        return _loaded_path
    return _toolchain.plan().library


def load():
    """The op module (``tf.load_op_library``'s result), building the library if needed; loaded
    once per process. Imports ``mpi4py.MPI`` first, which initialises MPI."""
    return _load(retry_failed=True)


def _load(retry_failed: bool):
    if _module is not None:
        return _module
    with _lock:
        if _module is None:
            _toolchain.import_mpi()
            path = _toolchain.build(retry_failed=retry_failed)
            if _module is None:  # the build may import TensorFlow, whose import registers a built library
                _load_library(path)
    return _module


def _load_library(path: str) -> None:
    global _module, _loaded_path
    import tensorflow as tf

    try:
        module = tf.load_op_library(path)
    except Exception as e:  # tf.errors.NotFoundError for missing symbols
        raise OpsUnavailableError(
            f"loading the MPI op library {path} failed ({e}); rebuild it with "
            "`vfgraph build-ops --force`") from e
    _module, _loaded_path = module, path


def available() -> bool:
    """Whether the ops can be used in this process, building them if needed unless a build
    attempt of this function already failed in this environment (``build(force=True)``,
    ``load()`` and ``vfgraph build-ops`` try again). Never raises: a new failure is logged
    once as a warning and recorded, a recorded one at info level."""
    try:
        _load(retry_failed=False)
        return True
    except _toolchain.RecordedBuildFailure as e:
        log.info("vfgraph MPI ops unavailable (an earlier build failed): %s", e)
    except Exception as e:  # never let a probe fail because of the optional ops
        _warn_unavailable(e)
    return False


def _warn_unavailable(e: Exception) -> None:
    global _warned
    if not _warned:
        _warned = True
        log.warning("vfgraph MPI ops unavailable, graphs with Vf* ops will not load: %s\n"
                    "(`vfgraph build-ops` builds them again)", e)


def set_communicator(comm, stages: int = 0) -> None:
    """Make every op use the mpi4py communicator ``comm`` from now on (the default is
    ``MPI.COMM_WORLD``). Call it before running graphs with these ops, with the same kind of
    communicator on every rank that takes part. ``stages`` > 0 also splits it into the ranks
    of each of that many pipeline stages (rank r in stage r modulo ``stages``), which the ops
    with that ``stages`` attribute sum over, and into the replicas of the pipeline (rank r in
    replica r // ``stages``), which VfBroadcast with that attribute spans (a collective: every
    rank calls it alike)."""
    global _communicator
    MPI = _toolchain.import_mpi()
    if not isinstance(comm, MPI.Comm) or comm == MPI.COMM_NULL:
        raise ValueError(f"set_communicator needs an mpi4py communicator, not {comm!r}")
    load()
    lib = ctypes.CDLL(library_path())
    lib.vf_mpi_set_comm.argtypes = [ctypes.c_int]
    lib.vf_mpi_set_comm.restype = ctypes.c_int
    rc = lib.vf_mpi_set_comm(comm.py2f())
    if rc != 0:
        reason = {-1: "MPI is not initialized", -2: "the communicator is MPI_COMM_NULL"}.get(
            rc, f"MPI error {rc}: {MPI.Get_error_string(rc) if rc > 0 else ''}")
        raise VfgraphError(f"cannot use communicator {comm!r} for vfgraph's MPI ops: {reason}")
    _communicator = comm
    if stages:
        lib.vf_mpi_split_stages.argtypes = [ctypes.c_int]
        lib.vf_mpi_split_stages.restype = ctypes.c_int
        rc = lib.vf_mpi_split_stages(stages)
        if rc != 0:
            reason = {-1: "MPI is not initialized", -3: f"{comm.Get_size()} ranks are not a multiple of {stages}"}.get(
                rc, f"MPI error {rc}: {MPI.Get_error_string(rc) if rc > 0 else ''}")
            raise VfgraphError(f"cannot split the ranks into {stages} pipeline stages: {reason}")


def blocked_seconds() -> float:
    """Seconds this process has spent in vfgraph's collectives so far (each from taking the
    library's collective lock to the MPI call's end): a step's wall time less what this adds
    during it is the rank's own computing, without its wait for slower ranks."""
    global _blocked_ns
    if _blocked_ns is None:
        load()
        fn = ctypes.CDLL(library_path()).vf_mpi_blocked_ns
        fn.argtypes, fn.restype = [], ctypes.c_int64
        _blocked_ns = fn
    return _blocked_ns() / 1e9


ALLREDUCE_STATS = ("calls", "total_ns", "copy_ns", "arrive_ns", "reduce_ns", "bytes", "tests", "yields", "sleeps",
                   "slept_ns")


def allreduce_stats() -> dict:
    """VfAllreduce's counters in this process so far: ``calls``; nanoseconds from the kernel's
    start to its end (``total_ns``), copying an input it could not reduce in place
    (``copy_ns``, from the start), waiting for every rank to arrive (``arrive_ns``) and reducing
    (``reduce_ns``); ``bytes`` reduced; and over every wait of the ops, the tests of its request,
    yields, sleeps and nanoseconds asleep (``tests``, ``yields``, ``sleeps``, ``slept_ns``).
    Differences between two readings are what the calls between them spent."""
    load()
    fn = ctypes.CDLL(library_path()).vf_mpi_allreduce_stats
    fn.argtypes, fn.restype = [ctypes.POINTER(ctypes.c_int64), ctypes.c_int], ctypes.c_int
    out = (ctypes.c_int64 * len(ALLREDUCE_STATS))()
    fn(out, len(ALLREDUCE_STATS))
    return dict(zip(ALLREDUCE_STATS, out))


def abandon(on: bool = True) -> None:
    """Make every wait of vfgraph's ops for other ranks give up (the op fails with
    ``tf.errors.AbortedError``): the job lost a rank, which will never arrive; ``on=False``
    once the job goes on over a communicator without it."""
    load()
    fn = ctypes.CDLL(library_path()).vf_mpi_abandon
    fn.argtypes, fn.restype = [ctypes.c_int], None
    fn(1 if on else 0)


def watch(warning: float, timeout: float, grace: float = 2.0, signals: bool = False) -> None:
    """Watch every wait of the ops for other ranks (a stall watchdog): a wait longer than
    ``warning`` seconds prints one line on stderr naming what it waits for (op, node, step,
    message tag or collective) and the ranks it waits for; one longer than ``timeout``
    seconds gives up (the op fails with ``tf.errors.DeadlineExceededError``, and every other
    wait of this process with it). 0 turns either off; until this is called, neither is set
    (the defaults are ``vfgraph train``'s options). ``signals`` (from the main thread,
    after the process's own SIGINT and SIGTERM handlers are installed): those signals also
    make the waits give up ``grace`` seconds after the request, or after their own start if
    later (``tf.errors.CancelledError``), then reach
    the handlers as before; a second one, a second or more after the first, while a wait is
    in progress ends the process at once (exit 130). Clears an earlier stop or stall."""
    load()
    fn = ctypes.CDLL(library_path()).vf_mpi_watch
    fn.argtypes, fn.restype = [ctypes.c_double, ctypes.c_double, ctypes.c_double, ctypes.c_int], None
    main = threading.current_thread() is threading.main_thread()
    fn(float(warning), float(timeout), float(grace), 1 if signals and main else 0)


def set_step(step: int) -> None:
    """The training step the watchdog's lines name from now on (-1: none)."""
    global _set_step
    if _set_step is None:
        load()
        fn = ctypes.CDLL(library_path()).vf_mpi_set_step
        fn.argtypes, fn.restype = [ctypes.c_int64], None
        _set_step = fn
    _set_step(step)


def allreduce(x, name: Optional[str] = None, stages: int = 0):
    """Elementwise sum of ``x`` over all ranks (a ``VfAllreduce`` op); ``stages`` > 0: over
    the ranks of this rank's pipeline stage (see :func:`set_communicator`)."""
    return load().vf_allreduce(x, stages=stages, name=name)


def broadcast(x, root: int = 0, name: Optional[str] = None, stages: int = 0):
    """Rank ``root``'s ``x`` on every rank (a ``VfBroadcast`` op); ``stages`` > 0: stage
    ``root``'s ``x`` on every stage of this rank's replica of the pipeline only (see
    :func:`set_communicator`)."""
    return load().vf_broadcast(x, root=root, stages=stages, name=name)


def broadcast_variables(variables, root: int = 0, name: Optional[str] = None):
    """Assign rank ``root``'s value of each of ``variables`` (resource variables or their
    handles) to it on every rank (one ``VfBroadcastVariables`` op). Returns the operation in a
    graph, None when run eagerly."""
    handles = [getattr(v, "handle", v) for v in variables]
    return load().vf_broadcast_variables(handles, root=root, name=name)


def allgather(x, name: Optional[str] = None):
    """Every rank's ``x`` concatenated along dimension 0 in rank order (a ``VfAllgather`` op)."""
    return load().vf_allgather(x, name=name)


def check(fingerprint: str, what: str, name: Optional[str] = None):
    """A ``VfCheck`` op: fails on every rank unless all ranks pass the same ``fingerprint`` (a
    hex digest; ``what`` says what it identifies, for the error message). Returns the
    operation in a graph (use it as a control dependency), None when run eagerly."""
    return load().vf_check(fingerprint=fingerprint, what=what, name=name)


def rank(name: Optional[str] = None):
    """This process's rank in the communicator, as an int32 scalar tensor (a ``VfRank`` op)."""
    return load().vf_rank(name=name)


def size(name: Optional[str] = None, stages: int = 0):
    """The number of ranks in the communicator, as an int32 scalar tensor (a ``VfSize`` op);
    ``stages`` > 0: in this rank's pipeline stage."""
    return load().vf_size(stages=stages, name=name)


def exact_add(total, values, name: Optional[str] = None):
    """``total`` (int64, ``2 n + 1`` words) plus the exact fixed-point words of ``values`` (a
    list of float tensors of ``n`` values in all): a ``VfExactAdd`` op. See
    :mod:`vfgraph.ir.blocks` (``from_exact``) for what the words hold."""
    return load().vf_exact_add(total, values, name=name)


def send(x, tag, stage: int, stages: int, name: Optional[str] = None):
    """Send ``x`` as message ``tag`` to pipeline stage ``stage`` of this rank's group of
    ``stages`` ranks (a ``VfSend`` op). Returns the operation in a graph, None eagerly."""
    return load().vf_send(x, tag, stage=stage, stages=stages, name=name)


def recv(tag, dtype, stage: int, stages: int, shape=None, name: Optional[str] = None):
    """Message ``tag`` of ``dtype`` from pipeline stage ``stage`` of this rank's group of
    ``stages`` ranks (a ``VfRecv`` op); ``shape``: what is known of its shape statically."""
    import tensorflow as tf

    return load().vf_recv(tag, T=dtype, stage=stage, stages=stages, shape=tf.TensorShape(shape), name=name)


def register_at_import() -> None:
    """Load the op library if it is already built for this process's TensorFlow and MPI, so
    that graphs with these ops load in this process (``import vfgraph`` calls it once
    TensorFlow is imported). Never compiles: without mpi4py, or without a built library, it
    does nothing (logging at info level a build failure :func:`available` recorded). Loading
    imports ``mpi4py.MPI``, which initialises MPI. Never raises: a library that does not load
    is logged once as a warning."""
    if _module is not None:
        return
    try:
        if importlib.util.find_spec("mpi4py") is None:
            return
    except (ImportError, ValueError):
        return
    with _lock:
        if _module is not None:
            return
        try:
            path = _toolchain.built_library()
            failure = None if path else _toolchain.recorded_failure()
        except Exception as e:  # which library is this environment's cannot be told (no MPI, no compiler)
            log.info("vfgraph MPI ops not loaded: %s", e)
            return
        if path is None:
            if failure:
                log.info("vfgraph MPI ops unavailable (an earlier build failed): %s", failure)
            else:
                log.debug("vfgraph MPI ops are not built for this TensorFlow and MPI; `vfgraph build-ops` "
                          "builds them")
            return
        try:
            _load_library(path)
        except Exception as e:  # never let an import fail because of the optional ops
            _warn_unavailable(e)


def build_ops_main(argv: Optional[List[str]] = None) -> int:
    """``vfgraph build-ops [--force]``: build and load the op library, print its path; on
    failure print the reason and return its exit code (2)."""
    p = argparse.ArgumentParser(prog="vfgraph build-ops", description=(
        "Build vfgraph's MPI op library for this TensorFlow and MPI (it is otherwise built on "
        f"first use) into the cache ({cache_dir()}/ops) and print its path."))
    p.add_argument("--force", action="store_true", help="build again even if the cache holds it")
    args = p.parse_args(argv)
    try:
        path = build(force=args.force)
        load()
    except VfgraphError as e:
        print(f"vfgraph build-ops: {e}", file=sys.stderr)
        return e.exit_code
    print(path)
    return 0
