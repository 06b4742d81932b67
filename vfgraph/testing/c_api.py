"""Serve a SavedModel through TensorFlow's C API loader (``TF_LoadSessionFromSavedModel``, the
C++ loader TF Serving and the Go, Java and Rust bindings use), from Python: a small C client
(``serve_c_api.c`` beside this file) built against the installed TensorFlow wheel, which ships
the headers and ``libtensorflow_cc``."""
from __future__ import annotations

import hashlib
import os
import shutil
import subprocess
import tempfile
from typing import Dict

import numpy as np

SOURCE = os.path.join(os.path.dirname(os.path.abspath(__file__)), "serve_c_api.c")
_DTYPES = {np.dtype("float32"): 1, np.dtype("float64"): 2, np.dtype("int32"): 3, np.dtype("int64"): 9,
           np.dtype("bool"): 10}
_NUMPY = {1: "float32", 2: "float64", 3: "int32", 9: "int64", 10: "bool"}


class CApiUnavailable(RuntimeError):
    """No C compiler here to build the client."""


def build_client(cache_dir: str) -> str:
    """The client executable, built once per source and TensorFlow into ``cache_dir``."""
    import tensorflow as tf

    gcc = shutil.which("gcc") or shutil.which("cc")
    if gcc is None:
        raise CApiUnavailable("gcc is needed to build the C API client")
    tf_dir = os.path.dirname(tf.__file__)
    with open(SOURCE, "rb") as f:
        key = hashlib.sha256(f.read() + tf.__version__.encode() + tf_dir.encode()).hexdigest()[:16]
    exe = os.path.join(cache_dir, f"serve_c_api_{key}")
    if os.path.exists(exe):
        return exe
    os.makedirs(cache_dir, exist_ok=True)
    gold = ["-fuse-ld=gold"] if shutil.which("ld.gold") else []  # links the 1 GB library in 3 s instead of 15
    tmp = exe + f".{os.getpid()}"
    res = subprocess.run([gcc, "-O1", *gold, "-o", tmp, SOURCE, f"-I{tf_dir}/include", f"-L{tf_dir}",
                          "-l:libtensorflow_cc.so.2", "-l:libtensorflow_framework.so.2", f"-Wl,-rpath,{tf_dir}"],
                         capture_output=True, text=True, timeout=600)
    if res.returncode:
        raise RuntimeError(f"building the C API client failed: {res.stderr[-2000:]}")
    os.replace(tmp, exe)
    return exe


def serve(exe: str, model_dir: str, inputs: Dict[str, np.ndarray], key: str = "serving_default",
          env: Dict[str, str] = None) -> Dict[str, np.ndarray]:
    """Run signature ``key`` of ``model_dir`` on ``inputs`` (by signature input key) through the
    C API; returns its outputs by key. The tensor names come from the signature_def."""
    from tensorflow.core.protobuf import saved_model_pb2

    sm = saved_model_pb2.SavedModel()
    with open(os.path.join(model_dir, "saved_model.pb"), "rb") as f:
        sm.ParseFromString(f.read())
    sd = next(mg for mg in sm.meta_graphs if "serve" in mg.meta_info_def.tags).signature_def[key]
    keys = sorted(sd.outputs)
    with tempfile.TemporaryDirectory() as d:
        lines = [f"inputs {len(inputs)}"]
        for k, (name, value) in enumerate(sorted(inputs.items())):
            value = np.ascontiguousarray(value)
            path = os.path.join(d, f"in_{k}.bin")
            value.astype(value.dtype.newbyteorder("<")).tofile(path)
            lines.append(f"{sd.inputs[name].name} {_DTYPES[value.dtype]} {value.ndim} "
                         f"{' '.join(map(str, value.shape))} {path}")
        lines.append(f"outputs {len(keys)}")
        lines.extend(sd.outputs[k].name for k in keys)
        request = os.path.join(d, "request.txt")
        with open(request, "w") as f:
            f.write("\n".join(lines) + "\n")
        run_env = dict(os.environ, TF_CPP_MIN_LOG_LEVEL="2")
        run_env.update(env or {})
        res = subprocess.run([exe, model_dir, request], capture_output=True, text=True, timeout=600, env=run_env)
    if res.returncode:
        raise RuntimeError((res.stderr.strip().splitlines() or ["the C API client failed"])[-1])
    out = {}
    rows = res.stdout.splitlines()
    for k, head, values in zip(keys, rows[0::2], rows[1::2]):
        _, name, dtype, nd, *dims = head.split()
        shape = [int(x) for x in dims]
        if name != sd.outputs[k].name or int(nd) != len(shape):
            raise RuntimeError(f"unexpected C API client output {head!r}")
        out[k] = np.array(values.split(), dtype=np.float64).astype(_NUMPY.get(int(dtype), "float64")).reshape(shape)
    return out
