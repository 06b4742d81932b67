"""`vfgraph serve` as a client written for TF Serving meets it: the real server in a process of
its own on free loopback ports, plain HTTP (urllib) and the gRPC stubs of
tensorflow-serving-api.

Expected answers are TF Serving's, quoted from its repository (tensorflow/serving):
- g3doc/api_rest.md (the REST API's documentation): its worked example with the
  half_plus_three model (status of version 123, ``{"instances": [1.0,2.0,5.0]}`` ->
  ``{"predictions": [3.5, 4.0, 5.5]}``, ``POST /v1/models/half:predict`` -> 404
  ``Servable not found for request: Latest(half)``) and its b64 example values;
- model_servers/tensorflow_model_server_test.py (testPredictColumnarREST: ``inputs`` ->
  ``outputs``) and servables/tensorflow/testdata/half_plus_two_model_metadata.json (the
  metadata's JSON layout);
- the messages, from the code that words them: model_servers/http_rest_api_handler.cc and
  http_rest_api_util.cc (malformed request, GetInfoMap's signature look-up),
  util/json_tensor.cc (request bodies), core/basic_manager.cc (servable not found),
  model_servers/get_model_status_impl.cc (versions not found), servables/tensorflow/
  predict_util.cc (inputs that do not match), classifier.cc (classify on another signature),
  and the HTTP status of each code, model_servers/http_server.cc's ToHTTPStatusCode.
"""
import base64
import json
import os
import re
import select
import shutil
import signal
import subprocess
import sys
import threading
import time
import urllib.error
import urllib.request

import numpy as np
import pytest

from vfgraph.testing.cli import ENV

pytest.importorskip("tensorflow_serving.apis", reason="pip install --no-deps -r serve-requirements.txt")
pytest.importorskip("aiohttp")

POLL = 0.5  # --file-system-poll-wait-seconds of the servers here


class Server:
    """``vfgraph serve BASE`` in a process of its own on free loopback ports (``wait=False``:
    started, ready once :meth:`wait` returns)."""

    def __init__(self, base, name, log_path, poll=POLL, extra=(), wait=True):
        self.name, self.log_path = name, str(log_path)
        self.proc = subprocess.Popen(
            [sys.executable, "-m", "vfgraph.cli", "serve", str(base), "--model-name", name, "--rest-port", "0",
             "--grpc-port", "0", "--host", "127.0.0.1", "--file-system-poll-wait-seconds", str(poll), *extra],
            stdout=subprocess.PIPE, stderr=open(self.log_path, "w"), text=True, env=ENV)
        if wait:
            self.wait()

    def wait(self) -> "Server":
        if not hasattr(self, "ready"):
            self.ready = self._line(timeout=180)
            m = re.search(r"REST on http://127\.0\.0\.1:(\d+), gRPC on 127\.0\.0\.1:(\d+)", self.ready)
            assert m, (self.ready, self.log())
            self.rest_port, self.grpc_port = int(m.group(1)), int(m.group(2))
        return self

    def _line(self, timeout):
        ready, _, _ = select.select([self.proc.stdout], [], [], timeout)
        assert ready, f"no ready line after {timeout}s: {self.log()}"
        return self.proc.stdout.readline()

    def log(self) -> str:
        with open(self.log_path) as f:
            return f.read()

    def url(self, path):
        return f"http://127.0.0.1:{self.rest_port}{path}"

    def call(self, path, body=None, method=None):
        """(HTTP status, JSON answer) of a request; ``body``: an object sent as JSON, or bytes."""
        data = body if body is None or isinstance(body, bytes) else json.dumps(body).encode()
        req = urllib.request.Request(self.url(path), data=data, method=method)
        try:
            with urllib.request.urlopen(req, timeout=120) as r:
                return r.status, json.loads(r.read())
        except urllib.error.HTTPError as e:
            assert e.headers["Content-Type"] == "application/json", e.headers
            return e.code, json.loads(e.read())

    def stub(self, which="prediction"):
        import grpc
        from tensorflow_serving.apis import model_service_pb2_grpc, prediction_service_pb2_grpc

        channel = grpc.insecure_channel(f"127.0.0.1:{self.grpc_port}")
        return (prediction_service_pb2_grpc.PredictionServiceStub(channel) if which == "prediction"
                else model_service_pb2_grpc.ModelServiceStub(channel))

    def stop(self) -> int:
        if self.proc.poll() is None:
            self.proc.send_signal(signal.SIGTERM)
        return self.proc.wait(timeout=120)


