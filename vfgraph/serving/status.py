"""Errors a request can meet, with the status codes TF Serving answers them with.

A :class:`ServingError` carries a canonical status code (gRPC's names, which TensorFlow's and
absl's status codes share) and the message TF Serving gives for the same mistake. Both APIs
report it: gRPC as that status, REST as ``{"error": message}`` with the HTTP status TF Serving's
``ToHTTPStatusCode`` (tensorflow_serving/model_servers/http_server.cc) maps the code to.
"""
from __future__ import annotations

# TF Serving's http_server.cc, ToHTTPStatusCode: canonical code -> HTTP status
HTTP_STATUS = {
    "OK": 200, "CANCELLED": 499, "UNKNOWN": 500, "INVALID_ARGUMENT": 400, "DEADLINE_EXCEEDED": 504,
    "NOT_FOUND": 404, "ALREADY_EXISTS": 409, "PERMISSION_DENIED": 403, "RESOURCE_EXHAUSTED": 429,
    "FAILED_PRECONDITION": 400, "ABORTED": 409, "OUT_OF_RANGE": 400, "UNIMPLEMENTED": 501, "INTERNAL": 500,
    "UNAVAILABLE": 503, "DATA_LOSS": 500, "UNAUTHENTICATED": 401,
}

# TensorFlow's error codes (tensorflow/core/protobuf/error_codes.proto), by number
CODE_NAMES = {0: "OK", 1: "CANCELLED", 2: "UNKNOWN", 3: "INVALID_ARGUMENT", 4: "DEADLINE_EXCEEDED", 5: "NOT_FOUND",
              6: "ALREADY_EXISTS", 7: "PERMISSION_DENIED", 8: "RESOURCE_EXHAUSTED", 9: "FAILED_PRECONDITION",
              10: "ABORTED", 11: "OUT_OF_RANGE", 12: "UNIMPLEMENTED", 13: "INTERNAL", 14: "UNAVAILABLE",
              15: "DATA_LOSS", 16: "UNAUTHENTICATED"}


class ServingError(Exception):
    """A request that cannot be answered: ``code`` (a name of :data:`HTTP_STATUS`) and TF
    Serving's message for it."""

    def __init__(self, code: str, message: str):
        super().__init__(message)
        assert code in HTTP_STATUS, code
        self.code = code
        self.message = message

    @property
    def http_status(self) -> int:
        return HTTP_STATUS[self.code]

    def __str__(self) -> str:  # absl::Status::ToString(), which TF Serving nests in some messages
        return f"{self.code}: {self.message}"


def invalid(message: str) -> ServingError:
    return ServingError("INVALID_ARGUMENT", message)


def not_found(message: str) -> ServingError:
    return ServingError("NOT_FOUND", message)
