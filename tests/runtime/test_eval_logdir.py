"""Validation (--eval-data, --eval-every) and TensorBoard event files (--logdir) of vfgraph train:
the metrics equal those computed directly on the trained model, on one rank and on two; the
event files, read back with TensorBoard's own reader, hold the named scalars at their steps;
mistakes are one line, exit 2, before the first step."""
import json
import os
import subprocess
import sys

import numpy as np
import pytest

from vfgraph.testing.cli import ENV, one_error, run_in_process, tree_digest

MPIEXEC = os.path.join(os.path.dirname(sys.executable), "mpiexec")
MPI_ENV = dict(ENV, OMP_NUM_THREADS="1")
STEPS, EVERY, BATCH = 6, 3, 64


@pytest.fixture(scope="module")
def v8(rewritten):
    """The digits MLP (SGD with momentum, learning rate 0.05) with 8 virtual nodes of 8 and the all-reduce."""
    return rewritten("mlp:momentum", 8, 8)


def train_argv(model, data, out, *extra):
    return ["train", model, "--data", data, "--steps", STEPS, "--batch-size", BATCH, "-o", out, "--no-progress",
            *extra]


def direct_metrics(out, path):
    """The validation loss and accuracy of the trained model at ``out`` on ``path``, computed here."""
    import tensorflow as tf

    with np.load(path) as z:
        x, y = z["x"], z["y"]
    logits = tf.saved_model.load(out).signatures["serving_default"](x=x)["logits"].numpy().astype(np.float64)
    loss = tf.keras.losses.sparse_categorical_crossentropy(y, logits, from_logits=True).numpy().mean()
    return {"loss": float(loss), "accuracy": float((logits.argmax(-1) == y).mean())}


def recorded(out):
    with open(os.path.join(out, "assets.extra", "vfgraph.json")) as f:
        return json.load(f)["validation"]


def scalars(logdir, run):
    """{tag: [(step, value)]} of the run ``run`` under ``logdir``, read with TensorBoard's reader,
    and whether it holds a graph."""
    import tensorflow as tf
    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

    acc = EventAccumulator(os.path.join(logdir, run), size_guidance={"tensors": 0, "scalars": 0})
    acc.Reload()
    got = {t: [(e.step, float(tf.make_ndarray(e.tensor_proto))) for e in acc.Tensors(t)] for t in acc.Tags()["tensors"]}
    return got, acc.Tags()["graph"]


def check_metrics(out, digits, summary):
    """The record's validation, the summary line's and the direct computation agree."""
    rec = recorded(out)
    want = direct_metrics(out, digits["test"])
    assert rec["step"] == STEPS and rec["examples"] == 389 and rec["data"] == digits["test"]
    assert rec["loss"] == "sparse softmax cross-entropy of logits"
    for k in ("loss", "accuracy"):
        assert abs(rec["metrics"][k] - want[k]) <= 1e-6, (k, rec["metrics"][k], want[k])
    assert f"validation loss {want['loss']:.4f}, accuracy {want['accuracy']:.4f}" in summary, summary
    return rec["metrics"]


def check_events(logdir, vnodes, steps=STEPS):
    """The scalars of a run whose ranks ran ``vnodes`` virtual nodes each."""
    ranks = len(vnodes)
    train, graph = scalars(logdir, "train")
    assert graph
    for tag in ["batch_loss", "examples_per_second", "learning_rate"] + [
            f"{k}/rank_{r}" for k in ("step_time", "vnodes") for r in range(ranks)]:
        assert [s for s, _ in train[tag]] == list(range(1, steps + 1)), tag
    for r, v in enumerate(vnodes):
        assert all(got == v for _, got in train[f"vnodes/rank_{r}"])
    assert all(abs(v - 0.05) < 1e-7 for _, v in train["learning_rate"])
    assert all(v > 0 for _, v in train["examples_per_second"] + train["step_time/rank_0"])
    validation, _ = scalars(logdir, "validation")
    assert sorted(validation) == ["epoch_accuracy", "epoch_loss"]
    assert [s for s, _ in validation["epoch_loss"]] == list(range(EVERY, steps + 1, EVERY))
    return train, validation


