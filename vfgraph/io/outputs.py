"""Where vfgraph writes: one rule for every command that writes a model.

- An output is never the input, never contains it and never lies inside it (paths resolved,
  symbolic links followed).
- An existing output is replaced only with ``force``, and only when vfgraph wrote it (a
  SavedModel with vfgraph's record ``assets.extra/vfgraph.json``, a GraphDef vfgraph emitted, a
  training checkpoint directory, a step profile) or it is an empty directory: nothing else is
  ever deleted.
- Writability and free space are checked before the work, and a write that fails on the way
  (disk full) leaves nothing behind and says so in one line.
- What is written is readable as the umask says (temporary directories are made private).
"""
from __future__ import annotations

import contextlib
import errno
import json
import os
import shutil
import tempfile
from typing import Iterable, Iterator, Optional

from vfgraph.errors import OutputError
from vfgraph.io.files import emitted_by_vfgraph
from vfgraph.records import METADATA_FILE

MARKER = METADATA_FILE
PROFILE_FORMAT = "vfgraph-step-profile"  # the "format" of a step profile's JSON file (vfgraph profile)
PROGRESS = "progress.json"  # a training checkpoint directory holds it and step-N.* files
_FULL = (errno.ENOSPC, errno.EDQUOT, errno.EFBIG)


def real(path: str) -> str:
    return os.path.realpath(os.path.abspath(os.fspath(path)))


def _inside(path: str, root: str) -> bool:
    return path.startswith(root.rstrip(os.sep) + os.sep)


def umask() -> int:
    mask = os.umask(0o022)
    os.umask(mask)
    return mask


def written_by_vfgraph(path: str) -> bool:
    """Whether ``path`` is something vfgraph wrote (and so may replace with ``force``), or an
    empty directory."""
    if os.path.isdir(path):
        entries = os.listdir(path)
        if all(e.startswith(("step-", PROGRESS)) for e in entries):  # empty, or a training checkpoint
            return True
        record = _json_record(os.path.join(path, MARKER))
        return bool({"history", "serving_export", "training"} & set(record))
    if os.path.isfile(path) and path.endswith((".pb", ".pbtxt")):
        return emitted_by_vfgraph(path)
    if os.path.isfile(path) and path.endswith(".json"):
        return _json_record(path).get("format") == PROFILE_FORMAT
    return False


def _json_record(path: str) -> dict:
    """The JSON object in the file ``path`` (empty where there is none)."""
    try:
        with open(path) as f:
            record = json.load(f)
    except (OSError, ValueError):
        return {}
    return record if isinstance(record, dict) else {}


def check_output(out: str, inputs: Iterable[Optional[str]] = (), force: bool = False, need_bytes: int = 0,
                 what: str = "output") -> str:
    """Check, before any work, that ``out`` may be written; returns its absolute path.

    Refuses an output that is one of ``inputs``, contains one or lies inside one; an existing
    output without ``force``, or with it when vfgraph did not write it; a symbolic link; a
    parent that is missing, a file or not writable; less free space than ``need_bytes``."""
    out_abs = check_apart(out, inputs)
    if os.path.islink(out_abs):
        raise OutputError(f"{out_abs}: is a symbolic link; give the path it points to, or another output path")
    if os.path.exists(out_abs):
        if not written_by_vfgraph(out_abs):
            raise OutputError(f"{out_abs}: exists and was not written by vfgraph, so it is never replaced; choose "
                              "another output path")
        if not force:
            raise OutputError(f"{out_abs}: {what} exists; choose another path, or pass --force to replace it")
    check_parent(os.path.dirname(out_abs), need_bytes)
    return out_abs


def check_apart(out: str, inputs: Iterable[Optional[str]]) -> str:
    """Refuse an output that is one of ``inputs``, contains one or lies inside one (paths
    resolved, links followed); returns its absolute path."""
    out_abs = os.path.abspath(os.fspath(out))
    out_real = real(out_abs)
    for inp in inputs:
        if not inp:
            continue
        src = real(inp)
        if out_real == src:
            raise OutputError(f"{out_abs}: this is the input {inp}; choose another output path")
        if _inside(src, out_real):
            raise OutputError(f"{out_abs}: contains the input {inp}; choose an output path outside it")
        if _inside(out_real, src):
            raise OutputError(f"{out_abs}: lies inside the input {inp}; choose an output path outside it")
    return out_abs