def half_plus_three(path):
    """TF Serving's example model (y = x / 2 + 3, api_rest.md), with a signature of strings
    (bytes in, their length and the bytes out) and one that spins n times (a slow request)."""
    import tensorflow as tf

    class HalfPlusThree(tf.Module):
        @tf.function(input_signature=[tf.TensorSpec([None], tf.float32, name="x")])
        def serve(self, x):
            return {"y": 0.5 * x + 3.0}

        @tf.function(input_signature=[tf.TensorSpec([None], tf.string, name="text")])
        def strings(self, text):
            return {"length": tf.strings.length(text), "echo_bytes": text}

        @tf.function(input_signature=[tf.TensorSpec([], tf.int32, name="n")])
        def spin(self, n):
            return {"count": tf.while_loop(lambda i: i < n, lambda i: i + 1, [tf.constant(0)])[0]}

    m = HalfPlusThree()
    tf.saved_model.save(m, str(path), signatures={"serving_default": m.serve, "strings": m.strings, "spin": m.spin})


def write_warm_up(version_dir, inputs):
    """TF Serving's warm-up file in a version: one PredictionLog of a predict request with ``inputs``."""
    import tensorflow as tf
    from tensorflow_serving.apis import predict_pb2, prediction_log_pb2

    req = predict_pb2.PredictRequest()
    for name, value in inputs.items():
        req.inputs[name].CopyFrom(tf.make_tensor_proto(value))
    entry = prediction_log_pb2.PredictionLog(predict_log=prediction_log_pb2.PredictLog(request=req))
    os.makedirs(os.path.join(version_dir, "assets.extra"), exist_ok=True)
    with tf.io.TFRecordWriter(os.path.join(version_dir, "assets.extra", "tf_serving_warmup_requests")) as w:
        w.write(entry.SerializeToString())


@pytest.fixture(scope="module")
def servers(tmp_path_factory, models):
    """TF Serving's example model and the digits MLP's export, each served by a process of its
    own, started side by side."""
    import vfgraph

    root = tmp_path_factory.mktemp("serve")
    half_base, digits_base = root / "half_plus_three", root / "digits"
    half_plus_three(half_base / "00000123")  # TF Serving reads version 123 from it, as in its testdata
    write_warm_up(half_base / "00000123", {"x": np.array([1.0, 2.0], np.float32)})
    half_server = Server(half_base, "half_plus_three", root / "half.log", wait=False)
    vfgraph.export(models("mlp"), str(digits_base), version=1, vnode_batch=8)
    digits_server = Server(digits_base, "digits", root / "digits.log", wait=False)
    yield {"half": half_server, "digits": (digits_server, digits_base)}
    for server in (half_server, digits_server):
        assert server.stop() == 0, server.log()


@pytest.fixture(scope="module")
def half(servers):
    return servers["half"].wait()


@pytest.fixture(scope="module")
def digits(servers):
    server, base = servers["digits"]
    return server.wait(), base


# ---- user mistakes: one line, exit 2, before any model loads -------------------------------

