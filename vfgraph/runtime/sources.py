"""Training data read by example index: ``len(source)`` examples, ``source.read(indices)`` the
examples at the sorted ``indices``, by input, reading and decoding only those. Random access by
index is what lets every rank read only the examples of its own virtual nodes, and every layout
of ranks read the same global batches.

- TFRecord shards of ``tf.train.Example`` (:class:`TFRecordSource`): an index of record offsets,
  built from the record headers alone (each length's masked CRC-32C checked), each example read
  at its offset and its data's CRC-32C checked (``google-crc32c``); a batch of records is
  decoded by one ``tf.io.parse_example`` call.
- ArrayRecord files (:class:`ArrayRecordSource`, the ``array_record`` library's exact random
  access) of serialized ``tf.train.Example`` records: the same decoding.
- ``.npz`` files (:class:`ArraySource`): small data, loaded once.
"""
from __future__ import annotations

import glob
import hashlib
import os
import re
import struct
import threading
from array import array
from typing import Dict, List, Optional, Sequence

import numpy as np

from vfgraph.errors import InputError

TFRECORD = (".tfrecord", ".tfrecords", ".tfr")
ARRAY_RECORD = (".array_record", ".arrayrecord")
_MASK_DELTA = 0xA282EAD8


def _crc32c_table() -> np.ndarray:
    table = np.zeros(256, dtype=np.uint32)
    for i in range(256):
        c = i
        for _ in range(8):
            c = (c >> 1) ^ 0x82F63B78 if c & 1 else c >> 1
        table[i] = c
    return table


_TABLE = _crc32c_table()


def masked_crc32c(rows: np.ndarray) -> np.ndarray:
    """The masked CRC-32C (as TFRecord headers hold it) of each row of the uint8 array ``rows``."""
    crc = np.full(len(rows), 0xFFFFFFFF, dtype=np.uint32)
    for j in range(rows.shape[1]):
        crc = _TABLE[(crc ^ rows[:, j]) & 0xFF] ^ (crc >> np.uint32(8))
    crc ^= np.uint32(0xFFFFFFFF)
    rotated = ((crc >> np.uint32(15)) | (crc << np.uint32(17))).astype(np.uint64)
    return ((rotated + _MASK_DELTA) & 0xFFFFFFFF).astype(np.uint32)


def load_npz(path: str) -> Dict[str, np.ndarray]:
    """The arrays of the .npz file at ``path``; one line for a missing, truncated or damaged file."""
    import zipfile

    try:
        with np.load(path, allow_pickle=False) as z:
            return {k: z[k] for k in z.files}
    except FileNotFoundError:
        raise InputError(f"{path}: no such data file") from None
    except (ValueError, OSError, EOFError, zipfile.BadZipFile) as e:
        raise InputError(f"{path}: not a readable .npz file ({str(e).strip() or type(e).__name__}); if it was "
                         "copied or written by a run that stopped, write it again") from None


def data_fingerprint(data: Dict[str, np.ndarray]) -> str:
    h = hashlib.sha256()
    for k in sorted(data):
        a = np.ascontiguousarray(data[k])
        h.update(f"{k}:{a.dtype.str}:{a.shape};".encode())
        h.update(memoryview(a).cast("B"))
    return h.hexdigest()


