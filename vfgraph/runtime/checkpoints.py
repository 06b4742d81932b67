"""A training run's progress on disk: the output it will write checked and locked before any
work, the checkpoints written every so many steps (each complete before the older ones go), the
progress record a resumed run reads, and the bounded loss history they hold."""
from __future__ import annotations

import collections
import json
import logging
import os
import shutil
from typing import Deque, List, Optional, Sequence, Tuple

from vfgraph import records
from vfgraph.errors import InputError
from vfgraph.io import outputs, serving

log = logging.getLogger("vfgraph.train")


HISTORY = 1000  # the losses a run keeps: the first step's and those of the last HISTORY steps


class LossHistory:
    """The losses of a run, bounded: the first step's and those of the last ``HISTORY`` steps,
    so a run of any length writes a small checkpoint record and output record; restored from
    the record it is what it was (a resumed run writes what an uninterrupted one writes)."""

    def __init__(self, steps: int = 0, first: Optional[float] = None, recent: Sequence[float] = ()):
        self.steps, self.first = steps, first   # steps done; the loss of step 0
        self.recent: Deque[float] = collections.deque(recent, maxlen=HISTORY)

    @property
    def recent_from(self) -> int:
        """The step whose loss is ``recent[0]``."""
        return self.steps - len(self.recent)

    def append(self, loss: float) -> None:
        if self.steps == 0:
            self.first = loss
        self.recent.append(loss)
        self.steps += 1

    def rollback(self, steps: int) -> None:
        """Back to the history after ``steps`` steps (a job that lost ranks repeats the later ones)."""
        while self.steps > steps and self.recent:
            self.recent.pop()
            self.steps -= 1
        self.steps = min(self.steps, steps)
        if self.steps == 0:
            self.first = None

    def record(self) -> dict:
        """What the checkpoint's progress.json and the output's "training" record hold."""
        return {"steps": self.steps, "first_loss": self.first, "losses_from": self.recent_from,
                "losses": list(self.recent)}

    @classmethod
    def from_record(cls, state: dict) -> "LossHistory":
        """The history of a progress record (``step`` steps; a record of an earlier version holds
        every step's loss in ``losses``)."""
        losses = list(state.get("losses") or [])
        first = state.get("first_loss", losses[0] if losses and "losses_from" not in state else None)
        return cls(int(state["step"]), first, losses[-HISTORY:])


def plan_outputs(out: str, ckpt_dir: str, inputs: List[str], force: bool, resume: bool,
          need_bytes: int, elastic: bool = False) -> Optional[dict]:
    """Lock the output and check what the run will write (vfgraph.io.outputs' rule) before any
    work; returns the progress record to resume from, if any. An unfinished run's checkpoint
    is never deleted without ``force``; a finished output is never taken for one to resume."""
    outputs.lock(out, inputs, elastic)  # (OUT.ckpt and OUT.serving with it)
    state = read_progress(ckpt_dir)
    finished = os.path.isdir(out) and (records.read_metadata(out) or {}).get("training")
    if resume and state is None and finished:
        done = finished.get("steps")
        where = "holds no progress record" if os.path.isdir(ckpt_dir) else "does not exist"
        raise InputError(f"{out}: a finished run{f' of {done} steps' if done else ''} with no checkpoint to resume "
                         f"({ckpt_dir} {where}); train it further with 'vfgraph train {out} ... -o NEW', or "
                         "pass --force instead of --resume to train again from the start")
    if not resume and state is not None and not force:
        raise InputError(f"{ckpt_dir}: holds the checkpoint of an unfinished run (step {state['step']}); continue "
                         "it with --resume, or pass --force to discard it and train from the start")
    outputs.check_output(ckpt_dir, inputs, force=True, what="checkpoint")
    outputs.check_output(out, inputs, force, need_bytes=need_bytes)
    serve = serving.sibling_dir(out)
    if os.path.exists(serve):
        serving.prepare_target(serve, 1, force=True, sources=inputs)
    else:
        outputs.check_output(serve, inputs)
    return state if resume else None


