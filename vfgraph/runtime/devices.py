"""The devices a model partitioned into pipeline stages runs on (partition-stages).

Before TensorFlow starts its runtime, the process gets the logical CPU devices the stages
name beyond the one CPU TensorFlow makes (``/device:CPU:1`` on a machine with one CPU
device), so the same partitioned model runs on a workstation's cores as on its GPUs; its
variables are then created on their stages' devices (the loader's
``VariablePolicy.SAVE_VARIABLE_DEVICES``).
"""
from __future__ import annotations

import logging
import re
from typing import Optional

from vfgraph import records
from vfgraph.records import Stages

log = logging.getLogger("vfgraph.runtime")

_CPU = re.compile(r"/device:CPU:(\d+)$")


def stages_of(model: str, signature: str) -> Optional[Stages]:
    """The stage record of ``signature`` of the SavedModel at ``model`` (None: not partitioned)."""
    return records.read(model, Stages).get(signature)


def one_cpu_per_stage(count: int) -> None:
    """Split this process's CPU into ``count`` logical devices (``/CPU:0`` .. ``/CPU:count-1``),
    one intra-op thread each and ``count`` inter-op threads, as stages on devices run in one
    process with one thread per device (the tests and benchmarks compare at that). Call before
    TensorFlow's runtime starts."""
    import tensorflow as tf

    cpu = tf.config.list_physical_devices("CPU")[0]
    tf.config.set_logical_device_configuration(cpu, [tf.config.LogicalDeviceConfiguration()] * count)
    tf.config.threading.set_inter_op_parallelism_threads(count)
    tf.config.threading.set_intra_op_parallelism_threads(1)


def prepare_devices(stages: Optional[Stages]) -> None:
    """Make the logical CPU devices ``stages`` name and this process lacks; warn about other
    devices it lacks (TensorFlow then runs their ops where it can: soft placement). Call
    before TensorFlow's runtime starts."""
    if stages is None or stages.on_ranks:
        return
    import tensorflow as tf

    cpus = [int(m.group(1)) for p in stages.parts for m in [_CPU.search(p.device)] if m]
    physical = tf.config.list_physical_devices("CPU")
    if cpus and physical and max(cpus) > 0:
        try:
            have = tf.config.get_logical_device_configuration(physical[0]) or [None]
            if len(have) <= max(cpus):
                tf.config.set_logical_device_configuration(
                    physical[0], [tf.config.LogicalDeviceConfiguration() for _ in range(max(cpus) + 1)])
        except RuntimeError:  # TensorFlow already running in this process (the embedding program chose)
            pass
    present = {d.name.split("/device:")[-1] for d in tf.config.list_logical_devices()}
    missing = [p.device for p in stages.parts if p.device.split("/device:")[-1] not in present]
    if missing:
        log.warning("stage devices %s are not on this machine: TensorFlow runs their ops on the devices it has",
                    ", ".join(missing))
