"""Load test of ``vfgraph serve`` on loopback: latency and throughput of REST and gRPC against
calling the loaded signature in-process, the baseline measured in the same run, and with
request batching against without.

The digits CNN (examples/export.py) exported with ``vfgraph export --vnode-batch 32`` is served
by ``vfgraph serve`` in a process of its own; a client thread pool of 1, 8 and 32 threads sends
one-example predict requests (REST: JSON ``instances`` over a kept-alive connection per thread;
gRPC: tensorflow-serving-api's stub on one channel) until ``--requests`` are answered or
``--seconds`` pass. Reported per API and concurrency: p50 and p99 latency, requests per second,
and the server's overhead: p50 at one client minus the in-process call's median (the same
example, the same loaded SavedModel); then the same with ``--enable_batching`` (parameters in
BATCHING) and the throughput at 32 clients against the unbatched server's. Bounded in count
and time; loopback only.

    python tools/bench_serve.py [--requests 300] [--seconds 15] [--json docs/results/bench_serve.json]
"""
from __future__ import annotations

import argparse
import http.client
import json
import os
import re
import select
import signal
import statistics
import subprocess
import sys
import tempfile
import threading
import time

import benchlib  # noqa: F401  (quiet TensorFlow, repository importable)

import numpy as np

CLIENTS = (1, 8, 32)


BATCHING = ("max_batch_size { value: 32 }\nbatch_timeout_micros { value: 1000 }\nnum_batch_threads { value: 2 }\n"
            "max_enqueued_batches { value: 100 }\n")


def start_server(base: str, log_path: str, extra=()):
    proc = subprocess.Popen([sys.executable, "-m", "vfgraph.cli", "serve", base, "--model-name", "digits",
                             "--rest-port", "0", "--grpc-port", "0", "--host", "127.0.0.1", "--threads", "8", *extra],
                            stdout=subprocess.PIPE, stderr=open(log_path, "w"), text=True)
    ready, _, _ = select.select([proc.stdout], [], [], 300)
    line = proc.stdout.readline() if ready else ""
    m = re.search(r"REST on http://127\.0\.0\.1:(\d+), gRPC on 127\.0\.0\.1:(\d+)", line)
    if not m:
        proc.kill()
        raise SystemExit(f"the server did not start: {line!r}; see {log_path}")
    return proc, int(m.group(1)), int(m.group(2))


def in_process(path: str, x: np.ndarray, calls: int) -> dict:
    import tensorflow as tf

    fn = tf.saved_model.load(path).signatures["serving_default"]
    t = tf.constant(x)
    for _ in range(20):
        fn(x=t)
    times = []
    for _ in range(calls):
        started = time.perf_counter()
        fn(x=t)["logits"].numpy()
        times.append(time.perf_counter() - started)
    return {"p50_ms": statistics.median(times) * 1e3, "p99_ms": float(np.percentile(times, 99)) * 1e3}


def rest_client(port: int, x: np.ndarray):
    body = json.dumps({"instances": x.tolist()}).encode()

    def make():
        conn = http.client.HTTPConnection("127.0.0.1", port, timeout=60)

        def call():
            conn.request("POST", "/v1/models/digits:predict", body, {"Content-Type": "application/json"})
            r = conn.getresponse()
            data = r.read()
            if r.status != 200:
                raise RuntimeError(f"HTTP {r.status}: {data[:200]!r}")
        return call
    return make


def grpc_client(port: int, x: np.ndarray):
    import grpc
    import tensorflow as tf
    from tensorflow_serving.apis import predict_pb2, prediction_service_pb2_grpc

    stub = prediction_service_pb2_grpc.PredictionServiceStub(grpc.insecure_channel(f"127.0.0.1:{port}"))
    req = predict_pb2.PredictRequest()
    req.model_spec.name = "digits"
    req.inputs["x"].CopyFrom(tf.make_tensor_proto(x))

    def make():
        return lambda: stub.Predict(req, timeout=60)
    return make


