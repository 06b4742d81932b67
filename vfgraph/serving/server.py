"""``vfgraph serve``: one process answering TF Serving's REST API (aiohttp) and gRPC API
(grpcio's asyncio server) on one event loop, the model's work on a thread pool.

Why these libraries: grpcio's ``grpc.aio`` server is the one gRPC server for Python kept by
the gRPC project, and aiohttp's server runs on the same asyncio loop, so both APIs share one
loop, one thread pool and one shutdown; an ASGI server (uvicorn) would add its own loop
management and a framework on top for the same few routes.

Start-up: the newest version under the base path is loaded before the ports open (one that
fails to load is a user error, exit 2); then the base path is polled for new versions. A line
``vfgraph serve: ... REST on http://HOST:PORT, gRPC on HOST:PORT`` on stdout says the server is
ready (with the ports bound, when 0 asked for free ones). SIGTERM or SIGINT: the ports close,
requests in flight are answered (up to ``drain_seconds``), exit 0. Each request is one line of
the access log on stderr.
"""
from __future__ import annotations

import asyncio
import logging
import os
import signal
import sys
import time
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass

from typing import Optional

from vfgraph.errors import InputError
from vfgraph.serving.batching import BatchingParameters
from vfgraph.serving.versions import Manager, numbered_versions

log = logging.getLogger("vfgraph.serve")
WAITING = 64  # with batching: requests that may wait for their batch at once


@dataclass(frozen=True)
class ServeOptions:
    """The options of ``vfgraph serve``, checked here (TF Serving's defaults where it has one)."""

    base_path: str
    model_name: str = "default"
    rest_port: int = 8501
    grpc_port: int = 8500
    host: str = "0.0.0.0"
    poll_seconds: float = 1.0
    threads: int = 8
    drain_seconds: float = 30.0
    batching: Optional[BatchingParameters] = None  # None: requests run as they come

    def __post_init__(self):
        for flag, port in (("--rest-port", self.rest_port), ("--grpc-port", self.grpc_port)):
            if not 0 <= port <= 65535:
                raise InputError(f"{flag} {port}: give a TCP port, 1-65535 (0: any free port, printed at start)")
        if self.rest_port and self.rest_port == self.grpc_port:
            raise InputError(f"--rest-port and --grpc-port are both {self.rest_port}: give two different ports")
        if not self.model_name or "/" in self.model_name or ":" in self.model_name:
            raise InputError(f"--model-name {self.model_name!r}: give a name without '/' or ':' (it is part of the "
                             "REST paths, /v1/models/NAME)")
        if not 0 < self.poll_seconds < float("inf"):
            raise InputError(f"--file-system-poll-wait-seconds {self.poll_seconds:g}: give a positive number of "
                             "seconds")
        if self.threads < 1:
            raise InputError(f"--threads {self.threads}: give at least 1")
        if not 0 <= self.drain_seconds < float("inf"):
            raise InputError(f"--drain-seconds {self.drain_seconds:g}: give a non-negative number of seconds")


def check_base(base: str) -> str:
    base = os.path.abspath(base)
    if not os.path.isdir(base):
        what = "does not exist" if not os.path.exists(base) else "is not a directory"
        raise InputError(f"{base}: {what}; give the base directory of the model's versions (BASE/1/saved_model.pb, "
                         "as 'vfgraph export -o BASE' writes it)")
    if os.path.isfile(os.path.join(base, "saved_model.pb")):
        raise InputError(f"{base}: is a SavedModel, not a base directory of versions; serve its parent with the "
                         f"model in a numbered directory (e.g. BASE/1/), or export it with 'vfgraph export "
                         f"{base} -o BASE'")
    return base


def check_dependencies() -> None:
    """The libraries of the ``serve`` extra and serve-requirements.txt are there (one line
    saying how to install them otherwise)."""
    import importlib.util

    missing = []
    for dist, module in (("aiohttp", "aiohttp"), ("grpcio", "grpc"), ("prometheus-client", "prometheus_client"),
                         ("tensorflow-serving-api", "tensorflow_serving")):
        try:
            found = sys.modules.get(module, True) is not None and importlib.util.find_spec(module) is not None
        except (ImportError, ValueError):
            found = False
        if not found:
            missing.append(dist)
    if missing:
        raise InputError(f"vfgraph serve needs {', '.join(missing)}: pip install \"vfgraph[serve]\" (-e \".[serve]\" "
                         "in a checkout), then pip install --no-deps -r serve-requirements.txt")