def test_mistakes_are_one_line(tmp_path, capsys):
    import socket

    from vfgraph.testing.cli import one_error, run_in_process

    (tmp_path / "model").mkdir()
    (tmp_path / "model" / "saved_model.pb").write_bytes(b"")
    with socket.socket() as busy:
        busy.bind(("127.0.0.1", 0))
        busy.listen()
        port = busy.getsockname()[1]
        for args, needles in [
                ([tmp_path / "nope"], ["does not exist", "base directory of the model's versions"]),
                ([tmp_path / "model"], ["is a SavedModel, not a base directory", "vfgraph export"]),
                ([], ["give the model's base directory"]),
                ([tmp_path, "--model_base_path", tmp_path], ["give the model's base directory once"]),
                ([tmp_path, "--rest-port", "8600", "--port", "8600"], ["both 8600"]),
                ([tmp_path, "--rest_api_port", "70000"], ["--rest-port 70000", "give a TCP port"]),
                ([tmp_path, "--model_name", "a/b"], ["--model-name 'a/b'"]),
                ([tmp_path, "--host", "127.0.0.1", "--rest-port", port], [f"--rest-port {port}", "give a free port"])]:
            one_error(*run_in_process(capsys, "serve", *args), *needles)


def test_missing_libraries_are_one_line(tmp_path, capsys, monkeypatch):
    from vfgraph.testing.cli import one_error, run_in_process

    monkeypatch.setitem(sys.modules, "tensorflow_serving", None)  # (as if not installed)
    one_error(*run_in_process(capsys, "serve", tmp_path), "needs tensorflow-serving-api", "serve-requirements.txt")


# ---- REST: TF Serving's documented examples ----------------------------------------------

def test_rest_status_and_predict_as_tf_serving_documents(half):
    # api_rest.md, "Make REST API calls to ModelServer"
    assert half.call("/v1/models/half_plus_three") == (200, {"model_version_status": [
        {"version": "123", "state": "AVAILABLE", "status": {"error_code": "OK", "error_message": ""}}]})
    assert "serving model 'half_plus_three' version 123 (" in half.log()
    assert "1 warm-up request(s)" in half.log()  # assets.extra/tf_serving_warmup_requests, run first
    assert half.call("/v1/models/half_plus_three:predict", {"instances": [1.0, 2.0, 5.0]}) == \
        (200, {"predictions": [3.5, 4.0, 5.5]})
    assert half.call("/v1/models/half:predict", {"instances": [1.0, 5.0]}) == \
        (404, {"error": "Servable not found for request: Latest(half)"})
    # tensorflow_model_server_test.py, testPredictColumnarREST (its model is y = x / 2 + 2)
    assert half.call("/v1/models/half_plus_three:predict", {"inputs": [2.0, 3.0, 4.0]}) == \
        (200, {"outputs": [4.0, 4.5, 5.0]})
    # the version in the path, and the answer's bytes as json_tensor.cc's WriteDecimal writes floats:
    # six digits where they read back the same, else full precision, whole numbers with ".0"
    req = urllib.request.Request(half.url("/v1/models/half_plus_three/versions/123:predict"),
                                 data=b'{"instances": [2, 0.25, 3e7]}')
    with urllib.request.urlopen(req, timeout=60) as r:
        assert r.headers["Content-Type"] == "application/json"
        assert r.read() == b'{"predictions": [4.0, 3.125, 15000003.0]}'


def test_rest_metadata_as_tf_serving_writes_it(half):
    # the layout of testdata/half_plus_two_model_metadata.json: the model spec, then the
    # SignatureDefMap with the protos' field names and every field printed
    status, meta = half.call("/v1/models/half_plus_three/versions/123/metadata")
    assert status == 200, meta
    assert meta["model_spec"] == {"name": "half_plus_three", "signature_name": "", "version": "123"}
    sigs = meta["metadata"]["signature_def"]["signature_def"]
    assert sigs["serving_default"]["outputs"]["y"].pop("name").endswith("PartitionedCall:0")
    assert sigs["serving_default"] == {
        "inputs": {"x": {"dtype": "DT_FLOAT", "tensor_shape": {"dim": [{"size": "-1", "name": ""}],
                                                               "unknown_rank": False},
                         "name": "serving_default_x:0"}},
        "outputs": {"y": {"dtype": "DT_FLOAT", "tensor_shape": {"dim": [{"size": "-1", "name": ""}],
                                                                "unknown_rank": False}}},
        "method_name": "tensorflow/serving/predict", "defaults": {}}
    assert set(sigs) == {"serving_default", "strings", "spin", "__saved_model_init_op"}


