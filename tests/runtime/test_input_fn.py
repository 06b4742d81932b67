"""--input-fn: the user's decoding and augmentation of each example, run in the input workers.
Records holding raw bytes (not the signature's inputs) train through a random augmentation keyed
by (seed, step, example), bit-identical in deterministic mode on 1x8 (the function given to the
Python API as a callable) and 2x4 (MODULE:FUNCTION on the command line), and after a stop and
--resume; a function or module that fails, or returns the wrong names, shapes or dtypes, is one
line and exit 2 before the first step; the JPEG example's function decodes, crops and jitters."""
import os
import textwrap

import numpy as np
import pytest

from test_mpi_train import losses, rewritten, run_train
from test_streaming import same
from vfgraph.testing.cli import run_in_process

pytestmark = pytest.mark.mpi

AUGMENT = '''
import numpy as np


def augment(features, rng):
    """One digit from its raw bytes: a random horizontal flip and noise."""
    img = np.frombuffer(features["pixels"][0], np.uint8).reshape(8, 8).astype(np.float32) / 16
    if rng.random() < 0.5:
        img = img[:, ::-1]
    img = img + rng.normal(0, 0.05, img.shape).astype(np.float32)
    return {"x": img.reshape(64), "y": np.int32(features["label"][0])}


def raises(features, rng):
    return {"x": features["image"], "y": 0}


def no_label(features, rng):
    return {"x": np.zeros(64, np.float32)}


def square(features, rng):
    return {"x": np.zeros((8, 8), np.float32), "y": 1}


def half_label(features, rng):
    return {"x": np.zeros(64, np.float32), "y": 0.5}


def a_list(features, rng):
    return [features]
'''


@pytest.fixture(scope="module")
def exact(models, tmp_path_factory):
    """Models rewritten with 8 virtual nodes of 8 examples, the all-reduce and exact sums."""
    return rewritten(models, tmp_path_factory.mktemp("input_fn"), deterministic=True)


@pytest.fixture(scope="module")
def raw(digits, tmp_path_factory):
    """The digits as 2 TFRecord shards of raw features (``pixels``: 64 bytes, ``label``: int64),
    and the module of input functions (``fn``: its path)."""
    import tensorflow as tf

    root = tmp_path_factory.mktemp("input_fn_data")
    with np.load(digits["train"]) as z:
        x, y = np.round(z["x"] * 16).astype(np.uint8), z["y"]
    for s in range(2):
        with tf.io.TFRecordWriter(str(root / f"raw-{s}.tfrecord")) as w:
            for i in range(s, len(x), 2):
                w.write(tf.train.Example(features=tf.train.Features(feature={
                    "pixels": tf.train.Feature(bytes_list=tf.train.BytesList(value=[x[i].tobytes()])),
                    "label": tf.train.Feature(int64_list=tf.train.Int64List(value=[int(y[i])]))})).SerializeToString())
    (root / "aug.py").write_text(textwrap.dedent(AUGMENT))
    return {"data": str(root / "raw-*.tfrecord"), "fn": str(root / "aug.py")}


STEPS = 6


def augment(raw):
    """The module's ``augment``, imported here (a callable for the Python API)."""
    import importlib.util

    spec = importlib.util.spec_from_file_location("aug_callable", raw["fn"])
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module.augment


@pytest.fixture(scope="module")
def one_rank(exact, raw, tmp_path_factory):
    """The digits MLP trained from the raw records through ``augment`` on one process (1x8),
    from Python, the function given as a callable."""
    from vfgraph.runtime.train import train

    out = str(tmp_path_factory.mktemp("input_fn_runs") / "one")
    assert train(exact("mlp:adam"), raw["data"], STEPS, 64, out, progress=False, input_fn=augment(raw)).steps == STEPS
    return out


def test_augmented_records_train_bit_identical_on_1x8_and_2x4(one_rank, exact, raw, tmp_path):
    """2 ranks of 4 virtual nodes, the function named on the command line, against one process
    of 8 given it from Python: the same model; each rank decoded its own 4 virtual nodes."""
    two = run_train(2, exact("mlp:adam"), raw["data"], str(tmp_path / "two"), STEPS, "--input-fn",
                    f"{raw['fn']}:augment")
    same(one_rank, str(tmp_path / "two"))
    assert len(losses(str(tmp_path / "two"))) == STEPS
    for rank in (0, 1):  # (the check of the first 16 examples not counted)
        assert f"rank {rank}: read {STEPS * 32} examples" in two.stderr, two.stderr[-2000:]
    assert f"through --input-fn {raw['fn']}:augment (" in two.stderr


def test_feeds_are_the_same_rows_whatever_the_split_and_differ_by_step(raw):
    """Rows 0:64 of a step are rows 0:24 and 24:64 of it read apart (the split of a 3+5 layout);
    the same example at another step is augmented afresh."""
    import tensorflow as tf

    from vfgraph.runtime.data import TrainData
    from vfgraph.runtime.preprocess import InputFn

    specs = {"x": tf.TensorSpec([None, 64], tf.float32), "y": tf.TensorSpec([None], tf.int32)}
    fn = InputFn.resolve(f"{raw['fn']}:augment")
    data = TrainData.load(raw["data"], specs, "train", 64, 3, input_fn=fn)
    whole = data.feed(5, 0, 64)
    parts = [data.feed(5, 0, 24), data.feed(5, 24, 64)]
    for k in ("x", "y"):
        assert np.array_equal(whole[k], np.concatenate([p[k] for p in parts])), k
    assert whole["x"].dtype == np.float32 and whole["y"].dtype == np.int32
    n = len(data)
    later = 5 + n // 64  # the next epoch's step at the same position: other examples, or others' noise
    rows, again = data.rows(5, 0, 64), data.rows(later, 0, 64)
    both = np.intersect1d(rows, again)
    assert len(both)
    a = whole["x"][np.searchsorted(rows, both[0])]
    b = data.feed(later, 0, 64)["x"][np.searchsorted(again, both[0])]
    assert not np.array_equal(a, b)


