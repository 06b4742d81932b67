"""Where vfgraph writes: one rule for every command that writes a model.

- An output is never the input, never contains it and never lies inside it (paths resolved,
  symbolic links followed).
- An existing output is replaced only with ``force``, and only what vfgraph wrote is replaced:
  a GraphDef vfgraph emitted, a step profile, an empty directory, or a directory whose every
  entry vfgraph wrote. Each directory vfgraph writes (a SavedModel, training's ``OUT``, its
  checkpoint directory ``OUT.ckpt``, a serving version ``DIR/N``) holds a manifest,
  ``vfgraph-manifest.json``, listing every file and directory vfgraph put in it (TensorFlow's
  loaders ignore it); ``force`` removes exactly those. Anything else in the directory (a
  user's notes, photos) makes the command refuse, naming the first such file, before any
  work. A directory written before manifests existed counts as vfgraph's only when every
  entry is one vfgraph writes by name: a SavedModel with vfgraph's record
  ``assets.extra/vfgraph.json`` and only ``saved_model.pb``, ``fingerprint.pb``,
  ``variables/variables.{index,data-*}``, ``assets/`` and that record; a checkpoint
  directory with only ``progress.json`` and ``step-N.*`` / ``step-N-stage-K.*`` files.
  Nothing else is ever deleted.
- An output is locked while a command writes it: ``flock`` on ``OUT.lock`` beside it, whose
  file names the process (pid, host, command line, whether it is an elastic training job),
  held until the command ends (the system releases it when the process dies) and removed
  then. A second command on the same output stops at once, naming the first one's pid.
  Under ``mpiexec`` rank 0 holds the job's lock. ``vfgraph resize`` reads the lock to tell a
  running elastic job from none.
- Writability and free space are checked before the work, and a write that fails on the way
  (disk full) leaves nothing behind and says so in one line.
- What is written is readable as the umask says (temporary directories are made private).
"""
from __future__ import annotations

import contextlib
import errno
import fcntl
import json
import logging
import os
import re
import shutil
import socket
import sys
import tempfile
import time
from typing import Dict, Iterable, Iterator, List, Optional

from vfgraph.errors import OutputError
from vfgraph.io.files import emitted_by_vfgraph
from vfgraph.records import METADATA_FILE

MARKER = METADATA_FILE
PROFILE_FORMAT = "vfgraph-step-profile"  # the "format" of a step profile's JSON file (vfgraph profile)
PROGRESS = "progress.json"  # a training checkpoint directory holds it and step-N.* files
MANIFEST = "vfgraph-manifest.json"  # in each directory vfgraph writes: what it wrote there
MANIFEST_FORMAT = "vfgraph-manifest"
CHECKPOINT = "checkpoint"  # a manifest's kind: a training checkpoint directory (its step files come and go)
LOCK_FORMAT = "vfgraph-lock"
_FULL = (errno.ENOSPC, errno.EDQUOT, errno.EFBIG)
# The entries vfgraph writes, by name (directories end in "/"): what a directory written before
# manifests existed may hold to count as vfgraph's.
_SAVED_MODEL_NAMES = re.compile(r"(saved_model\.pb|fingerprint\.pb|variables/|variables/variables\.(index|"
                                r"data-\d{5}-of-\d{5})|assets/(.+)?|assets\.extra/|assets\.extra/vfgraph\.json)")
_CHECKPOINT_NAMES = re.compile(r"(progress\.json(\.tmp)?|step-\d+(-stage-\d+)?(\.index|\.data-\d{5}-of-\d{5}|"
                               r"_temp/(.+)?))")


def real(path: str) -> str:
    return os.path.realpath(os.path.abspath(os.fspath(path)))


def _inside(path: str, root: str) -> bool:
    return path.startswith(root.rstrip(os.sep) + os.sep)


def umask() -> int:
    mask = os.umask(0o022)
    os.umask(mask)
    return mask