def test_rest_binary_values_and_several_outputs(half):
    # api_rest.md, "Encoding binary values": {"b64": ...} in; outputs named *_bytes go out so
    image, mountains = "aW1hZ2UgYnl0ZXM=", "YXdlc29tZSBpbWFnZSBieXRlcw=="
    status, out = half.call("/v1/models/half_plus_three:predict", {
        "signature_name": "strings", "instances": [{"b64": image}, "seaside", {"b64": mountains}]})
    assert status == 200, out
    assert out == {"predictions": [{"echo_bytes": {"b64": image}, "length": 11},
                                   {"echo_bytes": {"b64": base64.b64encode(b"seaside").decode()}, "length": 7},
                                   {"echo_bytes": {"b64": mountains}, "length": 19}]}
    status, out = half.call("/v1/models/half_plus_three:predict", {"signature_name": "strings",
                                                                    "inputs": {"text": ["ab", "c"]}})
    assert (status, out) == (200, {"outputs": {"echo_bytes": [{"b64": "YWI="}, {"b64": "Yw=="}], "length": [2, 1]}})


ERRORS = [  # (method, path, body, HTTP status, TF Serving's message)
    # http_rest_api_handler.cc, ProcessRequest: a path its regexes do not match
    ("GET", "/v1/models/half_plus_three:predict", None, 400,
     "Malformed request: GET /v1/models/half_plus_three:predict"),
    ("POST", "/v1/models/half_plus_three", b"{}", 400, "Malformed request: POST /v1/models/half_plus_three"),
    # http_rest_api_handler.cc, ProcessModelStatusRequest
    ("GET", "/v1/models", None, 400, "Missing model name in request."),
    # get_model_status_impl.cc
    ("GET", "/v1/models/nope", None, 404, "Could not find any versions of model nope"),
    ("GET", "/v1/models/half_plus_three/versions/7", None, 404, "Could not find version 7 of model half_plus_three"),
    # basic_manager.cc with manager.h's ServableRequest::DebugString
    ("POST", "/v1/models/half_plus_three/versions/7:predict", {"instances": [1.0]}, 404,
     "Servable not found for request: Specific(half_plus_three, 7)"),
    ("GET", "/v1/models/half_plus_three/versions/7/metadata", None, 404,
     "Servable not found for request: Specific(half_plus_three, 7)"),
    # json_tensor.cc: ParseJson, FillPredictRequestFromJson, FillTensorMapFromInstancesList
    ("POST", "/v1/models/half_plus_three:predict", b"", 400, "JSON Parse error: The document is empty"),
    ("POST", "/v1/models/half_plus_three:predict", {"instance": [1.0]}, 400, "Missing 'inputs' or 'instances' key"),
    ("POST", "/v1/models/half_plus_three:predict", {"instances": [1.0], "inputs": [1.0]}, 400,
     "JSON Value: {\n    \"instances\": [1.0],\n    \"inputs\": [1.0]\n} Not formatted correctly expecting only one "
     "of 'inputs' or 'instances' keys to exist "),
    ("POST", "/v1/models/half_plus_three:predict", {"instances": ["a"]}, 400,
     "Failed to process element: 0 of 'instances' list. Error: INVALID_ARGUMENT: JSON Value: \"a\" Type: String "
     "is not of expected type: float"),
    ("POST", "/v1/models/half_plus_three:predict", {"instances": [1.0, [2.0]]}, 400,
     "Failed to process element: 1 of 'instances' list. Error: INVALID_ARGUMENT: Expecting shape [] but got: [1]"),
    ("POST", "/v1/models/half_plus_three:predict", {"signature_name": "strings", "instances": [{"b64": "%%"}]},
     400, "Failed to process element: 0 of 'instances' list. Error: INVALID_ARGUMENT: Unable to base64 decode"),
    # http_rest_api_handler.cc, GetInfoMap
    ("POST", "/v1/models/half_plus_three:predict", {"signature_name": "nope", "instances": [1.0]}, 400,
     'Serving signature name: "nope" not found in signature def'),
    # classifier.cc, a classify request on a predict signature
    ("POST", "/v1/models/half_plus_three:classify", {"examples": [{"x": 1.0}]}, 400,
     "Expected classification signature method_name to be tensorflow/serving/classify. Was: "
     "tensorflow/serving/predict"),
]


