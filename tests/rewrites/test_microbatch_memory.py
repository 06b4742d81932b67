"""Serving in slices holds one slice's activations at a time, whatever the inter-op threads."""
import json
import os
import subprocess
import sys
import textwrap

import pytest

import vfgraph

ENV = dict(os.environ, TF_CPP_MIN_LOG_LEVEL="3", TF_ENABLE_ONEDNN_OPTS="0")
SINGLE = "SINGLE_THREADED_EXECUTOR"


def _export_wide(path, width=16384, blocks=16):
    """Large activations per example (``width`` floats, 64 KB) through ``blocks`` residual
    blocks of two branches each: what spreads a slice's ops over the inter-op threads."""
    import keras

    keras.utils.set_random_seed(0)
    layers = keras.layers
    x = keras.Input((64,))
    h = layers.Dense(width)(x)
    for _ in range(blocks):
        h = layers.Add()([layers.ReLU()(layers.Rescaling(0.5)(h)), layers.ReLU()(layers.Rescaling(-0.25)(h))])
    keras.Model(x, layers.Dense(4)(h)).export(str(path), verbose=False)


@pytest.fixture(scope="module")
def wide(tmp_path_factory):
    root = tmp_path_factory.mktemp("wide")
    _export_wide(root / "model")
    out = vfgraph.save(vfgraph.rewrite(str(root / "model"), vnode_batch=16), root / "rewritten")  # (serving only)
    return str(root / "model"), out


def _run(code, timeout=240):
    res = subprocess.run([sys.executable, "-c", textwrap.dedent(code)], capture_output=True, text=True, env=ENV,
                         timeout=timeout)
    assert res.returncode == 0, res.stderr[-3000:]
    return json.loads(res.stdout.strip().splitlines()[-1])


_GROWTH = """
    import json, numpy as np, tensorflow as tf
    tf.config.threading.set_inter_op_parallelism_threads(16)
    def hwm():
        for line in open("/proc/self/status"):
            if line.startswith("VmHWM:"):
                return int(line.split()[1]) * 1024
    fn = tf.saved_model.load({path!r}).signatures["serve"]
    x = np.random.default_rng(0).normal(size=(256, 64)).astype("float32")
    (key,) = fn.structured_input_signature[1]  # Keras numbers its input names per process
    fn(**{{key: x[:16]}})
    before = hwm()
    fn(**{{key: x}})
    print(json.dumps({{"growth": hwm() - before}}))
"""


def test_peak_memory_of_a_large_request_stays_near_one_slice(wide):
    """Fresh processes with 16 inter-op threads: a 256-example request grows the peak RSS by
    under 0.15 of what the original's does (about 0.02 measured; slices run on the default
    executor spread over the threads reached 0.24-0.56, the original 100-270 MB)."""
    original, rewritten = wide
    want = _run(_GROWTH.format(path=original))["growth"]
    got = _run(_GROWTH.format(path=rewritten))["growth"]
    assert want > 50e6, want  # the measurement sees the original's activations
    assert got < 0.15 * want, (got, want)


def test_one_inter_op_thread_serves(models, rewritten):
    """With one inter-op thread (vfgraph train --threads 1, many servers) the loop runs and
    equals the original: nothing in it waits on the inter-op pool its own thread belongs to."""
    res = _run(f"""
        import json, numpy as np, tensorflow as tf
        import vfgraph  # the training signature's all-reduce ops
        tf.config.threading.set_inter_op_parallelism_threads(1)
        tf.config.threading.set_intra_op_parallelism_threads(1)
        x = np.random.default_rng(0).normal(size=(29, 64)).astype("float32")
        a = tf.saved_model.load({models("cnn:sgd")!r}).signatures["serving_default"](x=x)["logits"].numpy()
        b = tf.saved_model.load({rewritten("cnn:sgd", 4, 8)!r}).signatures["serving_default"](x=x)["logits"].numpy()
        print(json.dumps({{"shape": list(b.shape), "err": float(np.abs(a - b).max())}}))
    """, timeout=120)
    assert res["shape"] == [29, 10] and res["err"] < 1e-5, res


def test_loop_runs_on_the_single_threaded_executor(wide):
    """The structure behind the bound: the serving function calls the loop function on the
    single-threaded executor, the loop function is never inlined, its While is not lowered
    (that executor cannot run TF1 control flow) and the body holds the serving nodes itself
    (a call there would start a multi-threaded executor)."""
    item = vfgraph.load(wide[1])
    rec = item.metadata["rewrites"]["microbatch-inference"]["serve"]
    assert rec["executor"] == SINGLE
    lib = item.library
    (call,) = [n for n in lib[rec["function"]].node_def if n.op == "StatefulPartitionedCall"]
    assert call.attr["f"].func.name == rec["loop_function"] and call.attr["executor_type"].s.decode() == SINGLE
    loop = lib[rec["loop_function"]]
    assert loop.attr["_noinline"].b
    (while_op,) = [n for n in loop.node_def if n.op == "While"]
    assert not while_op.attr["_lower_using_switch_merge"].b and while_op.attr["parallel_iterations"].i == 1
    body = lib[while_op.attr["body"].func.name]
    assert body.signature.name == rec["body_function"]
    ops = {n.op for n in body.node_def}
    assert "MatMul" in ops and not ops & {"StatefulPartitionedCall", "PartitionedCall"}
    assert not any(n.op in lib for n in body.node_def)


def test_slices_calling_functions_keep_the_default_executor(models, rewritten):
    """A slice that calls library functions (the LSTM's While) could deadlock or leave the
    single-threaded executor: it keeps the default executor, says so in a note, and serves
    the same results."""
    import numpy as np
    import tensorflow as tf

    item = vfgraph.rewrite(models("lstm"), vnodes=4, vnode_batch=8)
    assert item.metadata["rewrites"]["microbatch-inference"]["serving_default"]["executor"] == "default"
    assert any("default executor" in n and "calls function" in n for n in item.metadata["notes"])
    x = np.random.default_rng(0).normal(size=(19, 64)).astype("float32")
    a = tf.saved_model.load(models("lstm")).signatures["serving_default"](x=x)["logits"].numpy()
    b = tf.saved_model.load(rewritten("lstm", 4, 8)).signatures["serving_default"](x=x)["logits"].numpy()
    np.testing.assert_allclose(b, a, rtol=1e-5, atol=1e-6)
