"""Input read by virtual node: TFRecord shards and ArrayRecord files train bit-identical to the
same data as .npz (deterministic mode) on 1 and 2 ranks, each rank reading only the examples
of its rows; a run from TFRecord input interrupted and resumed, or resized 1 -> 2 -> 1 ranks,
ends as one uninterrupted rank does; damaged or unfit data is one line before the first step;
memory does not grow with the data's size."""
import os
import re
import subprocess
import sys

import numpy as np
import pytest

from test_mpi_train import ENV, losses, params, rewritten, run_train, train_cmd
from test_train_safety import interrupted
from vfgraph.testing.cli import one_error, run_in_process
from vfgraph.testing.records import examples, framed, write_array_records, write_tfrecords

pytestmark = pytest.mark.mpi

READ = re.compile(r"(?:rank (\d): )?read (\d+) examples \((\d+) bytes\) of the (\d+)")


@pytest.fixture(scope="module")
def exact(models, tmp_path_factory):
    """Models rewritten with 8 virtual nodes of 8 examples, the all-reduce and exact sums."""
    return rewritten(models, tmp_path_factory.mktemp("streaming"), deterministic=True)


@pytest.fixture(scope="module")
def shards(digits, tmp_path_factory):
    """The digits training data as 3 TFRecord shards and as 2 ArrayRecord files (globs)."""
    root = tmp_path_factory.mktemp("streaming_data")
    with np.load(digits["train"]) as z:
        x, y = z["x"], z["y"]
    write_tfrecords(str(root / "train"), x, y, shards=3)
    write_array_records(str(root / "train"), x, y, shards=2)
    return {"tfrecord": str(root / "train-*.tfrecord"), "array_record": str(root / "train-*.array_record")}


def same(reference: str, out: str) -> None:
    want, got = params(reference), params(out)
    differ = [k for k in want if not np.array_equal(want[k], got[k])]
    assert not differ, f"{differ[:3]} differ from {reference}"
    assert losses(out) == losses(reference)


def reads(stderr: str) -> dict:
    """rank -> (examples, bytes) read, from the runs' log lines."""
    return {int(r or 0): (int(n), int(b)) for r, n, b, _ in READ.findall(stderr)}


def test_records_train_bit_identical_to_npz_each_rank_reading_its_rows(exact, digits, shards, tmp_path):
    model = exact("mlp:adam")
    steps = 4
    run_train(0, model, digits["train"], str(tmp_path / "npz"), steps)
    one = run_train(0, model, shards["tfrecord"], str(tmp_path / "tfr1"), steps)
    uneven = run_train(2, model, shards["tfrecord"], str(tmp_path / "tfr2"), steps, "--vnodes-per-rank", "5,3")
    array = run_train(2, model, shards["array_record"], str(tmp_path / "ar2"), steps)
    for name in ("tfr1", "tfr2", "ar2"):
        same(str(tmp_path / "npz"), str(tmp_path / name))
    # each rank decodes the examples of its virtual nodes and no others: 5 and 3 of 8 examples
    assert reads(one.stderr)[0][0] == steps * 64
    got = reads(uneven.stderr)
    assert {r: n for r, (n, _) in got.items()} == {0: steps * 40, 1: steps * 24}, uneven.stderr[-2000:]
    record = len(examples(np.zeros((1, 64), np.float32), np.zeros(1, np.int64))[0])
    assert got[0][1] == steps * 40 * record and got[1][1] == steps * 24 * record
    assert {r: n for r, (n, _) in reads(array.stderr).items()} == {0: steps * 32, 1: steps * 32}