def test_one_rank_metrics_and_event_files(v8, digits, tmp_path):
    """From Python, in this process: the metrics are the trained model's, the serving signature
    saw the trained variables (the loss falls between validations), the batch losses are the
    record's, the event files go under the logdir only."""
    from vfgraph.runtime.train import train

    out, logdir = str(tmp_path / "out"), str(tmp_path / "logs")
    res = train(v8, digits["train"], STEPS, BATCH, out, progress=False, eval_data=digits["test"], eval_every=EVERY,
                logdir=logdir)
    metrics = check_metrics(out, digits, res.summary())
    assert res.validation == metrics
    train_scalars, validation = check_events(logdir, [8])
    losses = json.load(open(os.path.join(out, "assets.extra", "vfgraph.json")))["training"]["losses"]
    np.testing.assert_allclose([v for _, v in train_scalars["batch_loss"]], losses, rtol=1e-6)
    first, last = validation["epoch_loss"][0][1], validation["epoch_loss"][-1][1]
    assert last < first and abs(last - metrics["loss"]) < 1e-6
    assert sorted(os.listdir(logdir)) == ["train", "validation"]


def test_summary_line_shows_the_validation(v8, digits, tmp_path):
    """A real process: the closing line on stdout holds the validation's loss and accuracy
    (after the last step only, without --eval-every)."""
    out = str(tmp_path / "out")
    res = subprocess.run([sys.executable, "-m", "vfgraph.cli", *map(str, train_argv(
        v8, digits["train"], out, "--eval-data", digits["test"]))], capture_output=True, text=True, env=ENV,
        timeout=300)
    assert res.returncode == 0, res.stderr[-3000:]
    check_metrics(out, digits, res.stdout)


@pytest.mark.mpi
def test_two_ranks_metrics_and_event_files(v8, digits, tmp_path):
    """mpiexec -n 2, uneven shares 5+3: each rank validates half the examples; the sums gathered
    give the trained model's metrics; rank 0 writes every rank's step time and virtual nodes."""
    out, logdir = str(tmp_path / "out"), str(tmp_path / "logs")
    argv = train_argv(v8, digits["train"], out, "--eval-data", digits["test"], "--eval-every", EVERY, "--logdir",
                      logdir, "--vnodes-per-rank", "5,3")
    res = subprocess.run([MPIEXEC, "-n", "2", sys.executable, "-m", "vfgraph.cli", "-v", *map(str, argv)],
                         capture_output=True, text=True, env=MPI_ENV, timeout=300)
    assert res.returncode == 0, res.stderr[-3000:]
    check_metrics(out, digits, res.stdout)
    assert res.stderr.count("validation after step") == STEPS // EVERY  # (rank 0 logs each)
    check_events(logdir, [5, 3])


def test_mistakes_are_one_line_before_the_first_step(v8, digits, tmp_path, capsys):
    out = tmp_path / "out"
    afile = tmp_path / "notes.txt"
    afile.write_text("mine\n")
    only_y = tmp_path / "only_y.npz"
    with np.load(digits["test"]) as z:
        np.savez(only_y, y=z["y"])
        np.savez(tmp_path / "no_label.npz", x=z["x"])
        np.savez(tmp_path / "class_10.npz", x=z["x"], y=np.where(np.arange(len(z["y"])) == 5, 10, z["y"]))
    before = tree_digest(tmp_path)
    cases = [
        (("--eval-data", tmp_path / "missing.npz"), "--eval-data", "no such file"),
        (("--eval-data", digits["test"], "--eval-every", 0), "--eval-every 0", "at least 1"),
        (("--eval-every", 2), "without --eval-data", "give the validation data"),
        (("--logdir", afile), "a file, not a directory", "--logdir"),
        (("--logdir", out / "logs"), "inside the run's output", "outside it"),
        (("--eval-data", only_y), "arrays ['x'] are missing", "'serving_default'"),
        (("--eval-data", tmp_path / "no_label.npz"), "no label array ['y']", "give the validation labels"),
        (("--eval-data", tmp_path / "class_10.npz"), "holds 10 in row 5", "0 <= label < 10"),
    ]
    for extra, *needles in cases:
        one_error(*run_in_process(capsys, *train_argv(v8, digits["train"], out, *extra)), *needles)
        assert not out.exists() and not os.path.exists(str(out) + ".ckpt")
        assert tree_digest(tmp_path) == before
    from vfgraph.errors import InputError
    from vfgraph.runtime.train import train

    with pytest.raises(InputError, match="--eval-every 0"):
        train(v8, digits["train"], STEPS, BATCH, str(out), eval_data=digits["test"], eval_every=0)