def serve(opts: ServeOptions) -> int:
    """Run the server until SIGTERM or SIGINT; returns the exit code."""
    check_dependencies()
    base = check_base(opts.base_path)
    for flag, port in (("--rest-port", opts.rest_port), ("--grpc-port", opts.grpc_port)):
        _check_port(flag, opts.host, port)  # (before the model loads, which takes seconds)
    manager = Manager(opts.model_name, base, opts.poll_seconds)
    manager.poll()
    if manager.serving is None and numbered_versions(base):
        st = manager.statuses()[0]
        raise InputError(f"{os.path.join(base, str(st.version))}: cannot be served: {st.error_message}; export the "
                         f"model there again ('vfgraph export MODEL -o {base} --version {st.version} --force') or "
                         "remove that version")
    return asyncio.run(_serve(opts, manager))


def _check_port(flag: str, host: str, port: int) -> None:
    """A port another process listens on is one line at once."""
    import socket

    if not port:
        return
    try:
        infos = socket.getaddrinfo(host, port, type=socket.SOCK_STREAM)
    except socket.gaierror as e:
        raise InputError(f"--host {host}: not an address of this machine ({e.strerror}); give e.g. 0.0.0.0 or "
                         "127.0.0.1")
    family, kind, proto, _, address = infos[0]
    with socket.socket(family, kind, proto) as s:
        s.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        try:
            s.bind(address)
        except OSError as e:
            raise InputError(f"{flag} {port}: cannot listen on {host}:{port} ({e.strerror or e}); give a free port")


async def _serve(opts: ServeOptions, manager: Manager) -> int:
    from aiohttp import web
    import grpc

    from vfgraph.serving import grpc_api, rest
    from vfgraph.serving.api import Models
    from vfgraph.serving.batching import Batcher
    from vfgraph.serving.metrics import Requests

    loop = asyncio.get_running_loop()
    # (with batching, a request waits for its batch on a thread of the pool: room for those waiting)
    pool = ThreadPoolExecutor(opts.threads if opts.batching is None else max(opts.threads, WAITING),
                              thread_name_prefix="vfgraph-serve")

    async def run(fn, *args):
        return await loop.run_in_executor(pool, fn, *args)

    requests = Requests()
    batcher = None if opts.batching is None else Batcher(opts.batching, requests.batch)
    models = Models(manager, batcher=batcher)
    runner = web.AppRunner(rest.make_app(models, run, requests), access_log=None, handle_signals=False,
                           shutdown_timeout=opts.drain_seconds)
    await runner.setup()
    site = web.TCPSite(runner, opts.host, opts.rest_port, reuse_address=True)
    try:
        await site.start()
    except OSError as e:
        await runner.cleanup()
        raise InputError(f"--rest-port {opts.rest_port}: cannot listen on {opts.host}:{opts.rest_port} "
                         f"({e.strerror or e}); give a free port")
    rest_port = runner.addresses[0][1]
    # as TF Serving: messages of any size (gRPC's default refuses requests over 4 MiB), and a busy
    # port is an error rather than shared
    server = grpc.aio.server(options=[("grpc.so_reuseport", 0), ("grpc.max_receive_message_length", -1),
                                      ("grpc.max_send_message_length", -1)])
    grpc_api.add_services(server, models, run, requests)
    try:
        grpc_port = server.add_insecure_port(f"{opts.host}:{opts.grpc_port}")
    except RuntimeError:
        grpc_port = 0
    if not grpc_port:
        await runner.cleanup()
        raise InputError(f"--grpc-port {opts.grpc_port}: cannot listen on {opts.host}:{opts.grpc_port}; give a "
                         "free port")
    await server.start()
    stop = asyncio.Event()
    for sig in (signal.SIGTERM, signal.SIGINT):
        loop.add_signal_handler(sig, stop.set)
    poller = manager.start()
    served = manager.serving.version if manager.serving else "none yet"
    b = opts.batching
    batching = "" if b is None else (f"; batching up to {b.max_batch_size} rows, {b.batch_timeout_micros} us, "
                                     f"{b.num_batch_threads} thread(s)")
    print(f"vfgraph serve: model {manager.name!r} version {served} from {manager.base}; REST on "
          f"http://{opts.host}:{rest_port}, gRPC on {opts.host}:{grpc_port}{batching}", flush=True)
    await stop.wait()
    started = time.monotonic()
    log.warning("stopping: answering the %d request(s) in flight, accepting no new ones", manager.in_flight())
    manager.stop()
    await asyncio.gather(runner.cleanup(), server.stop(grace=opts.drain_seconds))
    pool.shutdown(wait=True)
    if batcher is not None:
        batcher.stop()
    poller.join(timeout=opts.poll_seconds + 5)
    log.warning("stopped after %.1fs", time.monotonic() - started)
    return 0


def setup_logging() -> None:
    """Access lines and the server's own messages on stderr, one line each."""
    handler = logging.StreamHandler(sys.stderr)
    handler.setFormatter(logging.Formatter("vfgraph serve: %(message)s"))
    from vfgraph.serving.metrics import access_log

    for logger in (log, access_log):
        logger.handlers = [handler]
        logger.propagate = False
    access_log.setLevel(logging.INFO)
    if log.level == logging.NOTSET:
        log.setLevel(logging.WARNING)
