"""Random ops keyed by virtual node: a Keras ``Dropout`` (a seed-state variable read by stateless
ops), a keras-hub transformer's dropouts and a ``tf.random.Generator`` draw what a virtual node
draws whatever the layout of the V=8 virtual nodes over ranks (tested in test_random_layouts)
and in a resumed run; a stateful ``tf.random.uniform`` augmentation, which draws from
a per-process stream, is made stateless and keyed by the optimizer's step counter; a
``tf.random.gamma``, which has no stateless twin here, is refused in deterministic mode and
reported in the default mode."""
import numpy as np
import pytest

from test_mpi_train import B, losses, params, run_train
from vfgraph.testing.cli import one_error, run_in_process

pytestmark = pytest.mark.mpi


def _trainer(model, noise: str):
    """A tf.Module training ``model`` on the digits, its inputs first perturbed by ``noise``:
    "" (none), "generator" (a tf.random.Generator's normal noise), "stateful" (a seeded
    ``tf.random.uniform`` scale: made stateless, keyed by the optimizer's step counter) or
    "gamma" (``tf.random.gamma``, a stateful op vfgraph has no stateless twin for)."""
    import tensorflow as tf

    import export

    specs = {"x": tf.TensorSpec([None, 64], tf.float32, name="x"), "y": tf.TensorSpec([None], tf.int32, name="y")}

    class Trainer(tf.Module):
        def __init__(self):
            super().__init__()
            self.model, self.model_variables = model, list(model.variables)
            self.opt = export.make_optimizer("momentum", 0.05)
            self.opt.build(model.trainable_variables)
            self.gen = tf.random.Generator.from_seed(7)

        @tf.function(input_signature=[specs])
        def train(self, batch):
            x = batch["x"]
            if noise == "generator":
                x = x + 0.3 * self.gen.normal(tf.shape(x))
            elif noise == "stateful":
                x = x * tf.random.uniform(tf.shape(x), 0.5, 1.5, seed=3)
            elif noise == "gamma":
                x = x * tf.random.gamma(tf.shape(x), 4.0, 4.0, seed=3)
            with tf.GradientTape() as tape:
                loss = export.sparse_ce(batch["y"], self.model(x, training=True))
            self.opt.apply_gradients(zip(tape.gradient(loss, model.trainable_variables), model.trainable_variables))
            return {"loss": loss}

        @tf.function(input_signature=[specs["x"]])
        def serve(self, x):
            return {"logits": self.model(x, training=False)}

    return Trainer()


def export_model(path, kind: str) -> str:
    """"dropout" (Keras Dropout), "transformer" (a keras-hub TransformerEncoder with dropout 0.1
    over the image's rows), "generator", "stateful" or "gamma" (see :func:`_trainer`)."""
    import keras
    import tensorflow as tf

    keras.utils.set_random_seed(0)
    if kind == "transformer":
        import keras_hub

        layers = [keras.Input((64,)), keras.layers.Reshape((8, 8)), keras.layers.Dense(16),
                  keras_hub.layers.TransformerEncoder(intermediate_dim=32, num_heads=2, dropout=0.1),
                  keras.layers.GlobalAveragePooling1D()]
    else:
        layers = [keras.Input((64,)), keras.layers.Dense(16, activation="relu")]
        layers += [keras.layers.Dropout(0.5)] if kind == "dropout" else []
    noise = kind if kind in ("generator", "stateful", "gamma") else ""
    m = _trainer(keras.Sequential(layers + [keras.layers.Dense(10)]), noise)
    tf.saved_model.save(m, str(path), signatures={"train": m.train, "serving_default": m.serve})
    return str(path)


_MADE: dict = {}  # (kind, deterministic) -> path: made once per pytest process (test_random_layouts reuses them)
_TRAINED: dict = {}  # kind -> the reference run's output


@pytest.fixture(scope="module")
def made(tmp_path_factory):
    """``made(kind, deterministic)``: the exported model (``deterministic`` None) or it
    rewritten with 8 virtual nodes of 8 examples and the all-reduce, made once."""
    import vfgraph

    root = tmp_path_factory.mktemp("random_ops")
    cache = _MADE

    def get(kind, deterministic=None):
        key = (kind, deterministic)
        if key not in cache:
            if deterministic is None:
                cache[key] = export_model(root / kind, kind)
            else:
                out = str(root / f"{kind}_{'exact' if deterministic else 'default'}")
                vfgraph.save(vfgraph.rewrite(get(kind), vnodes=8, vnode_batch=B, deterministic=deterministic), out)
                cache[key] = out
        return cache[key]

    return get


