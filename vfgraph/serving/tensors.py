"""TF Serving's JSON mapping of tensors (its api_rest.md, "JSON mapping"; the code is
tensorflow_serving/util/json_tensor.cc): request bodies to arrays, arrays to response bodies.

Requests: ``instances`` (row format: one item per example, an object per example when the
signature has several inputs) or ``inputs`` (columnar: one value, or an object of named
values); values nested lists whose leaves have the signature input's type, ``{"b64": ...}`` for
binary strings, ``NaN``/``Infinity`` accepted. Responses: ``predictions`` (row) or ``outputs``
(columnar), one value or an object by output name; floats written as TF Serving writes them
(six significant digits when they read back the same, else full precision, whole numbers with
``.0``), strings of outputs named ``*_bytes`` as ``{"b64": ...}``. Mistakes raise
:class:`~vfgraph.serving.status.ServingError` with TF Serving's messages.
"""
from __future__ import annotations

import base64
import binascii
import json
from typing import Dict, List, Mapping

import numpy as np
from tensorflow.core.framework import types_pb2

from vfgraph.serving.status import ServingError, invalid

_NUMPY = {types_pb2.DT_FLOAT: np.float32, types_pb2.DT_DOUBLE: np.float64, types_pb2.DT_INT32: np.int32,
          types_pb2.DT_INT16: np.int16, types_pb2.DT_INT8: np.int8, types_pb2.DT_UINT8: np.uint8,
          types_pb2.DT_INT64: np.int64, types_pb2.DT_BOOL: np.bool_, types_pb2.DT_STRING: object,
          types_pb2.DT_UINT32: np.uint32, types_pb2.DT_UINT64: np.uint64}
# the whole numbers each type holds (TF Serving takes any int32 for the narrower ones and
# truncates it; here a value out of range is refused with TF Serving's type error)
_INT_RANGE = {types_pb2.DT_INT32: (-2 ** 31, 2 ** 31), types_pb2.DT_INT16: (-2 ** 15, 2 ** 15),
              types_pb2.DT_INT8: (-2 ** 7, 2 ** 7), types_pb2.DT_UINT8: (0, 2 ** 8),
              types_pb2.DT_INT64: (-2 ** 63, 2 ** 63), types_pb2.DT_UINT32: (0, 2 ** 32),
              types_pb2.DT_UINT64: (0, 2 ** 64)}
_DEBUG_BYTES = 256  # json_tensor.cc's kMaxJsonDebugStringBytes


def numpy_dtype(dtype: int):
    return _NUMPY.get(dtype)


def dtype_string(dtype: int) -> str:
    """TensorFlow's DataTypeString: DT_FLOAT -> float, DT_INT32 -> int32."""
    return types_pb2.DataType.Name(dtype)[3:].lower()


def parse_body(body: bytes) -> dict:
    """The request's JSON object (json_tensor.cc's ParseJson)."""
    if not body:
        raise invalid("JSON Parse error: The document is empty")
    try:
        doc = json.loads(body)
    except (ValueError, UnicodeDecodeError) as e:
        where = f" at offset: {e.pos}" if isinstance(e, json.JSONDecodeError) else ""
        raise invalid(f"JSON Parse error: {getattr(e, 'msg', e)}{where}")
    if not isinstance(doc, dict):
        raise invalid(f"JSON Value: {debug_string(doc)} Is not object")
    return doc


def signature_name(doc: dict) -> str:
    name = doc.get("signature_name", "")
    if not isinstance(name, str):
        raise invalid(f"JSON Value: {debug_string(doc)} not formatted correctly. 'signature_name' key must be a "
                      "string value.")
    return name