def check_parent(parent: str, need_bytes: int = 0) -> None:
    """The directory an output goes in exists, is a directory, is writable and has room."""
    probe = parent
    while probe and not os.path.exists(probe):
        probe = os.path.dirname(probe)
    if probe and not os.path.isdir(probe):
        raise OutputError(f"{probe}: is a file, not a directory; choose an output path under a directory")
    if not os.path.isdir(parent):
        raise OutputError(f"{parent}: output directory's parent does not exist; create it first")
    try:  # what access() cannot tell: a read-only file system, or root's view of permissions
        os.rmdir(tempfile.mkdtemp(prefix=".vfgraph-probe-", dir=parent))
    except OSError as e:
        raise OutputError(f"{parent}: cannot write here ({e.strerror}); choose an output path in a writable "
                          "directory") from None
    if need_bytes:
        free = shutil.disk_usage(parent).free
        if free < need_bytes:
            raise OutputError(f"{parent}: {_mib(free)} free, the output needs at least {_mib(need_bytes)}; free "
                              "space or choose another output path")


def _mib(n: int) -> str:
    return f"{n / (1 << 20):.1f} MiB"


def size_text(n: int) -> str:
    """``n`` bytes for people: ``512 B``, ``24.0 KiB``, ``1.5 GiB``."""
    for unit in ("B", "KiB", "MiB", "GiB"):
        if n < 1024 or unit == "GiB":
            return f"{n} {unit}" if unit == "B" else f"{n:.1f} {unit}"
        n /= 1024
    return str(n)


def tree_bytes(*paths: Optional[str]) -> int:
    """Bytes of the files under ``paths`` (files or directories; missing ones count nothing)."""
    total = 0
    for p in paths:
        if not p:
            continue
        if os.path.isfile(p):
            total += os.path.getsize(p)
        for root, _, files in os.walk(p):
            total += sum(os.path.getsize(os.path.join(root, f)) for f in files
                         if not os.path.islink(os.path.join(root, f)))
    return total


def temp_dir(parent: str, prefix: str) -> str:
    """A new directory in ``parent`` for an output being written, with the mode the umask
    gives a new directory (``mkdtemp`` makes it private, and a rename would keep that)."""
    path = tempfile.mkdtemp(prefix=prefix, dir=parent)
    os.chmod(path, 0o777 & ~umask())
    return path


def publish(tmp: str, out: str) -> None:
    """Move the finished directory ``tmp`` to ``out`` (in the same parent), its files and
    directories readable as the umask says (copies keep their source's modes), replacing an
    existing ``out`` only once ``tmp`` is complete."""
    mask = umask()
    for root, dirs, files in os.walk(tmp):
        os.chmod(root, 0o777 & ~mask)
        for f in files:
            os.chmod(os.path.join(root, f), 0o666 & ~mask)
    if os.path.exists(out):
        old = tempfile.mkdtemp(prefix=".vfgraph-old-", dir=os.path.dirname(out) or ".")
        os.rename(out, os.path.join(old, "x"))
        os.rename(tmp, out)
        shutil.rmtree(old, ignore_errors=True)
    else:
        os.rename(tmp, out)


def write_file(out: str, data: bytes) -> None:
    """Write ``data`` to the file ``out`` whole or not at all: through a temporary file beside
    it, readable as the umask says, renamed over ``out`` once complete."""
    fd, tmp = tempfile.mkstemp(prefix=".vfgraph-", dir=os.path.dirname(os.path.abspath(out)))
    with writing(out, tmp):
        with os.fdopen(fd, "wb") as f:
            f.write(data)
        os.chmod(tmp, 0o666 & ~umask())
        os.replace(tmp, out)


def is_disk_full(e: BaseException) -> bool:
    if isinstance(e, OSError):
        return e.errno in _FULL
    text = str(getattr(e, "message", e))
    return any(s in text for s in ("No space left", "Disk quota exceeded", "File too large"))


@contextlib.contextmanager
def writing(out: str, tmp: Optional[str] = None) -> Iterator[None]:
    """Write ``out`` (through ``tmp``): on any failure ``tmp`` is removed; a full disk (or a
    file-size or quota limit) becomes one line, with nothing left behind."""
    try:
        yield
    except BaseException as e:
        if tmp is not None:
            shutil.rmtree(tmp, ignore_errors=True) if os.path.isdir(tmp) else _remove(tmp)
        if is_disk_full(e):
            reason = e.strerror if isinstance(e, OSError) and e.strerror else "no space left on the device"
            raise OutputError(f"{out}: writing failed ({reason}); nothing was written. Free space (or raise the "
                              "limit) and run again") from None
        raise


def _remove(path: str) -> None:
    with contextlib.suppress(OSError):
        os.remove(path)