def test_interrupted_and_resumed_from_tfrecord_is_bit_identical(exact, digits, shards, tmp_path):
    """Stopped (SIGINT) in the second epoch of 22 steps and resumed: as one uninterrupted run."""
    model, steps = exact("mlp:adam"), 300
    cmd = ["train", model, "--data", shards["tfrecord"], "--steps", steps, "--batch-size", 64, "--checkpoint-every",
           7, "--no-progress", "--threads", "1"]
    stopped = interrupted([*cmd, "-o", tmp_path / "a"], tmp_path / "a.ckpt" / "progress.json", 30)
    assert 30 <= stopped < steps
    res = subprocess.run([sys.executable, "-m", "vfgraph.cli", *map(str, cmd), "-o", tmp_path / "a", "--resume"],
                         capture_output=True, text=True, env=ENV, timeout=300)
    assert res.returncode == 0, res.stderr[-3000:]
    run_train(0, model, digits["train"], str(tmp_path / "one"), steps, "--threads", "1")
    same(str(tmp_path / "one"), str(tmp_path / "a"))


def test_elastic_one_two_one_from_tfrecord_is_bit_identical(exact, digits, shards, tmp_path):
    model = exact("mlp:adam")
    run_train(0, model, digits["train"], str(tmp_path / "one"), 9, "--threads", "1")
    res = run_train(1, model, shards["tfrecord"], str(tmp_path / "elastic"), 9, "--threads", "1", "--max-ranks", "2",
                    "--elastic-schedule", "0:1,3:2,6:1", timeout=600)
    resized = re.findall(r"resized (\d) -> (\d) ranks at step (\d+)", res.stderr)
    assert resized == [("1", "2", "3"), ("2", "1", "6")], res.stderr[-3000:]
    same(str(tmp_path / "one"), str(tmp_path / "elastic"))


def write(path, rows: np.ndarray) -> str:
    with open(path, "wb") as f:
        f.write(framed(rows))
    return str(path)


def digits_rows(digits, n: int) -> np.ndarray:
    with np.load(digits["train"]) as z:
        return examples(z["x"][:n], z["y"][:n])