def _entries(path: str):
    """Every entry under the directory ``path``, relative with "/" between names, directories
    ending in "/", sorted; and which of them are symbolic links (never followed, never vfgraph's)."""
    found, links = [], set()
    for root, dirs, files in os.walk(path):
        rel = os.path.relpath(root, path)
        prefix = "" if rel == "." else rel.replace(os.sep, "/") + "/"
        for d in [d for d in dirs if os.path.islink(os.path.join(root, d))]:
            dirs.remove(d)
            files.append(d)
        links.update(prefix + f for f in files if os.path.islink(os.path.join(root, f)))
        found += [prefix + d + "/" for d in dirs] + [prefix + f for f in files]
    return sorted(found), links


def _manifest(path: str) -> Optional[dict]:
    record = _json_record(os.path.join(path, MANIFEST))
    if record.get("format") == MANIFEST_FORMAT and isinstance(record.get("written"), list):
        return record
    return None


def _split(path: str):
    """The entries of the directory ``path`` vfgraph wrote and those it did not (each sorted),
    by its manifest or, without one, by the names vfgraph writes; and whether they were told
    by the names of a SavedModel without a manifest (whose record must say vfgraph wrote it)."""
    entries, links = _entries(path)
    record = _manifest(path)
    if record is not None:
        listed = set(record["written"]) | {MANIFEST, MANIFEST + ".tmp"}
        names = _CHECKPOINT_NAMES if record.get("kind") == CHECKPOINT else None
    else:
        listed = set()
        checkpoint = any(_CHECKPOINT_NAMES.fullmatch(e) for e in entries if "/" not in e.rstrip("/"))
        names = _CHECKPOINT_NAMES if checkpoint else _SAVED_MODEL_NAMES
    ours = [e for e in entries if e not in links and (e in listed or names is not None and names.fullmatch(e))]
    mine = set(ours)
    return ours, [e for e in entries if e not in mine], record is None and names is _SAVED_MODEL_NAMES


def foreign(path: str) -> Optional[str]:
    """What keeps ``path`` from being replaced: None when vfgraph wrote all of it (or it is an
    empty directory); else the first entry of the directory vfgraph did not write (relative,
    files before directories), or "" when the whole is not vfgraph's."""
    if os.path.isdir(path) and not os.path.islink(path):
        ours, others, by_name = _split(path)
        if others:
            return ([e for e in others if not e.endswith("/")] or others)[0]
        if by_name and ours:  # a SavedModel of the names vfgraph writes: vfgraph's if its record says so
            record = _json_record(os.path.join(path, MARKER))
            return None if {"history", "serving_export", "training"} & set(record) else ""
        return None
    if os.path.isfile(path) and path.endswith((".pb", ".pbtxt")) and emitted_by_vfgraph(path):
        return None
    if os.path.isfile(path) and path.endswith(".json") and _json_record(path).get("format") == PROFILE_FORMAT:
        return None
    return ""


def written_by_vfgraph(path: str) -> bool:
    """Whether ``path`` is something vfgraph wrote (and so may replace with ``force``), or an
    empty directory."""
    return foreign(path) is None


def is_checkpoint_entry(name: str) -> bool:
    """Whether ``name`` (in a training checkpoint directory) is one vfgraph writes there."""
    return bool(_CHECKPOINT_NAMES.fullmatch(name) or _CHECKPOINT_NAMES.fullmatch(name + "/"))


def write_manifest(directory: str, kind: str = "model", written: Optional[Iterable[str]] = None) -> None:
    """Record in ``directory``'s manifest what vfgraph wrote there: ``written`` (entries relative
    to it, directories ending in "/"), or by default everything it holds."""
    names = sorted(set(written) if written is not None else _entries(directory)[0])
    record = {"format": MANIFEST_FORMAT, "kind": kind, "written": [n for n in names if n != MANIFEST]}
    tmp = os.path.join(directory, MANIFEST + ".tmp")
    with open(tmp, "w") as f:
        json.dump(record, f, indent=1, sort_keys=True)
        f.write("\n")
    os.chmod(tmp, 0o666 & ~umask())
    os.replace(tmp, os.path.join(directory, MANIFEST))


