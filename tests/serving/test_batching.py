"""`vfgraph serve --enable_batching`: concurrent requests merged into batches and split back,
TF Serving's batching parameters file, and a full queue answered at once with TF Serving's
UNAVAILABLE (TensorFlow's batching_util/shared_batch_scheduler.h words it "The batch
scheduling queue to which this task was submitted is full"; http_server.cc maps UNAVAILABLE to
HTTP 503)."""
import re
import subprocess
import sys
import threading
import time
import urllib.request

import numpy as np
import pytest

from vfgraph.testing.cli import ENV

pytest.importorskip("tensorflow_serving.apis", reason="pip install --no-deps -r serve-requirements.txt")
pytest.importorskip("aiohttp")

from test_serve import Server  # noqa: E402  (tests/serving, beside this file)

FULL = "The batch scheduling queue to which this task was submitted is full"


def doubling(path):
    """y = 2x, and a slow signature of the same (it spins n times, the largest n of the batch)."""
    import tensorflow as tf

    class Doubling(tf.Module):
        @tf.function(input_signature=[tf.TensorSpec([None], tf.float32, name="x")])
        def serve(self, x):
            return {"y": 2.0 * x}

        @tf.function(input_signature=[tf.TensorSpec([None], tf.float32, name="x"),
                                      tf.TensorSpec([None], tf.int32, name="n")])
        def slow(self, x, n):
            spun = tf.while_loop(lambda i: i < tf.reduce_max(n), lambda i: i + 1, [tf.constant(0)])[0]
            return {"y": 2.0 * x + 0.0 * tf.cast(spun, tf.float32)}

    m = Doubling()
    tf.saved_model.save(m, str(path), signatures={"serving_default": m.serve, "slow": m.slow})


def test_batching_parameters_file_mistakes(tmp_path):
    from vfgraph.testing.cli import one_error

    cases = [("max_batch_size { value: 32 }\nallowed_batch_sizes: 8\n", ["final entry in allowed_batch_sizes (8)"]),
             ("max_batch_size { value: 8 }\nbatch_timeout: 3\n", ["unknown field 'batch_timeout'"]),
             ("max_batch_size { value: eight }\n", ["max_batch_size: 'eight' is not a whole number"]),
             ("allowed_batch_sizes: 4 allowed_batch_sizes: 2 max_batch_size { value: 2 }", ["monotonically increasing"]),
             ("num_batch_threads { value: 0 }", ["num_batch_threads 0: give at least 1"])]
    runs = []
    for k, (text, _) in enumerate(cases):
        (tmp_path / f"{k}.txt").write_text(text)
        runs.append(subprocess.Popen([sys.executable, "-m", "vfgraph.cli", "serve", str(tmp_path), "--enable_batching",
                                      "--batching_parameters_file", str(tmp_path / f"{k}.txt")], env=ENV, text=True,
                                     stdout=subprocess.PIPE, stderr=subprocess.PIPE))
    runs.append(subprocess.Popen([sys.executable, "-m", "vfgraph.cli", "serve", str(tmp_path),
                                  "--batching-parameters-file", str(tmp_path / "0.txt")], env=ENV, text=True,
                                 stdout=subprocess.PIPE, stderr=subprocess.PIPE))
    for run, needles in zip(runs, [n for _, n in cases] + [["add --enable-batching"]]):
        out, err = run.communicate(timeout=120)
        one_error(run.returncode, subprocess.CompletedProcess(run.args, run.returncode, out, err), *needles)


@pytest.fixture(scope="module")
def batching(tmp_path_factory):
    base = tmp_path_factory.mktemp("batching") / "doubling"
    doubling(base / "1")
    params = base.parent / "batching.txt"
    params.write_text("# TF Serving's text format\nmax_batch_size { value: 8 }\nbatch_timeout_micros { value: 200000 }\n"
                      "max_enqueued_batches { value: 2 }\nnum_batch_threads { value: 1 }\nallowed_batch_sizes: 4\n"
                      "allowed_batch_sizes: 8\n")
    server = Server(base, "doubling", base.parent / "doubling.log",
                    extra=("--enable_batching", "--batching_parameters_file", str(params)))
    yield server
    assert server.stop() == 0, server.log()


def _concurrently(server, bodies):
    answers = [None] * len(bodies)

    def one(k):
        answers[k] = server.call("/v1/models/doubling:predict", bodies[k])

    threads = [threading.Thread(target=one, args=(k,)) for k in range(len(bodies))]
    for t in threads:
        t.start()
    for t in threads:
        t.join(timeout=120)
    return answers


def _batches(server):
    with urllib.request.urlopen(server.url("/monitoring/prometheus/metrics"), timeout=60) as r:
        page = r.read().decode()
    count = re.search(r"^vfgraph_serve_batch_size_count (\S+)$", page, re.M)
    total = re.search(r"^vfgraph_serve_batch_size_sum (\S+)$", page, re.M)
    return float(count.group(1)), float(total.group(1))


def test_concurrent_requests_are_merged_and_split_back(batching):
    assert "batching up to 8 rows, 200000 us, 1 thread(s)" in batching.ready
    bodies = [{"instances": [float(k), float(k) + 0.5]} for k in range(12)]
    answers = _concurrently(batching, bodies)
    assert answers == [(200, {"predictions": [2.0 * k, 2.0 * k + 1.0]}) for k in range(12)]
    batches, rows = _batches(batching)
    assert batches < 12, (batches, rows)  # merged: fewer model calls than requests
    assert rows % 4 == 0 and rows >= 24, rows  # padded to the allowed sizes, 4 or 8 rows
    # a request larger than max_batch_size runs alone, whole (a micro-batched model slices it itself)
    status, out = batching.call("/v1/models/doubling:predict", {"inputs": [1.0] * 20})
    assert (status, out) == (200, {"outputs": [2.0] * 20})
    assert _batches(batching)[0] == batches


def test_a_full_queue_is_unavailable_at_once(batching):
    started = time.monotonic()  # (a batch waits up to 0.2 s for more requests before it runs)
    assert batching.call("/v1/models/doubling:predict", {"signature_name": "slow", "instances": [{"x": 1.0, "n": 20000}]}) \
        == (200, {"predictions": [2.0]})
    n = int(min(max(20000 * 1.5 / max(time.monotonic() - started - 0.2, 1e-3), 20000), 20_000_000))  # ~1.5 s
    bodies = [{"signature_name": "slow", "instances": [{"x": float(k), "n": n}]} for k in range(32)]
    answers = _concurrently(batching, bodies)
    full = [a for a in answers if a[0] == 503]
    assert full and all(a == (503, {"error": FULL}) for a in full), answers
    ok = [(k, a) for k, a in enumerate(answers) if a[0] == 200]
    assert ok and all(a == (200, {"predictions": [2.0 * k]}) for k, a in ok), answers
    assert batching.call("/v1/models/doubling:predict", {"instances": [3.0]}) == (200, {"predictions": [6.0]})
