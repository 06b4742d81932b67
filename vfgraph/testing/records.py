"""Writing test and benchmark data as TFRecord and ArrayRecord files of ``tf.train.Example``
records fast: each example's bytes are a template's with the feature values put in, framed
(length, data and their masked CRC-32C) with numpy, so a million examples take seconds."""
from __future__ import annotations

import os
from typing import List

import numpy as np

from vfgraph.runtime.sources import masked_crc32c


def _template(d: int, y: int) -> bytes:
    import tensorflow as tf

    x = (np.arange(d, dtype=np.float32) + 0.5)
    return tf.train.Example(features=tf.train.Features(feature={
        "x": tf.train.Feature(float_list=tf.train.FloatList(value=x)),
        "y": tf.train.Feature(int64_list=tf.train.Int64List(value=[y]))})).SerializeToString()


def examples(x: np.ndarray, y: np.ndarray) -> np.ndarray:
    """The serialized ``tf.train.Example`` of each row (x: float32 features, y: an int64 label
    between 0 and 127), as the rows of a uint8 array."""
    x = np.ascontiguousarray(x.reshape(len(x), -1), dtype=np.float32)
    if len(y) and (y.min() < 0 or y.max() > 127):
        raise ValueError("labels must lie between 0 and 127 (one byte each)")
    d = x.shape[1]
    one, two = np.frombuffer(_template(d, 1), np.uint8), np.frombuffer(_template(d, 2), np.uint8)
    at_x = bytes(one).index((np.arange(d, dtype=np.float32) + 0.5).tobytes())
    at_y = int(np.flatnonzero(one != two)[0])
    rows = np.repeat(one[None, :], len(x), axis=0)
    rows[:, at_x:at_x + 4 * d] = x.view(np.uint8).reshape(len(x), 4 * d)
    rows[:, at_y] = y.astype(np.uint8)
    return rows


def framed(rows: np.ndarray) -> bytes:
    """The TFRecord file holding the records ``rows`` (a uint8 array, one record a row)."""
    n, length = rows.shape
    head = np.full((n, 1), length, dtype="<u8").view(np.uint8)
    head_crc = masked_crc32c(head).astype("<u4").reshape(n, 1).view(np.uint8)
    data_crc = masked_crc32c(rows).astype("<u4").reshape(n, 1).view(np.uint8)
    return np.concatenate([head, head_crc, rows, data_crc], axis=1).tobytes()


def write_tfrecords(prefix: str, x: np.ndarray, y: np.ndarray, shards: int = 1, chunk: int = 100_000) -> List[str]:
    """Write the examples (x, y) in order to ``shards`` TFRecord files ``PREFIX-00000-of-0000S.tfrecord``;
    their paths."""
    paths = []
    for s, part in enumerate(np.array_split(np.arange(len(x)), shards)):
        path = f"{prefix}-{s:05d}-of-{shards:05d}.tfrecord"
        with open(path, "wb") as f:
            for lo in range(0, len(part), chunk):
                idx = part[lo:lo + chunk]
                f.write(framed(examples(x[idx], y[idx])))
        paths.append(path)
    return paths


def write_array_records(prefix: str, x: np.ndarray, y: np.ndarray, shards: int = 1) -> List[str]:
    """Write the examples (x, y) in order to ``shards`` ArrayRecord files (one record per
    group, for random access); their paths."""
    from array_record.python.array_record_module import ArrayRecordWriter

    paths = []
    for s, part in enumerate(np.array_split(np.arange(len(x)), shards)):
        path = f"{prefix}-{s:05d}-of-{shards:05d}.array_record"
        if os.path.exists(path):
            os.remove(path)
        w = ArrayRecordWriter(path, "group_size:1")
        for row in examples(x[part], y[part]):
            w.write(row.tobytes())
        w.close()
        paths.append(path)
    return paths