def test_rest_errors_with_tf_serving_statuses_and_messages(half):
    for method, path, body, status, message in ERRORS:
        assert half.call(path, body, method=method) == (status, {"error": message}), (method, path, body)
    # none of them stopped the server, and each has its line in the access log
    assert half.call("/v1/models/half_plus_three:predict", {"instances": [1.0]}) == (200, {"predictions": [3.5]})
    log = half.log()
    assert "REST GET /v1/models/nope model=nope version=- status=404" in log
    # and in the metrics, under TF Serving's names (Prometheus' client adds _total to counters)
    with urllib.request.urlopen(half.url("/monitoring/prometheus/metrics"), timeout=60) as r:
        page = r.read().decode()
    assert ':tensorflow:serving:request_count_total{model_name="nope",status="NOT_FOUND"} 1.0' in page, page
    assert re.search(r':tensorflow:serving:request_latency_count\{API="predict",entrypoint="REST",'
                     r'model_name="half_plus_three"\} [1-9]', page), page
    assert re.search(r"REST POST /v1/models/half_plus_three:predict model=half_plus_three version=123 status=200 "
                     r"\d+\.\dms", log), log


# ---- gRPC, and the digits model through both APIs ----------------------------------------

def _predict_request(name, x, version=None, signature=""):
    import tensorflow as tf
    from tensorflow_serving.apis import predict_pb2

    req = predict_pb2.PredictRequest()
    req.model_spec.name = name
    req.model_spec.signature_name = signature
    if version is not None:
        req.model_spec.version.value = version
    req.inputs["x"].CopyFrom(tf.make_tensor_proto(x))
    return req