def test_unfit_or_damaged_records_are_one_line_before_the_first_step(rewritten, digits, capsys, tmp_path):
    import tensorflow as tf

    model = rewritten("mlp:sgd", 2, 16)
    good = write(tmp_path / "good.tfrecord", digits_rows(digits, 100))
    data = open(good, "rb").read()
    (tmp_path / "cut.tfrecord").write_bytes(data[:-5])
    header = bytearray(data)
    header[3 * (len(data) // 100) + 1] ^= 0xFF  # record 3's length
    (tmp_path / "header.tfrecord").write_bytes(bytes(header))
    payload = bytearray(data)
    payload[len(data) // 100 + 40] ^= 0xFF  # a byte of record 1's features
    (tmp_path / "payload.tfrecord").write_bytes(bytes(payload))
    with open(tmp_path / "no_y.tfrecord", "wb") as f:
        f.write(framed(np.frombuffer(tf.train.Example(features=tf.train.Features(feature={
            "x": tf.train.Feature(float_list=tf.train.FloatList(value=np.zeros(64)))})).SerializeToString(),
            np.uint8)[None].repeat(40, axis=0)))
    write(tmp_path / "small.tfrecord", digits_rows(digits, 20))
    with np.load(digits["train"]) as z:
        whole = open(write_array_records(str(tmp_path / "ar"), z["x"][:100], z["y"][:100])[0], "rb").read()
    (tmp_path / "cut.array_record").write_bytes(whole[:len(whole) // 2])
    write(tmp_path / "short_x.tfrecord", examples(np.zeros((40, 32), np.float32), np.zeros(40, np.int64)))
    with open(tmp_path / "float_y.tfrecord", "wb") as f:
        f.write(framed(np.frombuffer(tf.train.Example(features=tf.train.Features(feature={
            "x": tf.train.Feature(float_list=tf.train.FloatList(value=np.zeros(64))),
            "y": tf.train.Feature(float_list=tf.train.FloatList(value=[1.5]))})).SerializeToString(),
            np.uint8)[None].repeat(40, axis=0)))
    cases = {"cut.tfrecord": ["cut short in record 99"], "header.tfrecord": ["record 3", "damaged header"],
             "payload.tfrecord": ["record 1 ", "is damaged", "write the file again"],
             "no_y.tfrecord": ["record 0 of", "does not hold the features", "y int64[]", "x float32[64]"],
             "small.tfrecord": ["--batch-size 32", "the 20 examples"],
             "short_x.tfrecord": ["record 0 of", "does not hold the features", "Values size: 32"],
             "float_y.tfrecord": ["record 0 of", "does not hold the features", "y"],
             "cut.array_record": ["not a readable ArrayRecord file", "write it again"]}
    for name, needles in cases.items():
        code, err = run_in_process(capsys, "train", model, "--data", tmp_path / name, "--steps", 1, "--batch-size", 32,
                                   "-o", tmp_path / "o", "--no-progress")
        one_error(code, err, name, *needles)
        assert not any("Traceback" in line for line in err)
    assert not (tmp_path / "o").exists() and not (tmp_path / "o.ckpt").exists()


def peak_kib(cmd) -> int:
    """The peak resident memory (KiB) of the process ``cmd`` runs, which must succeed."""
    code = ("import resource, subprocess, sys; r = subprocess.run(sys.argv[1:], capture_output=True, text=True); "
            "sys.stderr.write(r.stderr[-2000:] if r.returncode else ''); "
            "print(resource.getrusage(resource.RUSAGE_CHILDREN).ru_maxrss); sys.exit(r.returncode)")
    res = subprocess.run([sys.executable, "-c", code, *cmd], capture_output=True, text=True, env=ENV, timeout=300)
    assert res.returncode == 0, res.stderr
    return int(res.stdout.split()[-1])


def test_memory_does_not_grow_with_the_data(rewritten, tmp_path):
    """10x the examples (200k vs 20k of 64 floats, 15 MB of them more than the whole small
    data's 5 MB): the same peak memory within 10 MB (the index takes 1.6 MB)."""
    model = rewritten("mlp:sgd", 2, 16)
    rng = np.random.default_rng(0)
    x, y = rng.random((200_000, 64), dtype=np.float32), rng.integers(0, 10, 200_000)
    write_tfrecords(str(tmp_path / "big"), x, y, shards=4)
    write_tfrecords(str(tmp_path / "small"), x[:20_000], y[:20_000], shards=4)
    peaks = {}
    for name in ("small", "big"):
        cmd = train_cmd(0, model, str(tmp_path / f"{name}-*.tfrecord"), str(tmp_path / f"o_{name}"), 5)
        peaks[name] = peak_kib([c if c != "64" else "32" for c in cmd])
    print("peak resident KiB", peaks)
    assert peaks["big"] - peaks["small"] < 10 * 1024, peaks
    os.remove(tmp_path / "big-00000-of-00004.tfrecord")  # (the data of 200k examples: 60 MB)


def test_feeds_follow_a_changed_share_and_hold_a_few_steps(digits, tmp_path):
    """Each feed equals the .npz batch's rows, before and after the rows change (a new share);
    the feeds prepared for the old rows are dropped, at most 3 held at a time."""
    import tensorflow as tf

    from vfgraph.runtime.data import TrainData, batches_for

    with np.load(digits["train"]) as z:
        arrays = {"x": z["x"], "y": z["y"]}
    write_tfrecords(str(tmp_path / "d"), arrays["x"], arrays["y"], shards=2)
    specs = {"x": tf.TensorSpec([None, 64], tf.float32), "y": tf.TensorSpec([None], tf.int32)}
    data = TrainData.load(str(tmp_path / "d-*.tfrecord"), specs, "train", 64, 3, steps=40)
    assert data.source.decoded == 0  # (the records checked before the first step are not counted)
    for step in range(40):
        lo, hi = (0, 32) if step < 25 else (16, 48)  # 22 steps an epoch: the rows change in the second
        got = data.feed(step, lo, hi)
        want = batches_for(arrays, ["x", "y"], 64, step, 3)
        assert all(np.array_equal(got[k], want[k][lo:hi]) and got[k].dtype == want[k].dtype for k in want), step
        assert len(data.prefetch.pending) <= 3
    assert 40 * 32 <= data.source.decoded <= 40 * 32 + 3 * 32