def request_tensors(doc: dict, dtypes: Mapping[str, int], signature: str):
    """The input arrays of a predict request and its format ("row" or "columnar"), for a
    signature whose inputs have ``dtypes`` (FillPredictRequestFromJson)."""
    if not dtypes:
        raise invalid(f"Failed to get input map for signature: {signature or 'DEFAULT'}")
    if "instances" in doc:
        if "inputs" in doc:
            raise invalid(f"JSON Value: {debug_string(doc)} Not formatted correctly expecting only one of 'inputs' "
                          "or 'instances' keys to exist ")
        instances = doc["instances"]
        if not isinstance(instances, list):
            raise invalid(f"JSON Value: {debug_string(doc)} Expecting 'instances' to be an list/array")
        if not instances:
            raise invalid(f"JSON Value: {debug_string(doc)} No values in 'instances' array")
        return _from_instances(instances, dtypes), "row"
    if "inputs" in doc:
        return _from_inputs(doc["inputs"], dtypes), "columnar"
    raise invalid("Missing 'inputs' or 'instances' key")


def _is_b64(val) -> bool:
    return isinstance(val, dict) and len(val) == 1 and isinstance(val.get("b64"), str)


def _is_named(val) -> bool:
    return isinstance(val, dict) and not _is_b64(val)


def _from_instances(instances: list, dtypes: Mapping[str, int]) -> Dict[str, np.ndarray]:
    names = sorted(dtypes)
    if not isinstance(instances[0], dict) and len(names) > 1:
        raise invalid("instances is a plain list, but expecting list of objects as multiple input tensors required "
                      "as per tensorinfo_map")
    named = _is_named(instances[0])
    values: Dict[str, list] = {n: [] for n in names}
    shapes: Dict[str, List[int]] = {}
    for i, item in enumerate(instances):
        if named:
            if not _is_named(item):
                raise invalid(f"Expecting object but got list at item {i} of input list")
            for name, value in item.items():
                try:
                    _add_instance(value, name, dtypes, values, shapes)
                except ServingError as e:
                    raise invalid(f"Failed to process element: {i} key: {name} of 'instances' list. Error: {e}")
            if set(item) != set(names):
                raise invalid(f"Failed to process element: {i} of 'instances' list. JSON object: "
                              f"{debug_string(item)} keys must be equal to: {','.join(names)}")
        else:
            if _is_named(item):
                raise invalid(f"Expecting value/list but got object at item {i} of input list")
            try:
                _add_instance(item, names[0], dtypes, values, shapes)
            except ServingError as e:
                raise invalid(f"Failed to process element: {i} of 'instances' list. Error: {e}")
    return {n: _array(values[n], [len(instances)] + shapes[n], dtypes[n]) for n in names if n in shapes}


def _add_instance(value, name: str, dtypes, values: Dict[str, list], shapes: Dict[str, List[int]]) -> None:
    """One example's value of input ``name`` (AddInstanceItem): every example's has the same shape."""
    if name not in dtypes:
        raise invalid(f"JSON object: does not have named input: {name}")
    shape = _dense_shape(value)
    flat: list = []
    _fill(value, 0, shape, dtypes[name], flat)
    if name not in shapes:
        shapes[name] = shape
    elif int(np.prod(shapes[name])) != len(flat):
        raise invalid(f"Expecting tensor size: {int(np.prod(shapes[name]))} but got: {len(flat)}")
    elif shapes[name] != shape:
        raise invalid(f"Expecting shape [{','.join(map(str, shapes[name]))}] but got: [{','.join(map(str, shape))}]")
    values[name].extend(flat)


def _from_inputs(val, dtypes: Mapping[str, int]) -> Dict[str, np.ndarray]:
    if not isinstance(val, dict) or _is_b64(val):
        if len(dtypes) > 1:
            raise invalid("inputs is a plain value/list, but expecting an object as multiple input tensors required "
                          "as per tensorinfo_map")
        (name, dtype), = dtypes.items()
        return {name: _tensor(val, dtype)}
    out = {}
    for name in sorted(dtypes):
        if name not in val:
            raise invalid(f"Missing named input: {name} in 'inputs' object.")
        out[name] = _tensor(val[name], dtypes[name])
    return out


def _tensor(val, dtype: int) -> np.ndarray:
    shape = _dense_shape(val)
    flat: list = []
    _fill(val, 0, shape, dtype, flat)
    return _array(flat, shape, dtype)