def test_grpc_and_rest_answer_as_the_loaded_signature(digits):
    import grpc
    import tensorflow as tf
    from tensorflow_serving.apis import get_model_metadata_pb2, get_model_status_pb2

    server, base = digits
    assert "version 1 (" in server.log() and "micro-batched: serving_default in slices of 8" in server.log()
    x = np.random.default_rng(0).normal(size=(20, 64)).astype(np.float32)  # 3 slices of 8 in the model's loop
    want = tf.saved_model.load(str(base / "1")).signatures["serving_default"](x=tf.constant(x))["logits"].numpy()
    stub = server.stub()
    res = stub.Predict(_predict_request("digits", x), timeout=60)
    assert (res.model_spec.name, res.model_spec.version.value, res.model_spec.signature_name) == \
        ("digits", 1, "serving_default")
    np.testing.assert_array_equal(tf.make_ndarray(res.outputs["logits"]), want)
    status, out = server.call("/v1/models/digits:predict", {"instances": x.tolist()})
    assert status == 200, out
    np.testing.assert_allclose(np.array(out["predictions"], np.float32), want, rtol=1e-6, atol=1e-7)
    # a request of 5 MB (over gRPC's default limit of 4 MiB, which TF Serving lifts too), 2,500 slices of 8
    big = np.random.default_rng(1).normal(size=(20000, 64)).astype(np.float32)
    res = stub.Predict(_predict_request("digits", big), timeout=120)
    want = tf.saved_model.load(str(base / "1")).signatures["serving_default"](x=tf.constant(big))["logits"].numpy()
    np.testing.assert_array_equal(tf.make_ndarray(res.outputs["logits"]), want)

    meta = stub.GetModelMetadata(get_model_metadata_pb2.GetModelMetadataRequest(
        model_spec={"name": "digits"}, metadata_field=["signature_def"]), timeout=60)
    sigs = get_model_metadata_pb2.SignatureDefMap()
    meta.metadata["signature_def"].Unpack(sigs)
    assert meta.model_spec.version.value == 1 and "serving_default" in sigs.signature_def
    st = server.stub("model").GetModelStatus(get_model_status_pb2.GetModelStatusRequest(model_spec={"name": "digits"}),
                                             timeout=60)
    assert [(v.version, v.state, v.status.error_code) for v in st.model_version_status] == [(1, 30, 0)]  # AVAILABLE

    wrong = _predict_request("digits", x)
    wrong.inputs["y"].CopyFrom(wrong.inputs.pop("x"))
    for req, code, message in [
            (_predict_request("nope", x), grpc.StatusCode.NOT_FOUND, "Servable not found for request: Latest(nope)"),
            (_predict_request("digits", x, version=9), grpc.StatusCode.NOT_FOUND,
             "Servable not found for request: Specific(digits, 9)"),
            (_predict_request("digits", x, signature="nope"), grpc.StatusCode.FAILED_PRECONDITION,
             'Serving signature key "nope" not found.'),  # predict_util.cc, RunPredict
            (wrong, grpc.StatusCode.INVALID_ARGUMENT,  # predict_util.cc, VerifyRequestInputsSize
             "input size does not match signature: 1!=1 len({y}) != len({x}). Sent extra: {y}. Missing but "
             "required: {x}."),
            (_predict_request("digits", x.astype(np.float64)), grpc.StatusCode.INVALID_ARGUMENT,
             "input x: expects float32 but float64 is provided"),
            (_predict_request("digits", x[:, :8]), grpc.StatusCode.INVALID_ARGUMENT,
             "input x: shape [20,8] given, the signature takes [?,64]")]:
        with pytest.raises(grpc.RpcError) as e:
            stub.Predict(req, timeout=60)
        assert (e.value.code(), e.value.details()) == (code, message)
    from tensorflow_serving.apis import classification_pb2, regression_pb2

    with pytest.raises(grpc.RpcError) as e:  # classifier.cc, a classify request on a predict signature
        stub.Classify(classification_pb2.ClassificationRequest(model_spec={"name": "digits"}), timeout=60)
    assert (e.value.code(), e.value.details()) == (grpc.StatusCode.INVALID_ARGUMENT, (
        "Expected classification signature method_name to be tensorflow/serving/classify. Was: "
        "tensorflow/serving/predict"))
    with pytest.raises(grpc.RpcError) as e:  # regressor.cc, a signature that is not there
        stub.Regress(regression_pb2.RegressionRequest(model_spec={"name": "digits", "signature_name": "r"}),
                     timeout=60)
    assert (e.value.code(), e.value.details()) == (grpc.StatusCode.INVALID_ARGUMENT,
                                                   "No signature was found with the name: r")
    with pytest.raises(grpc.RpcError) as e:  # get_model_metadata_impl.cc
        stub.GetModelMetadata(get_model_metadata_pb2.GetModelMetadataRequest(model_spec={"name": "digits"}))
    assert (e.value.code(), e.value.details()) == (grpc.StatusCode.INVALID_ARGUMENT,
                                                   "GetModelMetadataRequest must specify at least one metadata_field")


def wait_for_end(server, version, seconds=120):
    """Until the model's status says ``version`` ended (failed to load)."""
    deadline = time.monotonic() + seconds
    while time.monotonic() < deadline:
        status, out = server.call(f"/v1/models/digits/versions/{version}")
        if status == 200 and out["model_version_status"][0]["state"] == "END":
            return
        time.sleep(POLL / 2)
    raise AssertionError(f"version {version} did not end: {server.log()}")