def load(make, clients: int, requests: int, seconds: float) -> dict:
    """``clients`` threads calling until ``requests`` are answered or ``seconds`` pass."""
    lock, times, errors, issued = threading.Lock(), [], [], [0]
    deadline = time.monotonic() + seconds
    calls = [make() for _ in range(clients)]
    for call in calls:  # one untimed call each (connections made)
        call()

    def run(call):
        while time.monotonic() < deadline:
            with lock:
                if issued[0] >= requests:
                    return
                issued[0] += 1
            started = time.perf_counter()
            try:
                call()
            except Exception as e:  # noqa: BLE001 (counted and reported)
                with lock:
                    errors.append(repr(e)[:200])
                continue
            with lock:
                times.append(time.perf_counter() - started)

    threads = [threading.Thread(target=run, args=(c,)) for c in calls]
    started = time.perf_counter()
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    wall = time.perf_counter() - started
    return {"clients": clients, "requests": len(times), "errors": len(errors), "first_error": errors[:1],
            "p50_ms": statistics.median(times) * 1e3, "p99_ms": float(np.percentile(times, 99)) * 1e3,
            "per_second": len(times) / wall}


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--requests", type=int, default=300, help="requests per API and concurrency (default 300)")
    p.add_argument("--seconds", type=float, default=15.0, help="time bound per API and concurrency (default 15)")
    p.add_argument("--json", help="write the report here (e.g. docs/results/bench_serve.json)")
    args = p.parse_args()
    import export  # examples/export.py
    import vfgraph

    with tempfile.TemporaryDirectory(prefix="bench-serve-") as tmp:
        export.digits_cnn(os.path.join(tmp, "cnn"))
        base = os.path.join(tmp, "base")
        vfgraph.export(os.path.join(tmp, "cnn"), base, version=1, vnode_batch=32)
        x = np.random.default_rng(0).normal(size=(1, 64)).astype(np.float32)
        baseline = in_process(os.path.join(base, "1"), x, 300)
        with open(os.path.join(tmp, "batching.txt"), "w") as f:
            f.write(BATCHING)
        results, codes = {}, []
        for label, extra in (("", ()), (" batched", ("--enable_batching", "--batching_parameters_file",
                                                     os.path.join(tmp, "batching.txt")))):
            proc, rest_port, grpc_port = start_server(base, os.path.join(tmp, "server.log"), extra)
            try:
                for api, make in (("REST", rest_client(rest_port, x)), ("gRPC", grpc_client(grpc_port, x))):
                    results[api + label] = [load(make, c, args.requests, args.seconds) for c in CLIENTS]
            finally:
                proc.send_signal(signal.SIGTERM)
                codes.append(proc.wait(timeout=120))
        code = max(codes)
    report = {"config": {"model": "digits CNN (examples/export.py), vfgraph export --vnode-batch 32",
                         "request": "1 example", "clients": list(CLIENTS), "requests": args.requests,
                         "seconds": args.seconds, "server_threads": 8, "cpus": os.cpu_count()},
              "in_process": baseline, "results": results, "server_exit": code,
              "overhead_ms": {api: results[api][0]["p50_ms"] - baseline["p50_ms"] for api in ("REST", "gRPC")},
              "batching": {"parameters": BATCHING, "throughput_ratio_at_32": {
                  api: results[api + " batched"][-1]["per_second"] / results[api][-1]["per_second"]
                  for api in ("REST", "gRPC")}},
              "git": benchlib.git_state()}
    print(f"in-process signature call: p50 {baseline['p50_ms']:.2f} ms, p99 {baseline['p99_ms']:.2f} ms")
    print(f"{'API':5} {'clients':>7} {'requests':>8} {'errors':>6} {'p50 ms':>8} {'p99 ms':>8} {'req/s':>8}")
    for api, rows in results.items():
        for r in rows:
            print(f"{api:5} {r['clients']:7d} {r['requests']:8d} {r['errors']:6d} {r['p50_ms']:8.2f} "
                  f"{r['p99_ms']:8.2f} {r['per_second']:8.1f}")
    for api, ms in report["overhead_ms"].items():
        print(f"server overhead, {api}: {ms:.2f} ms per request (p50 at 1 client - in-process p50)")
    for api, ratio in report["batching"]["throughput_ratio_at_32"].items():
        print(f"batching, {api}: {ratio:.2f}x the requests/s at 32 clients")
    if args.json:
        benchlib.write_report(args.json, report)
    return 0 if code == 0 and not any(r["errors"] for rows in results.values() for r in rows) else 1


if __name__ == "__main__":
    sys.exit(main())
