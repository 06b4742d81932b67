"""The server's Prometheus metrics (prometheus-client) and its access log, fed by every request.

Metric names are TF Serving's (tensorflow_serving/servables/tensorflow/util.cc), in the form its
Prometheus exporter gives them (``/`` as ``:``): ``:tensorflow:serving:request_count`` by model
and status (a counter: Prometheus' client writes it with the ``_total`` suffix) and
``:tensorflow:serving:request_latency`` in microseconds by model, API and entry point (REST or
GRPC), with TF Serving's buckets (10 us times powers of 1.8). Served at TF Serving's default
path, ``/monitoring/prometheus/metrics``, on the REST port.
"""
from __future__ import annotations

import logging
from typing import Optional

log = logging.getLogger("vfgraph.serve")
access_log = logging.getLogger("vfgraph.serve.access")

PATH = "/monitoring/prometheus/metrics"


class Requests:
    """Counts, times and logs requests: one access line each (API, what, model, version,
    status, milliseconds)."""

    def __init__(self):
        from prometheus_client import CollectorRegistry, Counter, Histogram

        self.registry = CollectorRegistry()
        self.count = Counter(":tensorflow:serving:request_count", "The total number of requests.",
                             ["model_name", "status"], registry=self.registry)
        self.latency = Histogram(":tensorflow:serving:request_latency",
                                 "Distribution of wall time (in microseconds) for Tensorflow Serving request.",
                                 ["model_name", "API", "entrypoint"], registry=self.registry,
                                 buckets=[10 * 1.8 ** k for k in range(33)] + [float("inf")])
        self.batch_size = Histogram("vfgraph_serve_batch_size", "Rows of each batch of merged requests run "
                                    "(with --enable-batching), padding included.", registry=self.registry,
                                    buckets=[2 ** k for k in range(14)] + [float("inf")])

    def batch(self, rows: int) -> None:
        self.batch_size.observe(rows)

    def record(self, entrypoint: str, what: str, api: str, model: str, version, status, code: str, seconds: float,
               error: Optional[BaseException] = None) -> None:
        """One request: ``entrypoint`` REST or gRPC, ``what`` (method and path, or the RPC),
        ``api`` (predict, metadata, status, ...), ``status`` as the access line shows it (the
        HTTP status, or the gRPC code) and ``code`` the canonical code (OK, NOT_FOUND, ...)."""
        access_log.info("%s %s model=%s version=%s status=%s %.1fms", entrypoint, what, model or "-",
                        "-" if version is None else version, status, seconds * 1e3)
        if error is not None:
            log.error("internal error answering %s %s", entrypoint, what, exc_info=error)
        if model:
            self.count.labels(model, code).inc()
            if code == "OK":  # (as TF Serving: the latency of answered requests)
                self.latency.labels(model, api, "GRPC" if entrypoint == "gRPC" else entrypoint).observe(seconds * 1e6)

    def page(self) -> bytes:
        from prometheus_client import generate_latest

        return generate_latest(self.registry)
