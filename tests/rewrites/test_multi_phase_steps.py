"""A step with dependent updates (a GAN: the discriminator updated, then the generator's loss
through the updated discriminator) runs phase by phase: each update's virtual nodes all run
before the next update's start, so V=1 equals the original step and V=4 the full-batch step;
two data-parallel ranks of two virtual nodes each equal one process of four.

Run as ``python test_multi_phase_steps.py worker MODEL OUT`` under ``mpiexec``, this file is
the rank program of that check: it trains ``MODEL`` two steps on its rank's half of the batches
and rank 0 writes the parameters to ``OUT`` (npz)."""
import os
import subprocess
import sys

import numpy as np
import pytest

STEPS, BATCH = 2, 16


def export_three_phases(path):
    """A step of three dependent updates: ``first``, then ``second`` through the updated
    ``first`` (with a learning-rate schedule), then ``first`` again through the updated
    ``second`` (with momentum)."""
    import keras
    import tensorflow as tf

    from vfgraph.testing.steps import save_step

    keras.utils.set_random_seed(0)
    first = keras.Sequential([keras.Input((8,)), keras.layers.Dense(8, activation="tanh"), keras.layers.Dense(1)])
    second = keras.Sequential([keras.Input((8,)), keras.layers.Dense(8, activation="tanh"), keras.layers.Dense(8)])
    specs = {"x": tf.TensorSpec([None, 8], tf.float32), "y": tf.TensorSpec([None], tf.int32)}
    # (a schedule: the second update reads its step counter, which the step then increments; momentum: the
    # third update writes a slot and reads it back)
    opts = (keras.optimizers.SGD(0.1), keras.optimizers.SGD(keras.optimizers.schedules.ExponentialDecay(0.1, 1, 0.5)),
            keras.optimizers.SGD(0.05, momentum=0.9))
    for opt, model in zip(opts, (first, second, first)):
        opt.build(model.trainable_variables)

    def train(batch):
        x = batch["x"]

        def step(opt, model, loss):
            with tf.GradientTape() as tape:
                value = loss()
            opt.apply_gradients(zip(tape.gradient(value, model.trainable_variables), model.trainable_variables))
            return value

        a = step(opts[0], first, lambda: tf.reduce_mean(tf.square(first(x) - 0.5)))
        b = step(opts[1], second, lambda: tf.reduce_mean(tf.nn.softplus(-first(second(x)))))
        c = step(opts[2], first, lambda: tf.reduce_mean(tf.square(first(second(x)) - 1.0)))
        return {"loss": a + b - c}

    return save_step(path, train, specs, list(first.variables) + list(second.variables), (first, second, *opts),
                     lambda x: {"made": second(x)}, specs["x"])


def test_a_gan_step_trains_as_the_original_at_any_v(tmp_path):
    from test_training_semantics import assert_same_training, export_two_updates

    assert_same_training(export_two_updates(tmp_path / "gan", dependent=True), tmp_path, "gan")


def test_exact_sums_keep_a_gan_step_and_stages_refuse_it(tmp_path):
    """Deterministic (exact) sums work phase by phase; pipeline stages, whose virtual nodes are
    in flight together, are refused naming both updates."""
    import vfgraph
    from test_training_semantics import data, export_two_updates
    from vfgraph.errors import VfgraphError
    from vfgraph.testing.compare import compare_models

    gan = export_two_updates(tmp_path / "gan", dependent=True)
    out = str(tmp_path / "exact")
    vfgraph.save(vfgraph.rewrite(gan, vnodes=4, allreduce="none", deterministic=True), out)
    rep = compare_models(gan, out, steps=2, batch=16, data=data(32))
    assert rep.worst_param < 2e-5, rep.params
    with pytest.raises(VfgraphError, match=r"the update '[^']+' comes from a loss that reads \S+ after the update "
                                           r"'[^']+' wrote it.*pipeline stages cannot run a step with dependent"):
        vfgraph.rewrite(gan, vnodes=4, stages=2)


def test_inspect_shows_the_phases_and_stages_are_refused_in_one_line(tmp_path, capsys):
    from test_training_semantics import export_two_updates
    from vfgraph import cli
    from vfgraph.testing.cli import one_error, run_in_process

    gan = export_two_updates(tmp_path / "gan", dependent=True)
    capsys.readouterr()
    assert cli.main(["inspect", gan]) == 0
    assert "  phases: 2 (dependent updates" in capsys.readouterr().out
    out = tmp_path / "staged"
    code, err = run_in_process(capsys, "rewrite", gan, "-o", out, "--vnodes", "4", "--stages", "2")
    one_error(code, err, "vfgraph rewrite: error: ", "comes from a loss that reads",
              "pipeline stages cannot run a step with dependent updates", "train it without --stages")
    assert not out.exists()