@pytest.mark.parametrize("given, said", [
    ("aug.py", "give MODULE:FUNCTION"),
    ("no_such_module_here:f", "no module named 'no_such_module_here'"),
    ("boom.py:f", "importing boom.py failed: RuntimeError: boom at import"),
    ("aug.py:nothing", "has no function 'nothing' (its functions: a_list, augment, half_label, no_label, raises"),
    ("aug.py:raises", "raised KeyError: 'image' on example 0 (record 0 of "),
    ("aug.py:no_label", "returned ['x'] for example 0 (record 0 of "),
    ("aug.py:square", "returned 'x' of shape [8, 8] for example 0"),
    ("aug.py:a_list", "returned a list for example 0"),
    ("aug.py:half_label", "array 'y' holds float64 values, the 'train' signature takes int32: row 0 holds 0.5"),
])
def test_a_failing_or_unfit_input_fn_is_one_line_before_the_first_step(given, said, exact, raw, capsys, tmp_path,
                                                                       monkeypatch):
    model = exact("mlp:adam")
    monkeypatch.chdir(os.path.dirname(raw["fn"]))
    (tmp_path / "boom.py").write_text("raise RuntimeError('boom at import')\n")
    if given.startswith("boom.py"):
        monkeypatch.chdir(tmp_path)
    code, lines = run_in_process(capsys, "train", model, "--data", raw["data"], "--input-fn", given,
                                 "--steps", 2, "--batch-size", 64, "-o", tmp_path / "out", "--no-progress")
    assert code == 2, lines
    errors = [line for line in lines if line.startswith("vfgraph")]
    assert len(errors) == 1 and said in errors[0], lines
    assert not any("Traceback" in line for line in lines)
    assert not os.path.exists(tmp_path / "out") and not os.path.exists(tmp_path / "out.ckpt")


def test_the_jpeg_example_decodes_crops_and_jitters_each_image_by_its_key():
    """examples/jpeg_input.py on JPEG files from examples/jpeg_pipeline.py: 28x28x1 float32
    crops between 0 and 1, the same for the same (seed, step, index), another for another step;
    the validation's centre crop is the middle of the decoded image."""
    import jpeg_input
    import jpeg_pipeline

    from vfgraph.runtime.preprocess import example_rng

    images, labels = jpeg_pipeline.digit_images()
    files = jpeg_pipeline.jpegs(images[:3])
    features = {"image": np.array([files[0]], dtype=object), "label": np.array([labels[0]])}
    a, again = (jpeg_input.decode(features, example_rng(0, 4, 0)) for _ in range(2))
    other = jpeg_input.decode(features, example_rng(0, 5, 0))
    assert a["x"].shape == (28, 28, 1) and a["x"].dtype == np.float32 and a["y"] == labels[0]
    assert 0 <= a["x"].min() and a["x"].max() <= 1
    assert np.array_equal(a["x"], again["x"]) and not np.array_equal(a["x"], other["x"])
    whole = jpeg_input.pixels(files[0])
    assert whole.shape == (32, 32, 1) and np.array_equal(jpeg_input.centre(files[0]), whole[2:30, 2:30])
    assert np.abs(whole[..., 0] * 255 - images[0]).mean() < 8  # (JPEG's loss, at quality 90)


def test_a_later_failure_stops_with_a_checkpoint_and_resume_refuses_another_function(one_rank, exact, raw,
                                                                                      tmp_path):
    """A function that fails at step 3's examples stops the run (one error naming the example)
    keeping the checkpoint of step 2; --resume with another function is refused; with the same
    one it ends as the uninterrupted run (the augmentations are a function of the step)."""
    import threading

    from vfgraph.errors import InputError
    from vfgraph.runtime.train import train

    augmented, calls, lock = augment(raw), [0], threading.Lock()

    def tired(features, rng):  # (the check's 16 examples, then steps 0, 1 and 2)
        with lock:
            calls[0] += 1
            if calls[0] > 16 + 3 * 64:
                raise ValueError("tired")
        return augmented(features, rng)

    model, out = exact("mlp:adam"), str(tmp_path / "out")
    with pytest.raises(InputError, match=r"raised ValueError: tired on example \d+ \(record \d+ of "):
        train(model, raw["data"], STEPS, 64, out, progress=False, checkpoint_every=2, input_fn=tired)
    assert os.path.isdir(out + ".ckpt") and not os.path.exists(out)
    with pytest.raises(InputError, match=r"another configuration \(--input-fn \S+tired -> aug_callable:augment\)"):
        train(model, raw["data"], STEPS, 64, out, progress=False, resume=True, input_fn=augmented)
    calls[0] = -10 ** 6  # (the same function, working now)
    assert train(model, raw["data"], STEPS, 64, out, progress=False, resume=True, input_fn=tired).steps == STEPS
    same(one_rank, out)
