"""What both APIs answer, as TF Serving's protos: model status, model metadata, predict.

The REST and gRPC front ends (:mod:`.rest`, :mod:`.grpc_api`) turn their requests into these
calls and their answers (or :class:`~vfgraph.serving.status.ServingError`) into their own
format, so that the two say the same things.
"""
from __future__ import annotations

from typing import Dict, Optional

import numpy as np
from tensorflow_serving.apis import get_model_metadata_pb2, get_model_status_pb2, model_pb2

from vfgraph.serving.status import ServingError, invalid, not_found
from vfgraph.serving.versions import Manager

SIGNATURE_DEF = "signature_def"  # the one metadata field TF Serving supports


class Models:
    """The models served, by name (one model per server for now)."""

    def __init__(self, *managers: Manager, batcher=None):
        self.managers = {m.name: m for m in managers}
        self.batcher = batcher  # a batching.Batcher merging concurrent predict requests, or None

    def manager(self, name: str, version: Optional[int] = None, for_status: bool = False) -> Manager:
        if not name:
            raise invalid("Missing model name in request." if for_status else "ModelSpec has no name specified.")
        m = self.managers.get(name)
        if m is None:
            which = f"Latest({name})" if version is None else f"Specific({name}, {version})"
            raise not_found(f"Could not find any versions of model {name}" if for_status
                            else f"Servable not found for request: {which}")
        return m

    def status(self, name: str, version: Optional[int]) -> get_model_status_pb2.GetModelStatusResponse:
        out = get_model_status_pb2.GetModelStatusResponse()
        for st in self.manager(name, version, for_status=True).statuses(version):
            v = out.model_version_status.add(version=st.version)
            v.state = get_model_status_pb2.ModelVersionStatus.State.Value(st.state)
            v.status.error_code = _error_code(st.error_code)
            v.status.error_message = st.error_message
        return out

    def metadata(self, name: str, version: Optional[int],
                 fields=(SIGNATURE_DEF,)) -> get_model_metadata_pb2.GetModelMetadataResponse:
        if not fields:
            raise invalid("GetModelMetadataRequest must specify at least one metadata_field")
        for f in fields:
            if f != SIGNATURE_DEF:
                raise invalid(f"Metadata field {f} is not supported")
        manager = self.manager(name, version)
        with manager.acquire(version) as s:
            sigs = get_model_metadata_pb2.SignatureDefMap()
            for key, sig in s.signature_defs.items():
                sigs.signature_def[key].CopyFrom(sig)
            out = get_model_metadata_pb2.GetModelMetadataResponse()
            out.model_spec.CopyFrom(model_spec(name, s.version))
            out.metadata[SIGNATURE_DEF].Pack(sigs)
        return out

    def predict(self, name: str, version: Optional[int], signature: str, inputs: Dict[str, np.ndarray],
                output_filter=()):
        """(version served, outputs by name)."""
        with self.manager(name, version).acquire(version) as s:
            if self.batcher is not None:
                return s.version, self.batcher.predict(s, signature, inputs, output_filter)
            return s.version, s.predict(signature, inputs, output_filter)

    def input_dtypes(self, name: str, version: Optional[int], signature: str) -> Dict[str, int]:
        """The REST API's look-up of a signature's inputs (http_rest_api_handler.cc's GetInfoMap)."""
        with self.manager(name, version).acquire(version) as s:
            key = signature or "serving_default"
            if key not in s.signature_defs:
                raise invalid(f'Serving signature name: "{key}" not found in signature def')
            return {k: v.dtype for k, v in s.signature_defs[key].inputs.items()}


    def classify_or_regress(self, name: str, version: Optional[int], signature: str, verb: str):
        """Classify and regress need a signature of that kind (TF Serving's classifier.cc and
        regressor.cc words); these run tf.Example inputs, which vfgraph serve does not run yet."""
        key = signature or "serving_default"
        with self.manager(name, version).acquire(version) as s:
            sig = s.signature_defs.get(key)
            if sig is None:
                raise invalid(f"No signature was found with the name: {key}")
            kind = "classification" if verb == "classify" else "regression"
            method = f"tensorflow/serving/{verb}"
            if sig.method_name != method:
                raise invalid(f"Expected {kind} signature method_name to be {method}. Was: {sig.method_name}")
        raise ServingError("UNIMPLEMENTED", f"{verb} of tf.Example inputs (signature {key!r}) is not served by "
                                            "vfgraph serve yet; call its function through predict with the serialized "
                                            "examples")


def model_spec(name: str, version: int, signature: str = "") -> model_pb2.ModelSpec:
    spec = model_pb2.ModelSpec(name=name, signature_name=signature)
    spec.version.value = version
    return spec


def _error_code(name: str) -> int:
    """The number of TensorFlow's error code ``name`` (StatusProto.error_code's enum)."""
    from tensorflow_serving.apis import status_pb2

    return status_pb2.StatusProto.DESCRIPTOR.fields_by_name["error_code"].enum_type.values_by_name[name].number


__all__ = ["Models", "ServingError", "model_spec"]