def test_three_dependent_updates_run_as_three_phases(tmp_path):
    import vfgraph
    from test_training_semantics import assert_same_training

    model = export_three_phases(tmp_path / "three")
    item = vfgraph.rewrite(model, vnodes=4, allreduce="none")
    names = sorted(n for n in item.library if n.endswith("_update") and "_phase" in n)
    assert [n.rsplit("_phase", 1)[1] for n in names] == ["1_update", "2_update", "3_update"], names
    assert_same_training(model, tmp_path, "three")


def test_a_phase_recomputing_a_read_from_before_an_update_is_refused(tmp_path):
    """The later loss reading a value computed before the earlier update (the discriminator's
    output on real data, kept from before its update) cannot be recomputed in a later phase."""
    import keras
    import tensorflow as tf

    import vfgraph
    from vfgraph.errors import VfgraphError

    first = keras.Sequential([keras.Input((8,)), keras.layers.Dense(1)])
    second = keras.Sequential([keras.Input((8,)), keras.layers.Dense(8)])
    opts = keras.optimizers.SGD(0.1), keras.optimizers.SGD(0.1)
    opts[0].build(first.trainable_variables)
    opts[1].build(second.trainable_variables)

    class Trainer(tf.Module):
        def __init__(self):
            super().__init__()
            self.first, self.second, self.opts = first, second, opts

        @tf.function(input_signature=[tf.TensorSpec([None, 8], tf.float32)])
        def train(self, x):
            with tf.GradientTape() as tape:
                real = self.first(x)
                d = tf.reduce_mean(tf.square(real))
            self.opts[0].apply_gradients(zip(tape.gradient(d, first.trainable_variables), first.trainable_variables))
            with tf.GradientTape() as tape:
                g = tf.reduce_mean(tf.square(self.first(self.second(x)) - real))
            self.opts[1].apply_gradients(zip(tape.gradient(g, second.trainable_variables), second.trainable_variables))
            return {"loss": g}

    m = Trainer()
    tf.saved_model.save(m, str(tmp_path / "kept"), signatures={"train": m.train})
    with pytest.raises(VfgraphError, match=r"reads \S+ before that update.*phase by phase"):
        vfgraph.rewrite(str(tmp_path / "kept"), vnodes=2, allreduce="none")


def batches():
    """The steps' batches, under the train signature's input names."""
    rng = np.random.default_rng(3)
    return [{"batch": rng.normal(size=(BATCH, 8)).astype(np.float32),
             "batch_1": rng.integers(0, 10, BATCH).astype(np.int32)} for _ in range(STEPS)]


def train(model, rank=0, ranks=1):
    """``model`` trained on its rank's slice of each batch; its parameters by place and name."""
    import tensorflow as tf

    from vfgraph import ops

    ops.load()  # the all-reduce's ops
    loaded = tf.saved_model.load(model)  # (held: its variables live as long as it)
    fn = loaded.signatures["train"]
    per = BATCH // ranks
    for feed in batches():
        fn(**{k: tf.constant(v[rank * per:(rank + 1) * per]) for k, v in feed.items()})
    return {f"{k}:{v.name}": v.numpy() for k, v in enumerate(fn.variables)}


@pytest.mark.mpi
def test_two_ranks_of_two_vnodes_equal_one_process_of_four(tmp_path):
    import vfgraph
    from test_training_semantics import export_two_updates

    gan = export_two_updates(tmp_path / "gan", dependent=True)
    one, two = str(tmp_path / "v4"), str(tmp_path / "mpi")
    vfgraph.save(vfgraph.rewrite(gan, vnodes=4, allreduce="none"), one)
    vfgraph.save(vfgraph.rewrite(gan, vnodes=2, allreduce="mpi"), two)
    out = str(tmp_path / "mpi.npz")
    env = dict(os.environ, TF_CPP_MIN_LOG_LEVEL="2", TF_ENABLE_ONEDNN_OPTS="0", OMP_NUM_THREADS="1")
    res = subprocess.run([os.path.join(os.path.dirname(sys.executable), "mpiexec"), "-n", "2", sys.executable,
                          os.path.abspath(__file__), "worker", two, out], capture_output=True, text=True, env=env,
                         timeout=300)
    assert res.returncode == 0, res.stderr[-3000:]
    want = train(one)
    with np.load(out) as got:
        assert sorted(got.files) == sorted(want)
        for name, value in want.items():
            np.testing.assert_allclose(got[name], value, rtol=1e-6, atol=1e-6, err_msg=name)


def worker(model: str, out: str) -> None:
    from mpi4py import MPI

    comm = MPI.COMM_WORLD
    got = train(model, comm.Get_rank(), comm.Get_size())
    if comm.Get_rank() == 0:
        np.savez(out, **got)


if __name__ == "__main__" and sys.argv[1:2] == ["worker"]:
    worker(*sys.argv[2:4])