def _array(flat: list, shape: List[int], dtype: int) -> np.ndarray:
    if dtype == types_pb2.DT_STRING:
        arr = np.empty(len(flat), dtype=object)
        arr[:] = flat
        return arr.reshape(shape)
    return np.array(flat, dtype=_NUMPY[dtype]).reshape(shape)


def _dense_shape(val) -> List[int]:
    """The shape a nested list has along its first elements (GetDenseTensorShape)."""
    shape = []
    while isinstance(val, list):
        shape.append(len(val))
        if not val:
            break
        val = val[0]
    return shape


def _fill(val, level: int, shape: List[int], dtype: int, out: list) -> None:
    """Append the leaves of ``val`` to ``out``, checking that it is dense (FillTensorProto)."""
    rank = len(shape)
    if not isinstance(val, list):
        if level != rank:
            raise invalid(f"JSON Value: {debug_string(val)} found at incorrect level: {level + 1} in the JSON DOM. "
                          f"Expected at level: {rank}")
        out.append(_leaf(val, dtype))
        return
    if level >= rank:
        raise invalid(f"Encountered list at unexpected level: {level} expected < {rank}")
    if len(val) != shape[level]:
        raise invalid(f"Encountered list at unexpected size: {len(val)} at level: {level} expected size: "
                      f"{shape[level]}")
    if level == rank - 1 and dtype in (types_pb2.DT_FLOAT, types_pb2.DT_DOUBLE) and \
            all(type(v) is float or type(v) is int for v in val):  # (the common case, at once)
        out.extend(val)
        return
    for v in val:
        _fill(v, level + 1, shape, dtype, out)


def _leaf(val, dtype: int):
    """One value of a tensor of ``dtype`` (AddValueToTensor; a {"b64": ...} object for strings)."""
    if isinstance(val, dict):
        if dtype != types_pb2.DT_STRING:
            raise _type_error(val, dtype)
        if not _is_b64(val):
            raise invalid(f"JSON Value: {debug_string(val)} not formatted correctly for base64 data")
        try:
            return base64.b64decode(val["b64"], validate=True)
        except (binascii.Error, ValueError):
            raise invalid("Unable to base64 decode")
    if dtype in (types_pb2.DT_FLOAT, types_pb2.DT_DOUBLE):
        if type(val) not in (float, int):
            raise _type_error(val, dtype)
        return val
    if dtype in _INT_RANGE:
        low, high = _INT_RANGE[dtype]
        if type(val) is not int or not low <= val < high:
            raise _type_error(val, dtype)
        return val
    if dtype == types_pb2.DT_STRING:
        if not isinstance(val, str):
            raise _type_error(val, dtype)
        return val.encode("utf-8")
    if dtype == types_pb2.DT_BOOL:
        if not isinstance(val, bool):
            raise _type_error(val, dtype)
        return val
    raise ServingError("UNIMPLEMENTED", f"Conversion of JSON Value: {debug_string(val)} to type: "
                                        f"{dtype_string(dtype)}")


def _type_error(val, dtype: int) -> ServingError:
    return invalid(f"JSON Value: {debug_string(val)} Type: {_json_type(val)} is not of expected type: "
                   f"{dtype_string(dtype)}")


def _json_type(val) -> str:
    if val is None:
        return "Null"
    if isinstance(val, bool):
        return "True" if val else "False"
    return {dict: "Object", list: "Array", str: "String"}.get(type(val), "Number")


def debug_string(val) -> str:
    """A JSON value as TF Serving quotes it in messages (JsonValueToDebugString): arrays on
    one line, objects indented, cut after 256 bytes."""
    def write(v, indent: str) -> str:
        if isinstance(v, list):
            return "[" + ", ".join(write(x, indent) for x in v) + "]"
        if isinstance(v, dict):
            if not v:
                return "{}"
            inner = indent + "    "
            return "{\n" + ",\n".join(f"{inner}{json.dumps(k)}: {write(x, inner)}" for k, x in v.items()) + \
                "\n" + indent + "}"
        return json.dumps(v)

    return write(val, "")[:_DEBUG_BYTES]


# ---- responses ---------------------------------------------------------------------------