def data_digest(data: Dict[str, np.ndarray], files: List[str], examples: int = 64, most: int = 1 << 20) -> str:
    """A digest of the training data that takes every rank milliseconds whatever the data's
    size (the data is read once, to train on): the data files' sizes, each array's name,
    dtype and shape, and the bytes of up to ``examples`` examples of each array (``most``
    bytes at most), evenly spaced from its first to its last. Not covered: the files' paths
    and times (copies on different hosts are the same data), and a difference only in
    examples it does not sample in files of the same sizes (rank 0's checkpoint record hashes
    all of the data)."""
    h = hashlib.sha256()
    for f in files:
        h.update(f"{os.path.getsize(f) if os.path.isfile(f) else -1};".encode())
    for k in sorted(data):
        a = data[k]
        h.update(f"{k}:{a.dtype.str}:{a.shape};".encode())
        if not len(a):
            continue
        count = int(min(len(a), examples, max(1, most // max(1, a[:1].nbytes))))
        rows = np.unique(np.linspace(0, len(a) - 1, count).astype(np.int64))
        sample = a[rows]
        if sample.dtype.kind == "O":  # (strings from TFRecord files)
            for x in sample.ravel():
                h.update(x if isinstance(x, bytes) else repr(x).encode())
                h.update(b"\0")
        else:
            h.update(np.ascontiguousarray(sample).tobytes())
    return h.hexdigest()


def data_files(path: str) -> List[str]:
    """The files of the data at ``path``: those a glob pattern matches, or the one path given."""
    return sorted(glob.glob(path)) if glob.has_magic(path) else [path]


def is_records(path: str) -> bool:
    """``path`` names TFRecord or ArrayRecord files (a glob pattern, or a name ending like them)."""
    return path.endswith(TFRECORD + ARRAY_RECORD) or glob.has_magic(path)


def open_source(path: str, specs) -> "Source":
    """The data at ``path`` for the inputs ``specs`` (name -> TensorSpec; None: read raw, for
    ``--input-fn``): an .npz file, TFRecord files or ArrayRecord files (a path or a glob
    pattern) of ``tf.train.Example`` records."""
    if not is_records(path):
        return ArraySource(path, load_npz(path))
    files = data_files(path)
    if not files or not all(os.path.isfile(f) for f in files):
        raise InputError(f"{path}: no such TFRecord or ArrayRecord file")
    if all(f.endswith(ARRAY_RECORD) for f in files):
        return ArrayRecordSource(path, files, specs)
    return TFRecordSource(path, files, specs)


class Source:
    """Examples by index. ``decoded``: the examples read so far, ``bytes_read``: their bytes."""

    path: str
    files: List[str]
    decoded: int = 0
    bytes_read: int = 0

    def __len__(self) -> int:
        raise NotImplementedError

    def read(self, indices: np.ndarray) -> Dict[str, np.ndarray]:
        """The examples at the sorted ``indices``, by input."""
        raise NotImplementedError

    def raw(self, indices: np.ndarray) -> list:
        """The examples at the sorted ``indices`` as stored, undecoded (for ``--input-fn``)."""
        raise NotImplementedError

    def fingerprint(self) -> str:
        """A hash of the data, recorded with a checkpoint (--resume requires the same)."""
        raise NotImplementedError

    def digest(self) -> str:
        """A hash every rank computes in milliseconds, compared between the ranks of a job."""
        raise NotImplementedError


class ArraySource(Source):
    """The arrays of an .npz file, in memory."""

    def __init__(self, path: str, arrays: Dict[str, np.ndarray]):
        self.path, self.files, self.arrays = path, [path], arrays

    def __len__(self) -> int:
        return len(next(iter(self.arrays.values()))) if self.arrays else 0

    def read(self, indices: np.ndarray) -> Dict[str, np.ndarray]:
        self.decoded += len(indices)
        return {k: v[indices] for k, v in self.arrays.items()}

    def raw(self, indices: np.ndarray) -> list:
        """Each example's row of every array, by the arrays' names."""
        self.decoded += len(indices)
        return [{k: v[i] for k, v in self.arrays.items()} for i in indices]

    def fingerprint(self) -> str:
        return data_fingerprint(self.arrays)

    def digest(self) -> str:
        return data_digest(self.arrays, self.files)


class RecordSource(Source):
    """Serialized ``tf.train.Example`` records by index (``starts[i]``: the index of file i's
    first record), decoded into the inputs ``specs`` by one ``tf.io.parse_example`` per read
    (``specs`` None: only read, :meth:`raw`, for ``--input-fn`` to decode)."""

    kind = "records"

    def __init__(self, path: str, files: List[str], specs):
        self.path, self.files, self.specs = path, files, specs
        self.features = _features(specs) if specs is not None else None
        self.lock = threading.Lock()
        self.starts = np.zeros(1, dtype=np.int64)

    def __len__(self) -> int:
        return int(self.starts[-1])

    def serialized(self, file: int, local: np.ndarray) -> List[bytes]:
        """The records ``local`` (sorted indices within file ``file``)."""
        raise NotImplementedError

    def where(self, index: int) -> str:
        """Where example ``index`` lies: its file and its record in it."""
        f = int(np.searchsorted(self.starts, index, side="right")) - 1
        return f"record {index - int(self.starts[f])} of {self.files[f]}"

    def raw(self, indices: np.ndarray) -> List[bytes]:
        """The serialized records at the sorted ``indices``, each checked, counted as read."""
        indices = np.asarray(indices, dtype=np.int64)
        which = np.searchsorted(self.starts, indices, side="right") - 1
        records: List[bytes] = []
        with self.lock:
            for f in np.unique(which):
                records += self.serialized(int(f), indices[which == f] - self.starts[f])
            self.decoded += len(records)
            self.bytes_read += sum(len(r) for r in records)
        return records

    def read(self, indices: np.ndarray) -> Dict[str, np.ndarray]:
        import tensorflow as tf

        indices = np.asarray(indices, dtype=np.int64)
        records = self.raw(indices)
        try:
            parsed = tf.io.parse_example(tf.constant(records, dtype=tf.string), self.features)
        except (tf.errors.InvalidArgumentError, tf.errors.DataLossError) as e:
            bad = _first_bad(records, self.features)
            at = self.where(int(indices[bad])) if bad is not None else f"records of {self.path}"
            said = re.sub(r"^\{\{function_node [^}]*\}\}\s*|\s*\[Op:\w+\]$|Name: <unknown>,\s*", "",
                          e.message.splitlines()[0]).strip()
            wants = ", ".join(f"{k} {self.features[k].dtype.name}{list(self.features[k].shape)}" for k in sorted(
                self.features))
            raise InputError(f"{at}: does not hold the features of the training signature ({wants}): {said}; write "
                             "the records with those features") from None
        return {k: v.numpy() for k, v in parsed.items()}

    def _hash(self, sizes: Sequence[int], examples: int) -> str:
        h = hashlib.sha256(f"{self.kind}:{len(self)};".encode())
        for size in sizes:
            h.update(f"{size};".encode())
        if len(self):
            rows = np.unique(np.linspace(0, len(self) - 1, min(len(self), examples)).astype(np.int64))
            which = np.searchsorted(self.starts, rows, side="right") - 1
            with self.lock:
                for f in np.unique(which):
                    for r in self.serialized(int(f), rows[which == f] - self.starts[f]):
                        h.update(r)
        return h.hexdigest()

    def fingerprint(self) -> str:
        """The record count, the files' sizes and 1,024 records evenly spaced over the data."""
        return self._hash([os.path.getsize(f) for f in self.files], 1024)

    def digest(self) -> str:
        """The record count, the files' sizes and 64 records evenly spaced over the data."""
        return self._hash([os.path.getsize(f) for f in self.files], 64)


def _features(specs) -> dict:
    """The ``tf.io.FixedLenFeature`` of each input of ``specs``: float32, int64 or string."""
    import tensorflow as tf

    features = {}
    for k, spec in specs.items():
        dtype = tf.float32 if spec.dtype.is_floating else tf.string if spec.dtype == tf.string else tf.int64
        if not spec.shape[1:].is_fully_defined():
            raise InputError(f"input {k!r} has shape {spec.shape}: TFRecord features need a fixed per-example "
                             "shape; convert the data to .npz")
        features[k] = tf.io.FixedLenFeature(spec.shape[1:], dtype)
    return features


def _first_bad(records: List[bytes], features: dict) -> Optional[int]:
    """The first of ``records`` that does not parse alone (None: each does)."""
    import tensorflow as tf

    for i, r in enumerate(records):
        try:
            tf.io.parse_example(tf.constant([r]), features)
        except (tf.errors.InvalidArgumentError, tf.errors.DataLossError):
            return i
    return None


class TFRecordSource(RecordSource):
    """TFRecord files: an index of (file, offset) per record, from the headers (``offsets[f]``:
    those of file f's records, and the file's size)."""

    kind = "tfrecord"

    def __init__(self, path: str, files: List[str], specs):
        super().__init__(path, files, specs)
        self.offsets = [scan_tfrecord(f)[0] for f in files]
        self.starts = np.concatenate([[0], np.cumsum([len(o) - 1 for o in self.offsets])]).astype(np.int64)
        self.fds: Dict[int, int] = {}

    def serialized(self, file: int, local: np.ndarray) -> List[bytes]:
        """The records ``local`` of file ``file``, each read at its offset, its data's masked
        CRC-32C checked (as TensorFlow's reader does: a damaged record is one line, not garbage)."""
        import google_crc32c

        fd = self.fds.get(file)
        if fd is None:
            fd = self.fds[file] = os.open(self.files[file], os.O_RDONLY)
        offsets, out = self.offsets[file], []
        for i in local:
            start, end = int(offsets[i]), int(offsets[i + 1])
            record = os.pread(fd, end - start, start)
            data = record[12:-4]
            if len(record) != end - start or struct.unpack_from("<I", record, len(record) - 4)[0] != _masked(
                    google_crc32c.value(data)):
                raise InputError(f"{self.files[file]}: record {int(i)} (byte {start}) is damaged (its data fails "
                                 "its checksum, or the file changed since the run began); write the file again")
            out.append(data)
        return out


def _masked(crc: int) -> int:
    return (((crc >> 15) | (crc << 17)) + _MASK_DELTA) & 0xFFFFFFFF


def scan_tfrecord(path: str, window: int = 1 << 20) -> "tuple[np.ndarray, np.ndarray]":
    """(offsets, lengths): the offset of each record of the TFRecord file ``path`` and the file's
    size after them, and the length of each record's data, from its headers (each
    record: length, the length's masked CRC-32C, the data, the data's masked CRC-32C), read in
    windows of ``window`` bytes; one line for a file cut short or a damaged header."""
    size = os.path.getsize(path)
    offsets, lengths, crcs = array("q"), array("q"), array("I")
    headers = bytearray()
    unpack = struct.Struct("<QI").unpack_from
    fd = os.open(path, os.O_RDONLY)
    try:
        buf, base, pos = b"", 0, 0
        while pos < size:
            if pos + 12 > base + len(buf):
                base, buf = pos, os.pread(fd, window, pos)
                if len(buf) < 12:
                    raise InputError(f"{path}: cut short at byte {pos} of {size} (record {len(offsets)}); the file "
                                     "is damaged or still being written: write it again")
            length, crc = unpack(buf, pos - base)
            offsets.append(pos)
            lengths.append(length)
            crcs.append(crc)
            headers += buf[pos - base:pos - base + 8]
            pos += 16 + length
    finally:
        os.close(fd)
    offsets.append(pos)
    offsets_a, lengths_a = np.frombuffer(offsets, dtype=np.int64), np.frombuffer(lengths, dtype=np.int64)
    if len(lengths_a):
        bad = np.flatnonzero(masked_crc32c(np.frombuffer(bytes(headers), np.uint8).reshape(-1, 8))
                             != np.frombuffer(crcs, dtype=np.uint32))
        if len(bad):
            raise InputError(f"{path}: record {int(bad[0])} (byte {int(offsets_a[bad[0]])}) has a damaged header (its "
                             "length fails its checksum); the file is not a TFRecord file or is corrupted: write it "
                             "again")
    if pos != size:
        raise InputError(f"{path}: cut short in record {len(lengths_a) - 1} (it ends at byte {pos}, the file has "
                         f"{size}); the file is damaged or still being written: write it again")
    return offsets_a, lengths_a


class ArrayRecordSource(RecordSource):
    """ArrayRecord files (``array_record``), read by record index."""

    kind = "array_record"

    def __init__(self, path: str, files: List[str], specs):
        super().__init__(path, files, specs)
        try:
            from array_record.python.array_record_module import ArrayRecordReader
        except ImportError:
            raise InputError(f"{path}: ArrayRecord files need the array-record package: pip install array-record") \
                from None
        self.readers = []
        for f in files:
            try:
                reader = ArrayRecordReader(f, "readahead_buffer_size:0")
                ok = reader.ok()
            except Exception as e:  # (the library raises RuntimeError or ValueError for some damaged files)
                ok, reader = False, str(e).strip().splitlines()[0]
            if not ok:
                said = f" ({reader})" if isinstance(reader, str) else ""
                raise InputError(f"{f}: not a readable ArrayRecord file{said}: it is damaged, cut short or of "
                                 "another format; write it again")
            self.readers.append(reader)
        self.starts = np.concatenate([[0], np.cumsum([r.num_records() for r in self.readers])]).astype(np.int64)

    def serialized(self, file: int, local: np.ndarray) -> List[bytes]:
        try:
            return list(self.readers[file].read([int(i) for i in local]))
        except Exception as e:
            raise InputError(f"{self.files[file]}: records cannot be read ({str(e).strip().splitlines()[0]}); "
                             "write the file again") from None