def test_new_version_is_served_without_a_failed_request(digits):
    """A client loop runs while version 2 is dropped into the base path (renamed into place, as
    an export writes it), then a version 3 that does not load and a version 4 whose warm-up
    request fails: no request fails, version 2 answers once loaded (picked up within 2 polls),
    version 1 is released, the errors of versions 3 and 4 are in the status and version 2 goes
    on."""
    from tensorflow_serving.apis import get_model_status_pb2

    server, base = digits
    x = np.ones((3, 64), np.float32)
    stub = server.stub()
    seen, errors, stop = [], [], threading.Event()

    def client():
        while not stop.is_set():
            try:
                seen.append((time.monotonic(), stub.Predict(_predict_request("digits", x), timeout=60)
                             .model_spec.version.value))
            except Exception as e:  # noqa: BLE001 (a failed request is what this test looks for)
                errors.append(repr(e))

    t = threading.Thread(target=client)
    t.start()
    try:
        time.sleep(0.5)
        shutil.copytree(base / "1", base / ".incoming")
        dropped = time.monotonic()
        os.rename(base / ".incoming", base / "2")
        deadline = time.monotonic() + 120
        while not (seen and seen[-1][1] == 2) and time.monotonic() < deadline and not errors:
            time.sleep(0.1)
        switched = time.monotonic()
        (base / "3").mkdir()
        (base / "3" / "saved_model.pb").write_bytes(b"not a SavedModel")
        wait_for_end(server, 3)
        shutil.copytree(base / "1", base / ".incoming")
        write_warm_up(base / ".incoming", {"y": x})
        os.rename(base / ".incoming", base / "4")
        wait_for_end(server, 4)
    finally:
        stop.set()
        t.join(timeout=60)
    assert not errors, errors[:3]
    versions = [v for _, v in seen]
    assert versions[0] == 1 and versions[-1] == 2 and versions == sorted(versions), versions
    loaded = float(re.search(r"version 2 \(.*, loaded in ([\d.]+)s\)", server.log()).group(1))
    assert switched - dropped <= 2 * POLL + loaded + 1.0, (switched - dropped, loaded)
    st = server.stub("model").GetModelStatus(get_model_status_pb2.GetModelStatusRequest(model_spec={"name": "digits"}),
                                             timeout=60)
    states = {v.version: (get_model_status_pb2.ModelVersionStatus.State.Name(v.state), v.status.error_code)
              for v in st.model_version_status}
    assert states[2] == ("AVAILABLE", 0) and states[1] == ("END", 0), states
    assert states[3][0] == "END" and states[3][1] != 0, states
    status, out = server.call("/v1/models/digits/versions/3")
    assert status == 200 and "saved_model.pb" not in out and out["model_version_status"][0]["status"]["error_message"]
    status, out = server.call("/v1/models/digits/versions/4")
    assert out["model_version_status"][0]["status"] == {
        "error_code": "INVALID_ARGUMENT", "error_message": f"warm-up record 0 of {base / '4'}/assets.extra/"
        "tf_serving_warmup_requests: input size does not match signature: 1!=1 len({y}) != len({x}). Sent extra: "
        "{y}. Missing but required: {x}."}, out
    assert stub.Predict(_predict_request("digits", x), timeout=60).model_spec.version.value == 2


# ---- last: stopping ------------------------------------------------------------------------

def test_sigterm_answers_the_request_in_flight(half):
    """(The last test of the module: it stops the server of TF Serving's example model.)"""
    server, answer = half, {}

    def spin(n):
        return server.call("/v1/models/half_plus_three:predict", {"signature_name": "spin", "inputs": n})

    started = time.monotonic()
    assert spin(20000) == (200, {"outputs": 20000})
    n = int(min(max(20000 * 3.0 / max(time.monotonic() - started, 1e-3), 20000), 20_000_000))  # about 3 s

    def slow():
        answer["reply"] = spin(n)
        answer["at"] = time.monotonic()

    t = threading.Thread(target=slow)
    t.start()
    time.sleep(0.5)
    sent = time.monotonic()
    code = server.stop()
    t.join(timeout=120)
    assert answer["reply"] == (200, {"outputs": n})
    assert code == 0, server.log()
    assert answer["at"] > sent, "the request ended before SIGTERM: nothing was drained"
    assert "stopping: answering the 1 request(s) in flight" in server.log()