STEPS = 40  # (each step takes milliseconds: enough for a run to be interrupted and resumed)


@pytest.fixture(scope="module")
def reference(made, digits, tmp_path_factory):
    """``reference(kind)``: the deterministic model trained STEPS steps on one process (1x8)."""
    root = tmp_path_factory.mktemp("random_reference")
    done = _TRAINED

    def get(kind):
        if kind not in done:
            done[kind] = str(root / kind)
            run_train(0, made(kind, True), digits["train"], done[kind], STEPS, "--threads", "1")
        return done[kind]

    return get


def assert_identical(a, b, label):
    pa, pb = params(a), params(b)
    differ = [k for k in pa if not np.array_equal(pa[k], pb[k])]
    assert not differ, f"{label}: {differ[:3]} differ"
    assert losses(a) == losses(b), label


def test_the_random_ops_are_found_keyed_and_listed(made, capsys):
    from vfgraph import records
    from vfgraph.records import VirtualNodes

    keyed = {kind: records.read(made(kind, True), VirtualNodes)["train"].random_ops
             for kind in ("dropout", "generator")}
    assert [(r.op, r.keyed) for r in keyed["dropout"]] == [("StatelessRandomUniformV2", "seed variable")]
    assert [(r.op, r.keyed) for r in keyed["generator"]] == [("StatelessRandomNormalV2", "generator")]
    converted = records.read(made("stateful", True), VirtualNodes)["train"].random_ops
    assert [(r.op, r.keyed) for r in converted] == [("RandomUniform", "step counter")]
    from vfgraph import cli

    capsys.readouterr()
    code = cli.main(["inspect", made("generator", True)])
    shown = capsys.readouterr().out
    assert code == 0 and "random ops per virtual node: 1" in shown and "skipped once per step" in shown, shown


def test_a_random_op_it_cannot_key_is_refused_or_reported(made, capsys, tmp_path):
    """A stateful op with no stateless twin (seed attributes, a stream per process): an error
    naming it in deterministic mode (nothing written), a note in the default mode."""
    code, err = run_in_process(capsys, "rewrite", made("gamma"), "--vnodes", 8, "--deterministic", "-o",
                               tmp_path / "exact")
    one_error(code, err, "(RandomGamma) cannot be keyed", "--deterministic")
    assert not (tmp_path / "exact").exists()
    code, err = run_in_process(capsys, "rewrite", made("gamma"), "--vnodes", 8, "-o", tmp_path / "default")
    assert code == 0 and any("RandomGamma" in line and line.startswith("note:") for line in err), err


def test_one_virtual_node_draws_what_the_original_step_draws(made, tmp_path):
    """Virtual node 0 keeps the state itself; the generator advances once per step by what one
    virtual node of 8 draws: as the original model trained on batches of 8."""
    import tensorflow as tf

    import vfgraph
    from vfgraph.testing.compare import compare_models

    for kind in ("dropout", "generator"):
        one = str(tmp_path / kind)
        vfgraph.save(vfgraph.rewrite(made(kind), vnodes=1, allreduce="none"), one)
        assert compare_models(made(kind), one, steps=2, batch=16).worst_param == 0.0, kind
    original, eight = tf.saved_model.load(made("generator")), tf.saved_model.load(made("generator", True))
    x = np.random.default_rng(0).random((64, 64), np.float32)
    y = np.zeros(64, np.int32)
    for _ in range(2):
        original.signatures["train"](x=x[:8], y=y[:8])
        eight.signatures["train"](x=x, y=y)
    def state(loaded):  # the generator's (its variable's dtype: int64 of 3 words)
        return next(v.numpy() for v in loaded.signatures["train"].variables if v.shape == [3] and v.dtype == tf.int64)

    assert np.array_equal(state(original), state(eight)) and state(eight)[0] > 0


def test_a_resumed_run_draws_what_an_uninterrupted_one_draws(made, reference, digits, tmp_path, capsys):
    """The seed state and the generator state are variables of the checkpoint."""
    from test_train_safety import interrupted

    cmd = ["train", made("generator", True), "--data", digits["train"], "--steps", STEPS, "--batch-size", 64,
           "--checkpoint-every", 1, "--threads", 1, "--no-progress"]
    interrupted([*cmd, "-o", tmp_path / "a"], tmp_path / "a.ckpt" / "progress.json", 3)
    code, err = run_in_process(capsys, *cmd, "-o", tmp_path / "a", "--resume")
    assert code == 0, err
    assert_identical(reference("generator"), str(tmp_path / "a"), "resumed")
