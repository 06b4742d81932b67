"""Training a (rewritten) SavedModel on arrays from an .npz file, on one process or on the ranks of
``mpiexec`` (data parallel: each rank feeds its share of every global batch)."""
from __future__ import annotations

import glob
import logging
import math
import os
import re
import sys
import time
from dataclasses import dataclass, field
from typing import Dict, List, Optional, Tuple, Union

import numpy as np

from vfgraph import records
from vfgraph.errors import InputError, Quiet
from vfgraph.io import outputs, savedmodel
from vfgraph.records import Allreduce, VirtualNodes
from vfgraph.ops import blocked_seconds, set_step, watch
from vfgraph.runtime import elastic as el
from vfgraph.runtime import world as world_module
from vfgraph.runtime.balance import Balancer, text
from vfgraph.runtime.checkpoints import (HISTORY, LossHistory, changed_config, kept_note, plan_outputs,  # noqa: F401
                                         write_checkpoint, write_part)
from vfgraph.runtime.data import (batches_for, cast_exactly, check_batch, check_data, data_digest,  # noqa: F401
                                  data_fingerprint, load_data, load_npz, rank_rows)
from vfgraph.runtime.devices import prepare_devices, stages_of
from vfgraph.runtime.elastic import ElasticOptions
from vfgraph.runtime.save import collect_stages, save_trained
from vfgraph.runtime.stops import (NONFINITE, STOP, STOP_GRACE, Interrupted, NonFiniteLoss, Stalled,  # noqa: F401
                                   StopRequests, TrainingError, WatchedExchanges, end_before_finalize)
from vfgraph.runtime.world import (RankLost, World, launched_world, place_threads, resident_bytes, same_everywhere,
                                   shares, world)

# (the names tests and tools import from here, from before the runtime was split)
_StopRequests, _WatchedExchanges = StopRequests, WatchedExchanges

log = logging.getLogger("vfgraph.train")


@dataclass
class TrainResult:
    out: str
    steps: int
    losses: LossHistory
    metrics: Dict[str, float] = field(default_factory=dict)  # the last step's, besides the loss


def vnode_layout(model: str, signature: str) -> Tuple[int, bool]:
    """(examples per virtual node b, or 0 when the graph divides the fed batch itself;
    whether the step all-reduces over ranks), from the rewrite record of ``model``."""
    meta = records.read_metadata(model) or {}
    rec = records.get(meta, VirtualNodes).get(signature)
    return (rec.vnode_batch if rec else 0), signature in records.get(meta, Allreduce)


def broadcast_signature(model: str, signature: str) -> Optional[str]:
    """The key of the signature that starts the ranks from rank 0's variables, as the
    all-reduce record of ``model`` names it (None: the rewrite added none)."""
    rec = records.read(model, Allreduce).get(signature)
    return rec.broadcast_signature if rec else None


