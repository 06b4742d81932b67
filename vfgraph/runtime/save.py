"""The end of a training run: rank 0 gathers the variables of every pipeline stage, then writes
the trained model and its serving export."""
from __future__ import annotations

import json
import logging
import os
import re
from typing import Optional

from vfgraph import records
from vfgraph.errors import OutputError, VfgraphError
from vfgraph.io import outputs, savedmodel, serving
from vfgraph.runtime.checkpoints import LossHistory

log = logging.getLogger("vfgraph.train")


def collect_stages(w, loaded, held, stages, model: str, signature: str) -> None:
    """Give rank 0 the whole trained model: the variables every other rank's pipeline stage
    updates (its parameters and optimizer state, from the first replica), over the model's own
    values of those no stage reads."""
    import tensorflow as tf

    owner = {name: k for k, part in enumerate(stages.parts) for name in part.variables + part.optimizer_state}
    mine = {v.name.rsplit(":", 1)[0]: v for v in held}
    sent = {n: v.numpy() for n, v in mine.items() if owner.get(n) == w.rank} if 0 < w.rank < stages.count else {}
    got = w.comm.gather(sent, root=0)
    if not w.is_root:
        return
    trained = {n: v.numpy() for n, v in mine.items()}
    for values in got:
        trained.update(values)
    tf.train.Checkpoint(root=loaded).read(os.path.join(model, "variables", "variables")).expect_partial()
    for v in loaded.signatures[signature].variables:
        name = v.name.rsplit(":", 1)[0]
        if name in trained:
            v.assign(trained[name])


def save_trained(loaded, model: str, out: str, losses: LossHistory, variable_devices: bool = False,
                 ckpt_dir: str = "", validation: Optional[dict] = None) -> None:
    """Write the trained model at ``out`` and its serving export at ``OUT.serving/1`` (a model
    without a servable signature gets none, with a warning). A write that fails is an
    OutputError: when it is the serving export's, ``out`` is whole and the message says how to
    make the export again (and that the run's checkpoint, ``ckpt_dir``, is kept).
    ``variable_devices``: keep each variable's device (a model partitioned into stages).
    ``validation``: the run's last validation, recorded as "validation" beside "training"."""
    import tensorflow as tf

    out = os.path.abspath(out)
    tmp = outputs.temp_dir(os.path.dirname(out), ".vfgraph-train-")
    policy = tf.saved_model.experimental.VariablePolicy
    options = tf.saved_model.SaveOptions(
        experimental_variable_policy=policy.SAVE_VARIABLE_DEVICES if variable_devices else policy.NONE)
    with outputs.writing(out, tmp):
        tf.saved_model.save(loaded, tmp, signatures=_signatures_to_save(loaded), options=options)
        _drop_unsaved_gradient_types(tmp)
        meta = records.read_metadata(model) or {}
        meta["training"] = losses.record()
        if validation is not None:
            meta["validation"] = validation
        os.makedirs(os.path.join(tmp, "assets.extra"), exist_ok=True)
        with open(os.path.join(tmp, records.METADATA_FILE), "w") as f:
            json.dump(meta, f, indent=2, sort_keys=True)
        outputs.publish(tmp, out)
    # Beside it, what a server loads: OUT.serving/1/ (serving signatures and their variables only,
    # no training functions, none of vfgraph's ops), replacing the one an earlier run wrote.
    base = serving.sibling_dir(out)
    try:
        serving.save_serving_model(savedmodel.load_saved_model(out), base, force=True)
    except OutputError as e:  # the trained model is whole; what a server would load is not written
        stale = serving.target_dir(base, 1)
        outputs.remove_written(stale)  # an earlier run's export would serve another model
        reason = re.search(r"writing failed \(([^)]*)\)", str(e))
        kept = f"; the checkpoint {ckpt_dir} is kept" if ckpt_dir and os.path.isdir(ckpt_dir) else ""
        raise OutputError(f"{stale}: writing the serving export failed ({reason.group(1) if reason else e}); the "
                          f"trained model {out} was written whole, its serving export was not{kept}. Free space and "
                          f"make it with: vfgraph export {out} -o {base}") from None
    except VfgraphError as e:  # a model without a servable signature still trained
        outputs.remove_written(serving.target_dir(base, 1))
        log.warning("no serving export beside %s: %s", out, e)


def _drop_unsaved_gradient_types(path: str) -> None:
    """Rewrite the SavedModel TensorFlow wrote at ``path`` without the types of custom gradients
    it did not save (:func:`vfgraph.io.savedmodel.without_unsaved_gradient_types`), so that
    loading the trained model does not warn about them."""
    proto = savedmodel.read_saved_model_proto(path)
    fixed = savedmodel.without_unsaved_gradient_types(proto)
    if fixed is not proto:
        with open(os.path.join(path, savedmodel.SAVED_MODEL_PB), "wb") as f:
            f.write(fixed.SerializeToString(deterministic=True))
        savedmodel._write_fingerprint(path, fixed)


def _signatures_to_save(loaded) -> dict:
    """The signatures of the trained model: every one ``loaded`` has but the init op of a TF1
    SavedModel, which loading ran already (its effects are in the variables saved) and which
    returns no tensor, so cannot be a signature of the model saved again."""
    from tensorflow.python.saved_model import constants

    return {k: fn for k, fn in loaded.signatures.items() if k != constants.INIT_OP_SIGNATURE_KEY}
