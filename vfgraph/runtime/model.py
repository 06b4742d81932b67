"""The model a rank trains, opened: its training signature (or this rank's pipeline stage of
it), the variables the rank holds, the data the signature takes, and the virtual nodes of each
replica."""
from __future__ import annotations

import logging
from dataclasses import dataclass
from typing import List

from vfgraph.errors import InputError
from vfgraph.io import outputs, savedmodel
from vfgraph.runtime.config import ModelPlan, TrainConfig
from vfgraph.runtime.data import TrainData, check_batch
from vfgraph.runtime.placement import Ranks
from vfgraph.runtime.world import shares

log = logging.getLogger("vfgraph.train")


@dataclass
class OpenedModel:
    """``loaded``: the model; ``fn``: the signature this rank runs each step; ``held``: the
    variables it holds (a pipeline stage: its own only); ``data``; ``per``: the virtual nodes of
    each replica."""

    loaded: object
    fn: object
    held: list
    data: TrainData
    per: List[int]


def open_model(cfg: TrainConfig, plan: ModelPlan, ranks: Ranks) -> OpenedModel:
    """Open the model and the data for this rank; one line for a layout of ranks the model
    cannot train on, a missing signature, or data it does not take."""
    model, signature = cfg.model, cfg.signature
    if ranks.ranked:
        _check_stage_ranks(cfg, plan, ranks)
    # a stage on a rank reads only its own variables: the others stay uninitialized, no memory
    loaded = savedmodel.load_to_run(model, variable_devices=ranks.in_process > 1, without_values=ranks.ranked)
    if signature not in loaded.signatures:
        raise InputError(f"{model}: no signature {signature!r} (has: {', '.join(sorted(loaded.signatures))}); "
                         "pass --train-signature NAME")
    fn = loaded.signatures[signature]
    held: list = []
    if ranks.ranked:
        fn, held = _open_stage(cfg, plan, ranks, loaded)
    _, specs = fn.structured_input_signature
    data = TrainData.load(cfg.data_path, specs, signature, cfg.batch_size, cfg.seed, cfg.steps,
                          input_fn=cfg.input_function())
    check_batch(model, signature, cfg.batch_size)
    b, broadcast = plan.b, plan.broadcast
    per = [cfg.batch_size // b] if b else [1]
    w = ranks.w
    if (w.size > 1 or cfg.elastic) and not ranks.ranked and (broadcast is None or broadcast not in loaded.signatures):
        raise InputError(f"{model}: no broadcast signature of {signature!r} to start the ranks from the same "
                         "variables; rewrite it with a SavedModel input and --allreduce mpi")
    if ranks.groups > 1 or (cfg.vnodes_per_rank and not ranks.ranked):
        if not b:
            raise InputError(f"{model}: its virtual-node batch is derived from the fed batch, so ranks cannot "
                             "share a global batch; rewrite it with --vnode-batch B")
        per = shares(cfg.batch_size // b, ranks.groups, None if ranks.ranked or cfg.auto else cfg.vnodes_per_rank)
    return OpenedModel(loaded, fn, held if ranks.ranked else list(fn.variables), data, per)


def _check_stage_ranks(cfg: TrainConfig, plan: ModelPlan, ranks: Ranks) -> None:
    """Ranks each running a pipeline stage: whole replicas of the pipeline, all-reducing between
    them when there are several, each rank opening the same model."""
    k_count, groups, model = ranks.k_count, ranks.groups, cfg.model
    if ranks.w.size % k_count or cfg.vnodes_per_rank:
        raise InputError(f"{model}: its training step is cut into {k_count} pipeline stages, one per MPI "
                         f"rank, each running every virtual node: start {k_count} ranks (mpiexec -n "
                         f"{k_count}), or {k_count}*D for D replicas of the pipeline, without "
                         "--vnodes-per-rank, or one process")
    if groups > 1 and not plan.reduces:
        raise InputError(f"{model}: {groups} replicas of its {k_count} pipeline stages need the all-reduce "
                         "between them; rewrite it with --allreduce mpi")
    same_model(ranks.w, model)


def _open_stage(cfg: TrainConfig, plan: ModelPlan, ranks: Ranks, loaded) -> tuple:
    """This rank's pipeline stage: its signature, and the variables it reads (restored from the
    model's files; the only ones it holds)."""
    w, k_count, stages = ranks.w, ranks.k_count, plan.stages
    key = stages.signatures[w.rank % k_count]
    fn = loaded.signatures[key]
    part = stages.parts[w.rank % k_count]
    held = list(savedmodel.restore_signature_variables(
        cfg.model, fn, key, set(part.variables + part.optimizer_state + stages.replicated)))
    size = sum(v.shape.num_elements() * v.dtype.size for v in held)
    whole = sum(p.parameter_bytes + p.optimizer_state_bytes for p in stages.parts)
    log.info("rank %d (stage %d of %d, replica %d): holds %s of variables, of the model's %s of parameters "
             "and optimizer state (%d of %d bytes)", w.rank, w.rank % k_count + 1, k_count, ranks.group + 1,
             outputs.size_text(size), outputs.size_text(whole), size, whole)
    return fn, held


def same_model(w, model: str) -> None:
    """Every rank opens the same model (pipeline stages start from its files, not from rank 0)."""
    fingerprints = w.gather(savedmodel.source_fingerprint(model, None))
    other = next((r for r, f in enumerate(fingerprints) if f != fingerprints[0]), None)
    if other is not None:
        raise InputError(f"rank {other} opened another model than rank 0 at {model}; give every rank the same "
                         "model (a path on a shared file system)")