@outputs.command()
def train(model: str, data_path: str, steps: int, batch_size: int, out: str, resume: bool = False,
          force: bool = False, signature: str = "train", checkpoint_every: int = 100, seed: int = 0,
          progress: bool = True, vnodes_per_rank: Union[List[int], str, None] = None,
          threads: Optional[int] = None, allow_nonfinite: bool = False,
          elastic: Optional[ElasticOptions] = None, stall_warning: float = 60.0,
          stall_timeout: float = 600.0) -> Optional[TrainResult]:
    """Train ``model`` for ``steps`` global batches of ``batch_size`` examples. Under ``mpiexec``
    every rank feeds its share of each global batch (whole virtual nodes, from the same global
    order), the step all-reduces, and rank 0 writes checkpoints and the result; other ranks
    return None. ``threads``: TensorFlow intra-op threads per rank (default: this host's CPUs shared
    by the ranks on it).

    Safe to interrupt and to repeat: SIGINT or SIGTERM stops after a whole step with a
    checkpoint in ``OUT.ckpt`` that ``resume`` continues from, refusing a changed configuration
    (batch size, seed, data, model); a checkpoint is never deleted without ``force``; a step
    whose loss is not finite stops the run (keeping the last checkpoint, writing no model)
    unless ``allow_nonfinite``.

    ``vnodes_per_rank``: the virtual nodes of each rank (a list adding up to V), or ``"auto"``:
    shares planned from each rank's measured computing time and planned again when it drifts
    (:mod:`vfgraph.runtime.balance`; each plan is logged).

    ``elastic``: change the number of ranks while training, by a schedule
    (:mod:`vfgraph.runtime.elastic`).

    ``stall_warning``, ``stall_timeout`` (seconds, 0: off): under mpiexec, a wait for other
    ranks longer than the first prints one line naming what it waits for and whom; one longer
    than the second ends the job (:class:`Stalled`, the last checkpoint kept). A stop request
    also ends a step blocked in such a wait (docs/mpi.md, "Stalls and stop requests")."""
    auto = vnodes_per_rank == "auto"
    # under mpiexec the ranks agree from the first check on: a mistake is printed once, by rank 0
    # or by the one rank that sees it (a process an elastic job started reports to the job instead)
    first = World() if elastic is not None and elastic.join else launched_world()

    def check() -> tuple:
        for name, value, least in (("--steps", steps, 1), ("--batch-size", batch_size, 1),
                                   ("--checkpoint-every", checkpoint_every, 0), ("--seed", seed, 0)):
            if not isinstance(value, int) or value < least:
                raise InputError(f"{name} {value}: give an integer of at least {least}")
        for name, value in (("--stall-warning", stall_warning), ("--stall-timeout", stall_timeout)):
            if isinstance(value, bool) or not isinstance(value, (int, float)) or not 0 <= value < math.inf:
                shown = f"{value:g}" if isinstance(value, float) else value
                raise InputError(f"{name} {shown}: give a number of seconds of at least 0 (0: off)")
        if resume and force:
            raise InputError("--resume and --force: give one (--resume continues a checkpoint, --force starts over)")
        if not savedmodel.is_saved_model_dir(model):
            raise InputError(f"{model}: not a SavedModel directory")
        b, reduces = vnode_layout(model, signature)
        stages = stages_of(model, signature)
        schedule = None
        if elastic is not None:
            schedule = _check_elastic(elastic, model, b, reduces, stages, vnodes_per_rank, batch_size)
        return b, reduces, stages, schedule

    b, reduces, stages, schedule = first.agree(check)
    broadcast = broadcast_signature(model, signature)  # its key in the Allreduce record (None: not added)
    ranked = stages is not None and stages.on_ranks and stages.count > 1  # one pipeline stage per rank
    inter = None
    if elastic is not None:
        if threads is None:  # the job may grow to max_ranks ranks on this host
            threads = max(1, (os.cpu_count() or 1) // elastic.max_ranks)
        if elastic.join:  # a process the job started: MPI at once, then load while the job trains on
            inter = el.parent()
    w = World() if inter is not None else first.agree(
        lambda: world(need_mpi=reduces or ranked, stages=stages.count if ranked else 0))
    ranked = ranked and w.size > 1
    k_count = stages.count if ranked else 1
    # ranked: rank r runs stage r % K of replica r // K; each replica trains on its share of the batch
    groups, group = (w.size // k_count, w.rank // k_count) if ranked else (w.size, w.rank)
    in_process = stages.count if stages is not None and not stages.on_ranks else 1  # stages on this process's devices
    threads = w.agree(lambda: place_threads(w, threads, in_process))
    prepare_devices(stages)
    out = os.path.abspath(out)
    ckpt_dir = out + ".ckpt"
    data_files = sorted(glob.glob(data_path)) if glob.has_magic(data_path) else [data_path]
    state = w.agree(lambda: plan_outputs(out, ckpt_dir, [model, *data_files], force, resume, outputs.tree_bytes(model),
                                  elastic is not None) if w.is_root and inter is None else None)
    import tensorflow as tf
    from tqdm import tqdm

    resident_at_start = resident_bytes("VmRSS")  # Python and TensorFlow, before the model
    held_vars: list = []  # ranked: the variables this rank's stage reads, the only ones it holds

    def open_model():
        if ranked:
            if w.size % k_count or vnodes_per_rank:
                raise InputError(f"{model}: its training step is cut into {k_count} pipeline stages, one per MPI "
                                 f"rank, each running every virtual node: start {k_count} ranks (mpiexec -n "
                                 f"{k_count}), or {k_count}*D for D replicas of the pipeline, without "
                                 "--vnodes-per-rank, or one process")
            if groups > 1 and not reduces:
                raise InputError(f"{model}: {groups} replicas of its {k_count} pipeline stages need the all-reduce "
                                 "between them; rewrite it with --allreduce mpi")
            _same_model(w, model)
        # a stage on a rank reads only its own variables: the others stay uninitialized, no memory
        loaded = savedmodel.load_to_run(model, variable_devices=in_process > 1, without_values=ranked)
        if signature not in loaded.signatures:
            raise InputError(f"{model}: no signature {signature!r} (has: {', '.join(sorted(loaded.signatures))}); "
                             "pass --train-signature NAME")
        fn = loaded.signatures[signature]
        if ranked:
            key = stages.signatures[w.rank % k_count]
            fn = loaded.signatures[key]
            part = stages.parts[w.rank % k_count]
            held_vars[:] = savedmodel.restore_signature_variables(
                model, fn, key, set(part.variables + part.optimizer_state + stages.replicated))
            held = sum(v.shape.num_elements() * v.dtype.size for v in held_vars)
            whole = sum(p.parameter_bytes + p.optimizer_state_bytes for p in stages.parts)
            log.info("rank %d (stage %d of %d, replica %d): holds %s of variables, of the model's %s of parameters "
                     "and optimizer state (%d of %d bytes)", w.rank, w.rank % k_count + 1, k_count, group + 1,
                     outputs.size_text(held), outputs.size_text(whole), held, whole)
        _, specs = fn.structured_input_signature
        data = check_data(load_data(data_path, specs), specs, data_path, signature)
        keys = sorted(specs)
        n = len(data[keys[0]])
        if batch_size > n:
            raise InputError(f"--batch-size {batch_size}: must be between 1 and the {n} examples in {data_path}")
        check_batch(model, signature, batch_size)
        per = [batch_size // b] if b else [1]
        if (w.size > 1 or elastic) and not ranked and (broadcast is None or broadcast not in loaded.signatures):
            raise InputError(f"{model}: no broadcast signature of {signature!r} to start the ranks from the same "
                             "variables; rewrite it with a SavedModel input and --allreduce mpi")
        if groups > 1 or (vnodes_per_rank and not ranked):
            if not b:
                raise InputError(f"{model}: its virtual-node batch is derived from the fed batch, so ranks cannot "
                                 "share a global batch; rewrite it with --vnode-batch B")
            per = shares(batch_size // b, groups, None if ranked or auto else vnodes_per_rank)
        return loaded, fn, data, keys, per

    loaded, fn, data, keys, per = w.agree(open_model)
    fingerprint = savedmodel.source_fingerprint(model, None)
    if w.size > 1 and inter is None:  # before anything the ranks must call alike as often
        same_everywhere(w, _run_config(steps=steps, batch_size=batch_size, seed=seed, checkpoint_every=checkpoint_every,
                                       signature=signature, resume=resume, force=force, allow_nonfinite=allow_nonfinite,
                                       out=out, fingerprint=fingerprint, data=data, data_files=data_files,
                                       elastic=elastic))
    scheduled, joined_at = None, None
    if elastic is not None:
        from vfgraph import ops

        scheduled = el.Elastic(schedule, elastic.argv, ops.set_communicator, fingerprint,
                               requests=el.request_path(out), max_ranks=elastic.max_ranks, started=elastic.started,
                               discovery=elastic.discovery, interval=elastic.interval)
        if inter is not None:  # loaded: join the job at its next step, with rank 0's variables
            w, joined_at = el.join(inter, elastic.started, fingerprint, scheduled)
            if w is None:  # the job ended first
                return None
            loaded.signatures[broadcast]()
            per = shares(batch_size // b, w.size)
            group = w.rank
        else:
            w.agree(lambda: scheduled.check_start(w))
    lo, hi = rank_rows(per, group, b) if len(per) > 1 else (0, batch_size)
    balancer = None
    if auto and w.size > 1:
        balancer = Balancer(sum(per), w.size, per)
        if w.is_root:
            log.info("virtual nodes per rank: %s to start, planned from the ranks' measured speeds (auto)", text(per))
    config = None
    if w.is_root:
        rec = records.read(model, VirtualNodes).get(signature)
        config = {"batch_size": batch_size, "seed": seed, "signature": signature,
                  "vnodes": [rec.vnodes, rec.vnode_batch] if rec else [1, 0],
                  "model": fingerprint, "data": data_fingerprint(data)}
    held_vars = held_vars if ranked else list(fn.variables)
    ckpt = tf.train.Checkpoint(variables=held_vars)
    start, losses, last_ckpt = 0, LossHistory(), None
    if ranked:  # each stage restores its own part of the checkpoint
        state = w.bcast(state)

    def restore():
        nonlocal start, losses, last_ckpt
        if state is None:
            if not w.is_root:
                return
            if resume:
                log.warning("no checkpoint in %s: training from step 0", ckpt_dir)
            elif os.path.isdir(ckpt_dir):  # --force: the unfinished run's checkpoint is discarded
                outputs.remove_written(ckpt_dir)
            return
        changed = changed_config(state.get("config", {}), config) if w.is_root else []
        if changed:
            raise InputError(f"--resume: {ckpt_dir} was written by a run with another configuration "
                             f"({'; '.join(changed)}); resume with the same options and data, or pass --force "
                             "(without --resume) to train from the start")
        path = state["checkpoint"]
        if ranked:
            parts = state.get("stages") or []
            if len(parts) != k_count:
                raise InputError(f"--resume: {ckpt_dir} holds no checkpoint of each of the {k_count} pipeline stages; "
                                 "move it away to train from the start")
            path = parts[w.rank % k_count]
        try:
            ckpt.read(path).assert_consumed()
        except (tf.errors.OpError, AssertionError, ValueError) as e:
            raise InputError(f"{path}: cannot restore the checkpoint ({str(e).splitlines()[0]}); "
                             f"move {ckpt_dir} away to train from the start") from None
        start, losses, last_ckpt = state["step"], LossHistory.from_record(state), state["step"]
        if w.is_root:
            log.info("resuming at step %d", start)

    if joined_at is None:
        w.agree(lambda: restore() if w.is_root or ranked else None)
        start, losses = w.bcast((start, losses))
    else:
        start = joined_at

    def enough_steps() -> None:
        if start > steps:
            raise InputError(f"--steps {steps}: the checkpoint in {ckpt_dir} is at step {start} already; give more "
                             "steps")

    if joined_at is None:
        w.agree(enough_steps)  # (alike on every rank: printed once)
    else:
        enough_steps()
    where, feed = "start", {}
    variables = [v for v in held_vars if v.dtype.is_floating]

    def finite() -> bool:  # the same on every rank (each stage checks its own parameters)
        ok = allow_nonfinite or all(bool(tf.reduce_all(tf.math.is_finite(v))) for v in variables)
        return all(w.gather(ok)) if ranked else ok

    def save_checkpoint(done: int) -> None:
        nonlocal last_ckpt
        parts = None
        if ranked:  # the first replica's stages each write their own variables
            part = w.agree(lambda: write_part(ckpt, ckpt_dir, f"step-{done}-stage-{w.rank + 1}")
                           if w.rank < k_count else None)
            parts = w.gather(part)[:k_count]
        w.agree(lambda: write_checkpoint(ckpt, ckpt_dir, done, losses, config, parts) if w.is_root else None)
        last_ckpt = done

    step_seconds: List[float] = []  # each step's time on this rank (data, step, agreement)
    metrics: Dict[str, float] = {}  # the other scalars the last step returned (a Keras model's metrics)
    bar = tqdm(initial=start, total=steps, disable=not (progress and w.is_root), unit="step")
    # (rank 0 of an elastic job) the last completed step and a copy of the variables after it,
    # kept while the job runs on more than one rank: when it loses ranks, rank 0 goes back to
    # it and on alone
    memory: Optional[Tuple[int, list]] = None
    keeps = scheduled is not None and w.is_root

    def remember(done: int) -> Tuple[int, list]:
        return done, [np.array(v.numpy()) for v in held_vars]

    def layout(w: World) -> tuple:
        """(an elastic job, on a new world) The virtual nodes per rank, this rank's rows of the
        batch, and the balancer of --vnodes-per-rank auto."""
        per = shares(batch_size // b, w.size)
        return (per, *rank_rows(per, w.rank, b), Balancer(sum(per), w.size, per) if auto and w.size > 1 else None)

    try:
        if w.size > 1 and joined_at is None:
            table = w.describe()
            if w.is_root:
                log.info("%d ranks, %d intra-op and %d inter-op TensorFlow threads each: %s", w.size, threads,
                         tf.config.threading.get_inter_op_parallelism_threads(), "; ".join(table))
            if not ranked:  # (stages read their variables from the same files, checked above)
                loaded.signatures[broadcast]()  # same graph everywhere, then rank 0's variables
        with StopRequests() as stop:
            watching = w.size > 1
            if watching:  # (after the handlers of StopRequests, which the signals then reach too)
                watch(stall_warning, stall_timeout, STOP_GRACE, signals=True)
                world_module.watcher = WatchedExchanges(stop, stall_warning, stall_timeout, lambda: w.rank,
                                                         lambda: where,
                                                         lambda: kept_note(ckpt_dir, last_ckpt, checkpoint_every))
            from_step = start  # (again after ranks were lost: the last completed step)
            while from_step < steps:
                try:
                    for step in range(from_step, steps):
                        where = f"step {step}"
                        if scheduled is not None and step != joined_at:
                            new, change = scheduled.boundary(w, step)
                            if new is None:  # this rank left the job: idle until it ends, or a growth calls it back
                                back = scheduled.park(w)
                                if back is None:
                                    return None
                                w, from_step = back
                                group, joined_at = w.rank, from_step
                                per, lo, hi, balancer = layout(w)
                                loaded.signatures[broadcast]()  # rank 0's variables, as the others
                                log.info("rank %d came back at step %d", w.rank, from_step)
                                break  # (on from that step)
                            if change and "refused" in change:
                                if w.is_root:
                                    log.warning("%s", change["refused"])
                            elif change:
                                w, group = new, new.rank
                                if keeps:  # what the job goes back to if it loses ranks from here on
                                    memory = remember(step)
                                if change["new"] > change["old"]:  # the new ranks take every variable of rank 0
                                    loaded.signatures[broadcast]()
                                per, lo, hi, balancer = layout(w)
                                if w.is_root:
                                    took = time.perf_counter() - change["began"]
                                    n = change["new"] - change["old"]
                                    if "back" in change:
                                        log.info("resized %d -> %d ranks at step %d: %d rank%s that had left came "
                                                 "back, in %.3g s; virtual nodes per rank %s", change["old"],
                                                 change["new"], step, n, "s" if n > 1 else "", took, text(per))
                                    else:
                                        started_in = (f" (they started in {change['spawn']:.3g} s, beside the "
                                                      "training)" if "spawn" in change else "")
                                        log.info("resized %d -> %d ranks at step %d: %.3g s waiting for new ranks "
                                                 "to load the model%s, then %.3g s to change; virtual nodes per "
                                                 "rank %s", change["old"], change["new"], step, change["waited"],
                                                 started_in, took, text(per))
                        if watching:
                            set_step(step)
                        fetched = time.perf_counter()
                        batch = batches_for(data, keys, batch_size, step, seed)
                        feed = {k: v[lo:hi] for k, v in batch.items()}
                        began, blocked = time.perf_counter(), blocked_seconds() if balancer else 0.0
                        result = fn(**feed)
                        loss = float(result["loss"]) if "loss" in result else float("nan")
                        computing = time.perf_counter() - began - ((blocked_seconds() - blocked) if balancer else 0.0)
                        bad = "loss" in result and not math.isfinite(loss) and not allow_nonfinite
                        seen = w.gather(((NONFINITE if bad else 0) | (STOP if stop.requested else 0), computing))
                        if balancer:
                            change = balancer.observe(step, [t for _, t in seen])
                            if change:
                                per = balancer.shares
                                lo, hi = rank_rows(per, group, b)
                                if w.is_root:
                                    log.info("%s", change)
                        seen = [f for f, _ in seen]
                        step_seconds.append(time.perf_counter() - fetched)
                        if any(f & NONFINITE for f in seen):
                            first = next(r for r, f in enumerate(seen) if f & NONFINITE)
                            if w.rank != first:
                                raise Quiet(NonFiniteLoss.exit_code)
                            raise NonFiniteLoss(_nonfinite_message(step, loss, feed, ckpt_dir, last_ckpt,
                                                                   checkpoint_every, w))
                        losses.append(loss)
                        metrics = {k: float(v) for k, v in sorted(result.items()) if k != "loss" and v.shape.rank == 0}
                        bar.set_postfix(loss=f"{loss:.4f}", **{k: f"{v:.4g}" for k, v in metrics.items()})
                        done = step + 1
                        interrupted = any(f & STOP for f in seen) and done < steps
                        if interrupted or (checkpoint_every and done % checkpoint_every == 0 and done < steps):
                            if not finite():
                                if not w.is_root:
                                    raise Quiet(NonFiniteLoss.exit_code)
                                raise NonFiniteLoss(f"step {step}: parameters are not finite after it; training "
                                                    "stopped and no model was written"
                                                    f"{kept_note(ckpt_dir, last_ckpt, checkpoint_every)}; check the data "
                                                    "and the learning rate, or pass --allow-nonfinite to train on")
                            save_checkpoint(done)
                        if interrupted:
                            if not w.is_root:
                                raise Quiet(Interrupted.exit_code)
                            raise Interrupted(f"stopped after {done} of {steps} steps; {ckpt_dir} holds them: run the "
                                              "same command with --resume to continue")
                        bar.update(1)
                        if keeps and w.size > 1:  # the step is complete: what the job goes back to
                            memory = remember(done)
                    else:
                        break  # (every step done; a rank called back goes round again)
                except (tf.errors.AbortedError, RankLost):
                    if not (scheduled is not None and scheduled.lost and (memory or not keeps)):
                        raise
                    if keeps:  # rank 0: back to its last completed step
                        from_step, saved = memory
                        for v, value in zip(held_vars, saved):
                            v.assign(value)
                    lost, failed_at = scheduled.lost, step
                    w, from_step = scheduled.recover(from_step)  # with the ranks that joined and are left
                    losses.rollback(from_step)
                    group, joined_at = w.rank, None
                    per, lo, hi, balancer = layout(w)
                    if w.size > 1:  # they take rank 0's variables again
                        loaded.signatures[broadcast]()
                    if w.is_root:
                        bar.n = from_step
                        bar.refresh()
                        log.warning("%s at step %d; the job goes on %s from step %d, its last completed step, with "
                                    "the variables it had then (%.3g s after the loss was seen)", lost, failed_at,
                                    "alone" if w.size == 1 else f"with {w.size} ranks", from_step,
                                    time.perf_counter() - scheduled.lost_at)
                    scheduled.lost = None
    except tf.errors.OpError as e:
        lines = [x.strip() for x in e.message.splitlines() if x.strip()]
        ours = [x for x in lines if x.startswith("Vf")]
        if ours and isinstance(e, (tf.errors.DeadlineExceededError, tf.errors.CancelledError)):
            end_before_finalize(Stalled.exit_code if isinstance(e, tf.errors.DeadlineExceededError)
                                 else Interrupted.exit_code)
        if ours and isinstance(e, tf.errors.DeadlineExceededError):  # the stall watchdog's timeout
            kept = kept_note(ckpt_dir, last_ckpt, checkpoint_every)
            raise Stalled(f"rank {w.rank}, {where}: {ours[0]}; the job ends{kept}") from None
        if ours and isinstance(e, tf.errors.CancelledError):  # a stop request while the step waited for other ranks
            raise Interrupted(f"rank {w.rank}, {where}: stopped while waiting for other ranks"
                              f"{kept_note(ckpt_dir, last_ckpt, checkpoint_every)}") from None
        if ours:  # a failed collective (different graphs on the ranks, an MPI error): one line naming the rank
            raise TrainingError(f"rank {w.rank}, {where}: {ours[0]}") from None
        mine = [x for x in lines if x.startswith("vfgraph: ")]
        if mine:  # the rewritten graph's own check of what it was fed
            raise InputError(f"{where}: {mine[0][len('vfgraph: '):]}") from None
        if isinstance(e, tf.errors.InvalidArgumentError) and feed:  # an op of the model refused a value fed
            rows = batches_for({"row": np.arange(len(data[keys[0]]))}, ["row"], batch_size, step, seed)["row"][lo:hi]
            raise InputError(_refused_batch(lines, feed, rows, data_path, where)) from None
        raise
    finally:
        world_module.watcher = None
        bar.close()
        if scheduled is not None and w.is_root:  # release the ranks that left, and any still to join
            scheduled.finish(w, failed=sys.exc_info()[0] is not None)
    if w.is_root and len(step_seconds) > 1:  # the first step traces and optimizes the graph
        typical = float(np.median(step_seconds[1:]))
        log.info("%d steps after the first took %.4g ms each (median), %.4g steps/s", len(step_seconds) - 1,
                 typical * 1e3, 1 / typical)
    peak = resident_bytes("VmHWM")
    if peak:
        log.info("%speak resident memory %s, %s of it above the process before the model loaded (%d bytes)",
                 f"rank {w.rank}: " if w.size > 1 else "", outputs.size_text(peak),
                 outputs.size_text(peak - resident_at_start), peak - resident_at_start)
    if ranked:  # rank 0 takes each stage's variables from the rank that updates them
        collect_stages(w, loaded, held_vars, stages, model, signature)
    if not w.is_root:
        return None
    save_trained(loaded, model, out, losses, variable_devices=in_process > 1, ckpt_dir=ckpt_dir)
    # OUT holds all the checkpoint held (every variable, the optimizer's state among them, and
    # the losses): the checkpoint goes once OUT and its serving export are whole (docs/semantics.md)
    outputs.remove_written(ckpt_dir)
    return TrainResult(out, steps, losses, metrics)


def _check_elastic(elastic: ElasticOptions, model: str, b: int, reduces: bool, stages, vnodes_per_rank,
                   batch_size: int) -> list:
    """The schedule of an elastic run, or a clear error for a model or options it cannot have."""
    if elastic.max_ranks is None or not (elastic.schedule or elastic.discovery):
        raise InputError("--max-ranks goes with --elastic-schedule or --host-discovery-script (or both): give both "
                         "--max-ranks and one of them")
    if not elastic.interval > 0:
        raise InputError(f"--discovery-interval {elastic.interval}: give a positive number of seconds")
    if elastic.max_ranks < 1:
        raise InputError(f"--max-ranks {elastic.max_ranks}: give at least 1")
    schedule = el.parse_schedule(elastic.schedule, elastic.max_ranks)
    if not reduces or not b:
        raise InputError(f"{model}: an elastic run shares a fixed global batch of whole virtual nodes over its ranks; "
                         "rewrite the model with --vnode-batch B and --allreduce mpi")
    if stages is not None:
        raise InputError(f"{model}: its training step is cut into pipeline stages; an elastic run changes only the "
                         "number of data-parallel ranks of a model without stages")
    if vnodes_per_rank not in (None, "auto"):
        raise InputError("--vnodes-per-rank with --elastic-schedule: give auto, or nothing for even shares (fixed "
                         "shares cannot follow a changing number of ranks)")
    if batch_size % b == 0 and batch_size // b < elastic.max_ranks:
        raise InputError(f"--max-ranks {elastic.max_ranks}: the global batch holds {batch_size // b} virtual nodes, "
                         "and every rank needs at least one; give at most that many ranks, or a larger --batch-size")
    return schedule


def _same_model(w, model: str) -> None:
    """Every rank opens the same model (pipeline stages start from its files, not from rank 0)."""
    fingerprints = w.gather(savedmodel.source_fingerprint(model, None))
    other = next((r for r, f in enumerate(fingerprints) if f != fingerprints[0]), None)
    if other is not None:
        raise InputError(f"rank {other} opened another model than rank 0 at {model}; give every rank the same "
                         "model (a path on a shared file system)")


def _run_config(*, steps: int, batch_size: int, seed: int, checkpoint_every: int, signature: str, resume: bool,
                force: bool, allow_nonfinite: bool, out: str, fingerprint: str, data: Dict[str, np.ndarray],
                data_files: List[str], elastic: Optional[ElasticOptions]) -> Dict[str, Tuple[object, str]]:
    """What the ranks of a job must agree on to run the same steps and as many collective calls
    (option -> (compared, shown), for :func:`vfgraph.runtime.world.same_everywhere`). Not in
    it, as they may differ by design: --threads, --vnodes-per-rank (each rank's share), -v and
    --no-progress, and how a process an elastic job started was started."""
    digest = data_digest(data, data_files)
    n = len(next(iter(data.values()))) if data else 0
    shown = {"--seed": seed, "--batch-size": batch_size, "--steps": steps, "--checkpoint-every": checkpoint_every,
             "--train-signature": signature, "--resume": resume, "--force": force,
             "--allow-nonfinite": allow_nonfinite, "-o": out}
    if elastic is not None:  # (each rank's schedule says when the job changes size)
        shown.update({"--elastic-schedule": elastic.schedule, "--max-ranks": elastic.max_ranks,
                      "--host-discovery-script": elastic.discovery, "--discovery-interval": elastic.interval})
    config = {k: (v, str(v)) for k, v in shown.items()}
    config["--data"] = (digest, f"{n} examples of digest {digest[:12]}")
    config["the model"] = (fingerprint, f"fingerprint {fingerprint[:12]}")
    return config


def _nonfinite_message(step: int, loss: float, feed: Dict[str, np.ndarray], ckpt_dir: str, last: Optional[int],
                       every: int, w) -> str:
    counts = {k: int(np.count_nonzero(~np.isfinite(v))) for k, v in feed.items() if v.dtype.kind == "f"}
    bad = [f"{k!r} has {n} non-finite values" for k, n in sorted(counts.items()) if n]
    where = f"rank {w.rank}, " if w.size > 1 else ""
    hint = (f"the batch's input {', '.join(bad)}: check the data" if bad
            else "the batch's inputs are finite: lower the learning rate or check the model")
    return (f"{where}step {step}: the loss is {loss} (not finite); training stopped and no model was written"
            f"{kept_note(ckpt_dir, last, every)}; {hint}, or pass --allow-nonfinite to train on")


def _refused_batch(lines: List[str], feed: Dict[str, np.ndarray], rows: np.ndarray, data_path: str,
                   where: str) -> str:
    """One line for an op of the model refusing the values of a batch (TensorFlow's
    InvalidArgumentError, ``lines`` its message): what the op said, at which node, and the
    input and first row of ``data_path`` holding a value it names (``rows``: the data's row of
    each example fed)."""
    skip = ("Graph execution error", "Detected at node", "<stack traces", "[[")
    said = next((x for x in lines if not x.startswith(skip)), lines[0] if lines else "no message")
    node = next(iter(re.findall(r"\{\{node ([^}]+)\}\}", " ".join(lines))), "")
    said = re.split(r"\s{2,}", said)[0].rstrip(". ")  # (the values TensorFlow lists after it)
    culprit = ""
    for number in re.findall(r"value of (-?\d+)", said)[:1]:
        hits = {k: np.argwhere(v == int(number)) for k, v in sorted(feed.items()) if v.dtype.kind in "iu"}
        hits = {k: h for k, h in hits.items() if len(h)}
        if hits:
            k, h = next(iter(hits.items()))
            culprit = f"; input {k!r} holds {number} in row {int(rows[h[0][0]])} of {data_path}"
    op = f" (node {node.rsplit('/', 1)[-1]})" if node else ""
    return (f"{where}: the model refused the batch's values: {said}{op}{culprit}; check the data against what the "
            "model takes (for class labels: 0 <= label < classes); no model was written")