def remove_written(path: str) -> List[str]:
    """Remove what vfgraph wrote in the directory ``path`` (its manifest last), then ``path``
    once empty; returns what is left there (relative entries vfgraph did not write)."""
    if not os.path.isdir(path) or os.path.islink(path):
        return []
    ours, others, _ = _split(path)
    files = sorted((e for e in ours if not e.endswith("/")), key=lambda e: e == MANIFEST)
    for e in files:
        _remove(os.path.join(path, e))
    for e in sorted((e for e in ours if e.endswith("/")), reverse=True):  # the deepest first
        with contextlib.suppress(OSError):
            os.rmdir(os.path.join(path, e))
    with contextlib.suppress(OSError):
        os.rmdir(path)
    return others


def _refusal(out: str, stray: str) -> str:
    if not stray:
        return f"{out}: exists and was not written by vfgraph, so it is never replaced; choose another output path"
    return (f"{out}: holds {stray.rstrip('/')}, which was not written by vfgraph, so vfgraph does not replace "
            f"{out}; move it out of the directory, or choose another output path")


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
        stray = foreign(out_abs)
        if stray is not None:
            raise OutputError(_refusal(out_abs, stray))
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
            raise OutputError(f"{parent}: {_mib(free)} free, the output needs at least {_mib(need_bytes, up=True)}; "
                              "free space or choose another output path")


def _mib(n: int, up: bool = False) -> str:
    """``n`` bytes in MiB to a tenth, rounded down (or ``up``): a need rounded up never reads as
    what a smaller free space rounded down reads."""
    tenths = -(-n * 10 // (1 << 20)) if up else n * 10 // (1 << 20)
    return f"{tenths // 10}.{tenths % 10} MiB"


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


def publish(tmp: str, out: str, manifest: bool = True) -> None:
    """Move the finished directory ``tmp`` to ``out`` (in the same parent), its files and
    directories readable as the umask says (copies keep their source's modes), with its
    manifest (unless ``manifest`` is false: the caller wrote the manifests inside), replacing
    an existing ``out`` only once ``tmp`` is complete and only as far as vfgraph wrote it."""
    if manifest:
        write_manifest(tmp)
    mask = umask()
    for root, dirs, files in os.walk(tmp):
        os.chmod(root, 0o777 & ~mask)
        for f in files:
            os.chmod(os.path.join(root, f), 0o666 & ~mask)
    if not os.path.exists(out):
        os.rename(tmp, out)
        return
    stray = foreign(out)  # (checked before the work; again, for what came meanwhile)
    if stray is not None:
        raise OutputError(_refusal(out, stray))
    old = tempfile.mkdtemp(prefix=".vfgraph-old-", dir=os.path.dirname(out) or ".")
    os.rename(out, os.path.join(old, "x"))
    os.rename(tmp, out)
    left = remove_written(os.path.join(old, "x"))
    if left:  # put there in the moment between the check and the swap: kept
        logging.getLogger("vfgraph").warning("%s appeared in %s while it was replaced; it is kept in %s", left[0],
                                             out, os.path.join(old, "x"))
    else:
        os.rmdir(old)


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


# ----- locks: one command at a time writes an output

_held: Optional[Dict[str, int]] = None  # the running command's locks: lock file -> its descriptor
_command_line = ""


def lock_path(out: str) -> str:
    """The lock file of the output ``out``, beside it."""
    return os.path.abspath(os.fspath(out)) + ".lock"


@contextlib.contextmanager
def command(line: str = "") -> Iterator[None]:
    """Run a command that writes (``line``: its command line, recorded in its locks): the output
    locks it takes (:func:`lock`) are held until it ends, then released and their files
    removed. Nested, the outermost holds them. Also a decorator."""
    global _held, _command_line
    if _held is not None:
        yield
        return
    _held, _command_line = {}, line or " ".join(sys.argv)
    try:
        yield
    finally:
        held, _held = _held, None
        for path, fd in held.items():
            _release(path, fd)


def lock(out: str, inputs: Iterable[Optional[str]] = (), elastic: bool = False) -> None:
    """Lock the output ``out`` for the running :func:`command`, before it is checked and
    written: a command already writing it makes this one stop at once, naming it. The lock
    file never goes into an input. ``elastic``: an elastic training job (``vfgraph resize``)."""
    if _held is None:
        raise RuntimeError("outputs.lock() outside outputs.command()")
    out_abs = os.path.abspath(os.fspath(out))
    path = lock_path(out_abs)
    if path in _held:
        return
    for inp in inputs:
        if inp and (real(path) == real(inp) or _inside(real(path), real(inp))):
            check_apart(out_abs, inputs)  # (says what is wrong with the output itself)
            raise OutputError(f"{path}: would be written in the input {inp}; choose another output path")
    check_parent(os.path.dirname(out_abs))
    record = {"format": LOCK_FORMAT, "pid": os.getpid(), "host": socket.gethostname(),
              "command": _command_line[:400], "elastic": bool(elastic)}
    _held[path] = _acquire(path, out_abs, (json.dumps(record, sort_keys=True) + "\n").encode())


def holder(out: str) -> Optional[dict]:
    """The record of the command holding the lock of ``out`` (``pid``, ``host``, ``command``,
    ``elastic``), or None when no command holds it."""
    try:
        fd = os.open(lock_path(out), os.O_RDONLY)
    except OSError:
        return None
    try:
        try:
            fcntl.flock(fd, fcntl.LOCK_SH | fcntl.LOCK_NB)
        except BlockingIOError:
            return _read_record(fd)
        fcntl.flock(fd, fcntl.LOCK_UN)
        return None
    finally:
        os.close(fd)


def _acquire(path: str, out: str, record: bytes) -> int:
    """The descriptor of the lock file ``path``, created holding ``record`` and locked: made
    whole and locked under another name, then linked, so that no one sees it empty or takes it."""
    for _ in range(100):
        fd, tmp = tempfile.mkstemp(prefix=".vfgraph-lock-", dir=os.path.dirname(path))
        try:
            os.write(fd, record)
            os.fchmod(fd, 0o666 & ~umask())
            fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)  # (no one else knows the file yet)
            os.link(tmp, path)
            _remove(tmp)
            return fd
        except FileExistsError:
            _remove(tmp)
            os.close(fd)
        except OSError as e:
            _remove(tmp)
            os.close(fd)
            raise OutputError(f"{path}: cannot create the lock of {out} ({e.strerror}); choose an output path on "
                              "a local or network file system with hard links") from None
        _stale(path, out)
    raise OutputError(f"{out}: cannot lock it ({path} keeps changing); run the command again")


