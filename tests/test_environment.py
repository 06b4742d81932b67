"""The environment the install commands make: one TensorFlow distribution, whichever extras are
installed (two would write the same files twice, and a GPU build prints CUDA start-up errors on
every command)."""
import importlib.metadata
import subprocess
import sys

from vfgraph.testing.cli import ENV

TENSORFLOW = {"tensorflow", "tensorflow-cpu", "tensorflow-intel", "tensorflow-macos", "tf-nightly"}


def test_one_tensorflow_distribution():
    names = sorted({(d.metadata["Name"] or "").lower().replace("_", "-") for d in importlib.metadata.distributions()}
                   & TENSORFLOW)
    assert len(names) == 1, f"TensorFlow distributions installed together: {names}"


def test_tensorflow_starts_without_cuda_messages():
    res = subprocess.run([sys.executable, "-c", "import tensorflow, keras_hub"], capture_output=True, text=True,
                         env=ENV, timeout=120)
    assert res.returncode == 0, res.stderr
    assert "cuda" not in res.stderr.lower(), res.stderr