def test_keras_file_validates_with_its_compiled_loss_and_metrics(digits, tmp_path, capsys):
    """`vfgraph train m.keras --eval-data`: the compiled loss and metrics (Keras' own objects)
    on the trained model's serving outputs, as Keras computes them."""
    import keras
    import tensorflow as tf

    from conftest import fresh_keras

    fresh_keras()
    keras.utils.set_random_seed(0)
    model = keras.Sequential([keras.Input((64,), name="x"), keras.layers.Dense(10)])
    model.compile(optimizer=keras.optimizers.SGD(0.1),
                  loss=keras.losses.SparseCategoricalCrossentropy(from_logits=True),
                  metrics=["accuracy", keras.metrics.SparseTopKCategoricalAccuracy(k=3, name="top3")])
    path = str(tmp_path / "m.keras")
    model.save(path)
    for split in ("train", "test"):
        with np.load(digits[split]) as z:
            np.savez(tmp_path / f"{split}.npz", x=z["x"], label=z["y"])
    out, logdir = tmp_path / "out", tmp_path / "logs"
    code, err = run_in_process(capsys, "train", path, "--data", tmp_path / "train.npz", "--steps", 4, "--batch-size",
                               64, "-o", out, "--no-progress", "--eval-data", tmp_path / "test.npz", "--logdir",
                               logdir)
    assert code == 0, err
    rec = recorded(str(out))
    assert rec["loss"] == "the compiled loss of the .keras file" and sorted(rec["metrics"]) == ["accuracy", "loss",
                                                                                                 "top3"]
    with np.load(tmp_path / "test.npz") as z:
        x, y = z["x"], z["label"]
    logits = tf.saved_model.load(str(out)).signatures["serving_default"](x=x)["output_0"]
    want = {"loss": keras.losses.SparseCategoricalCrossentropy(from_logits=True)(y, logits),
            "accuracy": keras.metrics.SparseCategoricalAccuracy()(y, logits),
            "top3": keras.metrics.SparseTopKCategoricalAccuracy(k=3)(y, logits)}
    for k, v in want.items():
        assert abs(rec["metrics"][k] - float(v)) <= 1e-6, (k, rec["metrics"][k], float(v))
    validation, _ = scalars(str(logdir), "validation")
    assert sorted(validation) == ["epoch_accuracy", "epoch_loss", "epoch_top3"]
    train_scalars, _ = scalars(str(logdir), "train")
    assert [s for s, _ in train_scalars["batch_accuracy"]] == [1, 2, 3, 4]


@pytest.mark.mpi
def test_pipeline_stages_on_ranks_refuse_validation(models, digits, tmp_path):
    """A step cut into 2 stages on 2 ranks: no rank holds the whole serving signature while
    training; one line, exit 2, before the first step, nothing written."""
    import vfgraph

    model = str(tmp_path / "staged")
    vfgraph.save(vfgraph.rewrite(models("mlp:momentum"), vnodes=8, vnode_batch=8, stages=2), model)
    out = tmp_path / "out"
    argv = train_argv(model, digits["train"], out, "--eval-data", digits["test"])
    res = subprocess.run([MPIEXEC, "-n", "2", sys.executable, "-m", "vfgraph.cli", *map(str, argv)],
                         capture_output=True, text=True, env=MPI_ENV, timeout=300)
    one_error(res.returncode, res.stderr.splitlines(), "pipeline stages on ranks of their own", "leave out --eval-data")
    assert not out.exists() and not os.path.exists(str(out) + ".ckpt")


@pytest.mark.mpi
def test_elastic_job_validates_on_its_ranks_and_logs_their_shares(v8, digits, tmp_path):
    """1 -> 2 ranks at step 3: the validations run on the ranks of the job at the time (the new
    rank too), the trained model's metrics; vnodes/rank_<r> follows the resize."""
    out, logdir = str(tmp_path / "out"), str(tmp_path / "logs")
    argv = train_argv(v8, digits["train"], out, "--eval-data", digits["test"], "--eval-every", EVERY, "--logdir",
                      logdir, "--threads", 1, "--max-ranks", 2, "--elastic-schedule", "0:1,3:2")
    res = subprocess.run([MPIEXEC, "-n", "1", sys.executable, "-m", "vfgraph.cli", "-v", *map(str, argv)],
                         capture_output=True, text=True, env=MPI_ENV, timeout=600)
    assert res.returncode == 0, res.stderr[-3000:]
    assert "resized 1 -> 2 ranks at step 3" in res.stderr, res.stderr[-3000:]
    check_metrics(out, digits, res.stdout)
    train, _ = scalars(logdir, "train")
    assert train["vnodes/rank_0"] == [(1, 8), (2, 8), (3, 8), (4, 4), (5, 4), (6, 4)]
    assert train["vnodes/rank_1"] == [(4, 4), (5, 4), (6, 4)]
    assert [s for s, _ in train["step_time/rank_1"]] == [4, 5, 6]
