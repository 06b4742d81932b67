"""TF Serving's REST API (its api_rest.md) as an aiohttp application.

Paths as TF Serving's http_rest_api_util.cc matches them (case-insensitive):
``GET /v1/models/{name}[/versions/{v}|/labels/{l}][/metadata]`` and
``POST /v1/models/{name}[/versions/{v}|/labels/{l}]:(predict|classify|regress)``; any other
request under ``/v1/`` is "Malformed request", 400. Each answer is JSON; an error is
``{"error": message}`` with the HTTP status of its code (:mod:`.status`). The work of a
request (parsing, running the model, writing the answer) runs on the server's thread pool,
never on the event loop.
"""
from __future__ import annotations

import json
import re
import urllib.parse
from typing import Callable, Optional, Tuple

from vfgraph.serving import tensors
from vfgraph.serving.api import Models
from vfgraph.serving.status import ServingError, invalid

# http_rest_api_util.cc's kPredictionApiGegex and kModelStatusApiRegex
_POST = re.compile(r"/v1/models/([^/:]+)(?:(?:/versions/(\d+))|(?:/labels/([^/:]+)))?:(classify|regress|predict)",
                   re.IGNORECASE)
_GET = re.compile(r"/v1/models(?:/([^/:]+))?(?:(?:/versions/(\d+))|(?:/labels/([^/:]+)))?(?:/(metadata))?",
                  re.IGNORECASE)
_HEADERS = {"Content-Type": "application/json"}  # (http_rest_api_util.cc's AddHeaders)


class Answer:
    """A REST answer: HTTP status, JSON body, and what the access log and metrics say of it (the
    model, the version that answered, the API, the canonical status code)."""

    def __init__(self, status: int, body: str, model: str = "", version: Optional[int] = None, api: str = "",
                 code: str = "OK"):
        self.status, self.body, self.model, self.version, self.api, self.code = status, body, model, version, api, code


def handle(models: Models, method: str, path: str, body: bytes) -> Answer:
    """Answer one request under ``/v1/`` (``path``: the raw path, without the query)."""
    model, api = "", ""
    try:
        model, version, label, verb, sub = _parse(method, path)
        api = verb or sub or "status"
        if label is not None and not (method == "GET" and sub is None):
            raise invalid(f"Unrecognized servable version label: {label}")
        if method == "GET":
            if sub == "metadata":
                served, text = _metadata_json(models, model, version)
                return Answer(200, text, model, served, api)
            return Answer(200, _status_json(models, model, version), model, version, api)
        if verb == "predict":
            served, text = _predict(models, model, version, body)
            return Answer(200, text, model, served, api)
        _classify_or_regress(models, model, version, verb, body)  # (raises)
        raise invalid(f"Malformed request: {method} {path}")
    except ServingError as e:
        return Answer(e.http_status, _error_json(e.message), model, None, api, e.code)


def _parse(method: str, path: str) -> Tuple[str, Optional[int], Optional[str], str, Optional[str]]:
    """(model, version, label, verb, metadata) of a request path; "Malformed request" otherwise."""
    m = (_POST if method == "POST" else _GET if method == "GET" else None)
    match = m.fullmatch(path) if m else None
    if match is None:
        raise invalid(f"Malformed request: {method} {path}")
    if method == "POST":
        name, version, label, verb = match.groups()
        sub = None
    else:
        name, version, label, sub = match.groups()
        verb = ""
    name = urllib.parse.unquote(name or "")
    if not name:
        raise invalid("Missing model name in request.")
    label = urllib.parse.unquote(label) if label else None
    return name, int(version) if version is not None else None, label, verb.lower(), (sub or "").lower() or None


def _status_json(models: Models, name: str, version: Optional[int]) -> str:
    from google.protobuf import json_format

    msg = models.status(name, version)
    return json.dumps(json_format.MessageToDict(msg, always_print_fields_with_no_presence=True), indent=1)


def _metadata_json(models: Models, name: str, version: Optional[int]) -> Tuple[int, str]:
    """As http_rest_api_util.cc's ToJsonString: the model spec and the SignatureDefMap, with
    the protos' own field names."""
    from google.protobuf import json_format
    from tensorflow_serving.apis import get_model_metadata_pb2

    msg = models.metadata(name, version)
    sigs = get_model_metadata_pb2.SignatureDefMap()
    msg.metadata["signature_def"].Unpack(sigs)

    def as_dict(m):
        return json_format.MessageToDict(m, preserving_proto_field_name=True,
                                         always_print_fields_with_no_presence=True)

    text = json.dumps({"model_spec": as_dict(msg.model_spec), "metadata": {"signature_def": as_dict(sigs)}}, indent=1)
    return msg.model_spec.version.value, text


def _predict(models: Models, name: str, version: Optional[int], body: bytes) -> Tuple[int, str]:
    doc = tensors.parse_body(body)
    signature = tensors.signature_name(doc)
    dtypes = models.input_dtypes(name, version, signature)
    inputs, fmt = tensors.request_tensors(doc, dtypes, signature)
    served, outputs = models.predict(name, version, signature, inputs)
    return served, tensors.response_body(outputs, fmt)


def _classify_or_regress(models: Models, name: str, version: Optional[int], verb: str, body: bytes):
    doc = tensors.parse_body(body)
    models.classify_or_regress(name, version, tensors.signature_name(doc), verb)


def _error_json(message: str) -> str:
    return json.dumps({"error": message}, indent=1)


def make_app(models: Models, run: Callable, requests):
    """The aiohttp application: ``/v1/`` answered by :func:`handle` on ``run`` (an awaitable
    running a function on the server's threads), TF Serving's metrics path by ``requests``
    (:class:`~vfgraph.serving.metrics.Requests`), which also records each request."""
    import time

    from aiohttp import web

    from vfgraph.serving.metrics import PATH

    async def v1(request: web.Request) -> web.Response:
        started = time.perf_counter()
        body = await request.read()
        path = request.rel_url.raw_path
        error = None
        try:
            answer = await run(handle, models, request.method, path, body)
        except Exception as e:  # (a bug in answering one request never stops the server)
            answer, error = Answer(500, _error_json(f"internal error: {type(e).__name__}: {e}"), code="INTERNAL"), e
        requests.record("REST", f"{request.method} {path}", answer.api, answer.model, answer.version, answer.status,
                        answer.code, time.perf_counter() - started, error)
        return web.Response(status=answer.status, body=answer.body.encode("utf-8"), headers=_HEADERS)

    async def metrics(request: web.Request) -> web.Response:
        return web.Response(body=await run(requests.page), headers={"Content-Type": "text/plain"})

    app = web.Application(client_max_size=1 << 30)
    app.router.add_route("GET", PATH, metrics)
    app.router.add_route("*", r"/v1/{tail:.*}", v1)
    app.router.add_route("*", "/v1", v1)
    return app
