"""TF Serving's gRPC API with the protos and stubs of ``tensorflow-serving-api`` on grpcio's
asyncio server: ``PredictionService.Predict`` and ``GetModelMetadata``,
``ModelService.GetModelStatus``. A request's work runs on the server's thread pool; an error
is the status code and message TF Serving gives for it."""
from __future__ import annotations

import time
from typing import Callable, Optional

import grpc
from tensorflow_serving.apis import (get_model_metadata_pb2, get_model_status_pb2, model_service_pb2_grpc,
                                     predict_pb2, prediction_service_pb2_grpc)

from vfgraph.serving.api import Models, model_spec
from vfgraph.serving.status import ServingError, invalid


def _version(spec) -> Optional[int]:
    if spec.HasField("version_label"):
        raise invalid(f"Unrecognized servable version label: {spec.version_label}")
    return spec.version.value if spec.HasField("version") else None


def _predict(models: Models, request: predict_pb2.PredictRequest) -> predict_pb2.PredictResponse:
    import tensorflow as tf

    spec = request.model_spec
    inputs = {}
    for name, proto in request.inputs.items():
        try:
            inputs[name] = tf.make_ndarray(proto)
        except (TypeError, ValueError) as e:
            raise invalid(f"input {name}: not a readable TensorProto: {e}")
    served, outputs = models.predict(spec.name, _version(spec), spec.signature_name, inputs,
                                     list(request.output_filter))
    out = predict_pb2.PredictResponse()
    out.model_spec.CopyFrom(model_spec(spec.name, served, spec.signature_name or "serving_default"))
    for name, value in outputs.items():
        out.outputs[name].CopyFrom(tf.make_tensor_proto(value))
    return out


def _metadata(models: Models, request) -> get_model_metadata_pb2.GetModelMetadataResponse:
    spec = request.model_spec
    return models.metadata(spec.name, _version(spec), list(request.metadata_field))


def _status(models: Models, request) -> get_model_status_pb2.GetModelStatusResponse:
    if not request.HasField("model_spec"):
        raise invalid("Missing ModelSpec")
    spec = request.model_spec
    return models.status(spec.name, spec.version.value if spec.HasField("version") else None)


def _classify(models: Models, request):
    spec = request.model_spec
    models.classify_or_regress(spec.name, _version(spec), spec.signature_name, "classify")


def _regress(models: Models, request):
    spec = request.model_spec
    models.classify_or_regress(spec.name, _version(spec), spec.signature_name, "regress")


def _multi_inference(models: Models, request):
    raise ServingError("UNIMPLEMENTED", "MultiInference is not served by vfgraph serve")


_API = {"Predict": "predict", "GetModelMetadata": "metadata", "GetModelStatus": "status", "Classify": "classify",
        "Regress": "regress", "MultiInference": "multi_inference"}


def add_services(server, models: Models, run: Callable, requests) -> None:
    """Add the services to grpc.aio server ``server``: each call runs ``work(models, request)``
    by ``run`` (on the server's threads) and is recorded by ``requests``
    (:class:`~vfgraph.serving.metrics.Requests`)."""

    async def call(name: str, work, request, context):
        started = time.perf_counter()
        spec = getattr(request, "model_spec", None)
        asked = spec.version.value if spec is not None and spec.HasField("version") else None

        def record(code: str, version=None, error=None):
            requests.record("gRPC", name, _API[name], getattr(spec, "name", ""), version if version is not None
                            else asked, code, code, time.perf_counter() - started, error)

        try:
            answer = await run(work, models, request)
        except ServingError as e:
            record(e.code)
            await context.abort(getattr(grpc.StatusCode, e.code), e.message)
        except Exception as e:  # (a bug in answering one request never stops the server)
            record("INTERNAL", error=e)
            await context.abort(grpc.StatusCode.INTERNAL, f"internal error: {type(e).__name__}: {e}")
        has_spec = "model_spec" in answer.DESCRIPTOR.fields_by_name and answer.HasField("model_spec")
        record("OK", answer.model_spec.version.value if has_spec else None)
        return answer

    class Prediction(prediction_service_pb2_grpc.PredictionServiceServicer):
        async def Predict(self, request, context):
            return await call("Predict", _predict, request, context)

        async def GetModelMetadata(self, request, context):
            return await call("GetModelMetadata", _metadata, request, context)

        async def Classify(self, request, context):
            return await call("Classify", _classify, request, context)

        async def Regress(self, request, context):
            return await call("Regress", _regress, request, context)

        async def MultiInference(self, request, context):
            return await call("MultiInference", _multi_inference, request, context)

    class ModelStatus(model_service_pb2_grpc.ModelServiceServicer):
        async def GetModelStatus(self, request, context):
            return await call("GetModelStatus", _status, request, context)

    prediction_service_pb2_grpc.add_PredictionServiceServicer_to_server(Prediction(), server)
    model_service_pb2_grpc.add_ModelServiceServicer_to_server(ModelStatus(), server)