def read_progress(ckpt_dir: str) -> Optional[dict]:
    path = os.path.join(ckpt_dir, "progress.json")
    if not os.path.isfile(path):
        return None
    try:
        with open(path) as f:
            state = json.load(f)
        state["step"], state["checkpoint"]  # noqa: B018 (what a record must hold)
    except (OSError, ValueError, KeyError, TypeError) as e:
        raise InputError(f"{path}: not a readable progress record ({e}); move {ckpt_dir} away to train from the "
                         "start") from None
    return state


def changed_config(saved: dict, now: dict) -> List[str]:
    """What differs between the configuration a checkpoint was written with and this run's."""
    names = {"batch_size": "--batch-size", "seed": "--seed", "signature": "--train-signature",
             "vnodes": "virtual nodes (V, b)", "model": "model fingerprint", "data": "data fingerprint",
             "input_fn": "--input-fn"}
    out = []
    for key, label in names.items():
        if key in saved and saved[key] != now.get(key):
            a, b = saved[key], now.get(key)
            if key in ("model", "data"):
                a, b = str(a)[:12], str(b)[:12]
            out.append(f"{label} {a} -> {b}")
    return out


def kept_note(ckpt_dir: str, last: Optional[int], every: int) -> str:
    """What the message of an error that stops a run says of the checkpoint it keeps (``last``:
    its step, None: none written yet)."""
    if last is None:
        return f"; no checkpoint was written before it (one every {every} steps, --checkpoint-every)"
    return f"; the last good checkpoint (step {last}) is kept in {ckpt_dir}, --resume continues from it"


def write_part(ckpt, ckpt_dir: str, name: str) -> str:
    """Write ``ckpt`` as ``ckpt_dir/name``; returns its path. A failed write leaves no file of it."""
    os.makedirs(ckpt_dir, exist_ok=True)
    prefix = os.path.join(ckpt_dir, name)
    try:
        with outputs.writing(ckpt_dir):
            return ckpt.write(prefix)
    except BaseException:
        for f in os.listdir(ckpt_dir):
            if f.startswith(name + "."):
                os.remove(os.path.join(ckpt_dir, f))
        raise


def write_checkpoint(ckpt, ckpt_dir: str, step: int, losses: LossHistory, config: Optional[dict],
                parts: Optional[List[str]] = None) -> None:
    """Write the checkpoint of ``step`` steps (or take ``parts``, the pipeline stages' own,
    written already), then (atomically) the record that names it, then remove older ones: a
    run stopped at any moment keeps a complete checkpoint."""
    paths = parts or [write_part(ckpt, ckpt_dir, f"step-{step}")]
    tmp = os.path.join(ckpt_dir, "progress.json.tmp")
    history = losses.record()
    record = {"step": step, "checkpoint": paths[0], "first_loss": history["first_loss"],
              "losses_from": history["losses_from"], "losses": history["losses"], "config": config}
    if parts:
        record["stages"] = paths
    try:
        with outputs.writing(ckpt_dir):
            with open(tmp, "w") as f:
                json.dump(record, f)
            os.replace(tmp, os.path.join(ckpt_dir, "progress.json"))
    except BaseException:  # the last complete checkpoint stays the one progress.json names
        for f in os.listdir(ckpt_dir):
            if any(f.startswith(os.path.basename(p) + ".") for p in paths) or f == os.path.basename(tmp):
                os.remove(os.path.join(ckpt_dir, f))
        raise
    keep = tuple(os.path.basename(p) + "." for p in paths)
    for f in os.listdir(ckpt_dir):  # keep only the checkpoint progress.json names
        if f.startswith("step-") and not f.startswith(keep) and outputs.is_checkpoint_entry(f):
            p = os.path.join(ckpt_dir, f)
            shutil.rmtree(p) if os.path.isdir(p) else os.remove(p)
    outputs.write_manifest(ckpt_dir, outputs.CHECKPOINT,
                           [f for f in os.listdir(ckpt_dir) if f == "progress.json" or f.startswith(keep)])