def _stale(path: str, out: str) -> None:
    """The lock file ``path`` exists: stop, naming the command that holds it; or remove it when
    that command ended without doing so (it died), so that the caller makes its own."""
    try:
        fd = os.open(path, os.O_RDONLY)
    except FileNotFoundError:
        return
    try:
        if not _try_flock(fd):
            record = _read_record(fd)
            host = record.get("host")
            where = f" on {host}" if host and host != socket.gethostname() else ""
            raise OutputError(f"{out}: another vfgraph command is writing it (pid {record.get('pid', '?')}{where}: "
                              f"{record.get('command') or '?'}); wait for it to end, or choose another output path")
        if not _same_file(fd, path):
            return
        if _read_record(fd).get("format") != LOCK_FORMAT:
            raise OutputError(f"{path}: exists and is not a vfgraph lock file, so {out} cannot be locked for "
                              "writing; move it away")
        os.unlink(path)
    finally:
        os.close(fd)


def _try_flock(fd: int, tries: int = 10) -> bool:
    """Lock ``fd`` exclusively without waiting, trying a few times (``vfgraph resize`` looks
    at a lock for a moment)."""
    for i in range(tries):
        try:
            fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
            return True
        except BlockingIOError:
            if i + 1 < tries:
                time.sleep(0.02)
    return False


def _same_file(fd: int, path: str) -> bool:
    try:
        a, b = os.fstat(fd), os.stat(path)
    except OSError:
        return False
    return (a.st_dev, a.st_ino) == (b.st_dev, b.st_ino)


def _read_record(fd: int) -> dict:
    try:
        record = json.loads(os.pread(fd, 1 << 16, 0).decode())
    except (OSError, ValueError):
        return {}
    return record if isinstance(record, dict) else {}


def _release(path: str, fd: int) -> None:
    """Remove the lock file ``path`` (no one replaces a held lock's file), then unlock it."""
    try:
        if _same_file(fd, path):
            os.unlink(path)
    except OSError:
        pass
    finally:
        os.close(fd)