def response_body(outputs: Mapping[str, np.ndarray], fmt: str) -> str:
    """The JSON of a predict response: ``predictions`` (row format; every output batched to the
    same size) or ``outputs`` (columnar); one output without its name, several as an object
    (MakeJsonFromTensors)."""
    if not outputs:
        raise invalid("Cannot convert empty tensor map to JSON")
    names = sorted(outputs)
    tokens = {n: _tokens(outputs[n], n) for n in names}
    if fmt == "columnar":
        if len(names) == 1:
            return '{"outputs": ' + _nest(tokens[names[0]]) + "}"
        return '{"outputs": {' + ", ".join(f"{json.dumps(n)}: {_nest(tokens[n])}" for n in names) + "}}"
    batch = None
    for n in names:
        if tokens[n].ndim == 0:
            raise invalid(f"Tensor name: {n} has no shape information ")
        if batch is not None and tokens[n].shape[0] != batch:
            raise invalid(f"Tensor name: {n} has inconsistent batch size: {tokens[n].shape[0]} expecting: {batch}")
        batch = tokens[n].shape[0]
    if len(names) == 1:
        items = [_nest(row) for row in tokens[names[0]]]
    else:
        items = ["{" + ", ".join(f"{json.dumps(n)}: {_nest(tokens[n][i])}" for n in names) + "}"
                 for i in range(batch)]
    return '{"predictions": [' + ", ".join(items) + "]}"


def _nest(tokens) -> str:
    if not isinstance(tokens, np.ndarray):  # (one value of a 1-D output's row)
        return tokens
    if tokens.ndim == 0:
        return tokens.item()
    if tokens.ndim == 1:
        return "[" + ", ".join(tokens.tolist()) + "]"
    return "[" + ", ".join(_nest(t) for t in tokens) + "]"


def _tokens(arr: np.ndarray, name: str) -> np.ndarray:
    """Each value of ``arr`` as its JSON text (an object array of ``arr``'s shape)."""
    arr = np.asarray(arr)
    if arr.dtype.kind == "f":
        return _decimal_tokens(arr)
    if arr.dtype.kind == "b":
        return np.where(arr, "true", "false").astype(object)
    if arr.dtype.kind in "iu":
        return np.vectorize(str, otypes=[object])(arr) if arr.size else arr.astype(object)
    if arr.dtype.kind in "OSU":
        as_bytes = name.endswith("_bytes")  # json_tensor.cc's IsNamedTensorBytes

        def text(v) -> str:
            v = v if isinstance(v, bytes) else str(v).encode("utf-8")
            if as_bytes:
                return '{"b64": "' + base64.b64encode(v).decode("ascii") + '"}'
            return json.dumps(v.decode("utf-8", "replace"), ensure_ascii=False)
        return np.vectorize(text, otypes=[object])(arr) if arr.size else arr.astype(object)
    raise invalid(f"Failed to write JSON value for tensor type: {arr.dtype}")


def _decimal_tokens(arr: np.ndarray) -> np.ndarray:
    """Floats as json_tensor.cc's WriteDecimal writes them: six significant digits when they
    read back as the same value, else max_digits10 (9 for float, 17 for double); ``.0`` after
    whole numbers; NaN, Infinity, -Infinity."""
    digits = 9 if arr.dtype == np.float32 else 17
    wide = arr.astype(np.float64)
    out = np.empty(arr.shape, dtype=object)
    flat_out, flat, flat_wide = out.reshape(-1), arr.reshape(-1), wide.reshape(-1)
    for i, (v, w) in enumerate(zip(flat.tolist(), flat_wide.tolist())):
        if w != w:
            flat_out[i] = "NaN"
            continue
        if w in (float("inf"), float("-inf")):
            flat_out[i] = "Infinity" if w > 0 else "-Infinity"
            continue
        s = "%.6g" % w
        if arr.dtype.type(float(s)) != arr.dtype.type(v):
            s = "%.*g" % (digits, w)
        if "." not in s and "e" not in s:
            s += ".0"
        flat_out[i] = s
    return out