class Checkpoints:
    """The checkpoints of a run in ``ckpt_dir``: of the variables ``held`` (by this rank),
    written every ``every`` steps and when the run is stopped, and read back by ``--resume``;
    ``config`` (rank 0's) is the configuration they record (``--resume`` requires it unchanged);
    ``stages``: the number of pipeline stages that each write their own part (0: none).
    ``last`` is the step of the last one written or read (None: none yet)."""

    def __init__(self, held: list, ckpt_dir: str, every: int, config: Optional[dict], stages: int = 0):
        import tensorflow as tf

        self.ckpt = tf.train.Checkpoint(variables=held)
        self.dir, self.every, self.config, self.stages = ckpt_dir, every, config, stages
        self.last: Optional[int] = None

    def kept(self) -> str:
        """What an error that stops the run says about the checkpoint it keeps."""
        return kept_note(self.dir, self.last, self.every)

    def due(self, done: int, steps: int) -> bool:
        """A checkpoint is written after ``done`` of ``steps`` steps (not after the last)."""
        return bool(self.every and done % self.every == 0 and done < steps)

    def save(self, w, done: int, losses: LossHistory) -> None:
        """Write the checkpoint of ``done`` steps (rank 0; with stages, the first replica's each
        write their own variables first)."""
        parts = None
        if self.stages:
            part = w.agree(lambda: write_part(self.ckpt, self.dir, f"step-{done}-stage-{w.rank + 1}")
                           if w.rank < self.stages else None)
            parts = w.gather(part)[:self.stages]

        def write() -> None:
            if w.is_root:  # (its record names the new checkpoint from here on, even if the agreement stalls)
                write_checkpoint(self.ckpt, self.dir, done, losses, self.config, parts)
                self.last = done
        w.agree(write)
        self.last = done

    def restore(self, w, state: Optional[dict], resume: bool) -> Tuple[int, LossHistory]:
        """(rank 0, and each stage's rank) The step to start from and the losses so far: those of
        the progress record ``state``, its variables restored (None: step 0; without ``resume``
        an unfinished run's checkpoint is discarded)."""
        if state is None:
            if w.is_root:
                if resume:
                    log.warning("no checkpoint in %s: training from step 0", self.dir)
                elif os.path.isdir(self.dir):  # --force: the unfinished run's checkpoint is discarded
                    outputs.remove_written(self.dir)
            return 0, LossHistory()
        changed = changed_config(state.get("config", {}), self.config) if w.is_root else []
        if changed:
            raise InputError(f"--resume: {self.dir} was written by a run with another configuration "
                             f"({'; '.join(changed)}); resume with the same options and data, or pass --force "
                             "(without --resume) to train from the start")
        self._read(self._path(w, state))
        self.last = state["step"]
        if w.is_root:
            log.info("resuming at step %d", state["step"])
        return state["step"], LossHistory.from_record(state)

    def _path(self, w, state: dict) -> str:
        """The checkpoint of ``state`` this rank reads (with stages: its own stage's)."""
        if not self.stages:
            return state["checkpoint"]
        parts = state.get("stages") or []
        if len(parts) != self.stages:
            raise InputError(f"--resume: {self.dir} holds no checkpoint of each of the {self.stages} pipeline stages; "
                             "move it away to train from the start")
        return parts[w.rank % self.stages]

    def _read(self, path: str) -> None:
        import tensorflow as tf

        try:
            self.ckpt.read(path).assert_consumed()
        except (tf.errors.OpError, AssertionError, ValueError) as e:
            raise InputError(f"{path}: cannot restore the checkpoint ({str(e).splitlines()[0]}); "
                             f"move {self.dir} away to train from the start") from None
