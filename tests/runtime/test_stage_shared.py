"""Shared state across pipeline stages on MPI ranks, under real ``mpiexec``: a layer applied on
both sides of the cut and an embedding tied to the output projection (their variables held by
both stages, their gradient summed between them),
an L2 ``kernel_regularizer`` (its penalty computed on its variable's stage), a
``tf.recompute_grad`` block (recomputed on its own stage) and Adam with ``global_clipnorm``
(the stages' squared norms shared before clipping), each cut into 2 stages, train to the
parameters one process trains with the same rewritten model (the unpartitioned step, same V)."""
import numpy as np
import pytest

from test_mpi_train import assert_same_params, losses, params, run_train

pytestmark = pytest.mark.mpi

KINDS = ("shared", "tied", "l2", "recompute", "clip")


def _export(kind: str, out: str) -> None:
    """A small Keras model of ``kind`` on 8x8 digits in a tf.Module whose 'train' signature adds
    the model's losses (its regularizers) to the cross-entropy and applies one optimizer step."""
    import keras
    import tensorflow as tf

    keras.utils.set_random_seed(0)
    x = keras.Input((64,))
    opt = keras.optimizers.SGD(0.05)
    if kind == "shared":  # the same Dense applied twice: both stages read its variables
        d = keras.layers.Dense(64, activation="tanh", name="shared")
        y = keras.layers.Dense(10, name="logits")(d(keras.layers.Dense(64, activation="tanh", name="mid")(d(x))))
    elif kind == "tied":  # an embedding tied to the output projection (stage 1 looks it up, stage 2 projects)
        class Tied(keras.layers.Layer):
            def __init__(self, emb, **kw):
                super().__init__(**kw)
                self.emb = emb

            def call(self, h):
                return tf.matmul(h, self.emb.embeddings, transpose_b=True)

        tokens = keras.layers.Lambda(lambda v: keras.ops.cast(keras.ops.clip(keras.ops.round(v * 16.0), 0, 16),
                                                              "int32"))(x)
        emb = keras.layers.Embedding(17, 16, name="tokens")
        h = keras.layers.Dense(16, activation="tanh", name="mid")(keras.layers.GlobalAveragePooling1D()(emb(tokens)))
        y = keras.layers.Dense(10, name="out")(Tied(emb, name="tied")(h))
        opt = keras.optimizers.Adam(0.01)
    elif kind == "lookups":  # one embedding looked up on both stages: a sparse gradient on each
        emb = keras.layers.Embedding(17, 16, name="tokens")
        tokens = keras.layers.Lambda(lambda v: keras.ops.cast(keras.ops.clip(keras.ops.round(v * 16.0), 0, 16),
                                                              "int32"))(x)
        h = keras.layers.Dense(16, activation="tanh", name="mid")(keras.layers.GlobalAveragePooling1D()(emb(tokens)))
        again = keras.layers.Lambda(lambda v: keras.ops.cast(keras.ops.round((v + 1.0) * 8.0), "int32"))(h)
        y = keras.layers.Dense(10, name="out")(keras.layers.GlobalAveragePooling1D()(emb(again)))
    elif kind == "l2":
        h = keras.layers.Dense(32, activation="relu", kernel_regularizer=keras.regularizers.L2(1e-2), name="hidden")(x)
        y = keras.layers.Dense(10, kernel_regularizer=keras.regularizers.L2(1e-2), name="logits")(h)
    elif kind == "recompute":
        class Recomputed(keras.layers.Layer):
            def __init__(self, **kw):
                super().__init__(**kw)
                self.inner = keras.layers.Dense(32, activation="relu", name="block")

            def build(self, shape):
                self.inner.build(shape)

            def call(self, v):
                return tf.recompute_grad(self.inner)(v)

        h = keras.layers.Dense(32, activation="relu", name="hidden")(Recomputed(name="recomputed")(x))
        y = keras.layers.Dense(10, name="logits")(h)
    else:  # "clip"; "clip3": one more layer, so that each of 3 stages holds variables
        h = keras.layers.Dense(32, activation="relu", name="hidden")(x)
        if kind == "clip3":
            h = keras.layers.Dense(32, activation="relu", name="hidden2")(h)
        y = keras.layers.Dense(10, name="logits")(h)
        opt = keras.optimizers.Adam(0.01, global_clipnorm=0.5)  # small enough to clip
    model = keras.Model(x, y)
    specs = {"x": tf.TensorSpec([None, 64], tf.float32, name="x"), "y": tf.TensorSpec([None], tf.int32, name="y")}

    class Trainer(tf.Module):
        def __init__(self):
            super().__init__()
            self.model, self.opt = model, opt
            opt.build(model.trainable_variables)

        @tf.function(input_signature=[specs])
        def train(self, batch):
            with tf.GradientTape() as tape:
                logits = self.model(batch["x"], training=True)
                loss = tf.reduce_mean(keras.losses.sparse_categorical_crossentropy(batch["y"], logits,
                                                                                   from_logits=True))
                if self.model.losses:
                    loss = loss + tf.add_n(self.model.losses)
            grads = tape.gradient(loss, self.model.trainable_variables)
            self.opt.apply_gradients(zip(grads, self.model.trainable_variables))
            return {"loss": loss}

        @tf.function(input_signature=[specs["x"]])
        def serve(self, x):
            return {"logits": self.model(x, training=False)}

    m = Trainer()
    # recompute_grad's custom gradient is traced into the training function; it is not saved on its own
    tf.saved_model.save(m, out, signatures={"train": m.train, "serving_default": m.serve},
                        options=tf.saved_model.SaveOptions(experimental_custom_gradients=False))
    keras.backend.clear_session()  # models exported later in this process keep their usual names (adam, not adam_2)


@pytest.fixture(scope="module")
def staged(tmp_path_factory):
    """``get(kind)``: (the model, the same model rewritten with 8 virtual nodes of 8 examples cut
    into 2 stages on MPI ranks)."""
    import vfgraph

    root = tmp_path_factory.mktemp("stage_shared")
    made = {}

    def get(kind):
        if kind not in made:
            original, out = str(root / kind), str(root / f"{kind}_staged")
            _export(kind, original)
            vfgraph.save(vfgraph.rewrite(original, vnodes=8, vnode_batch=8, stages=2), out)
            made[kind] = original, out
        return made[kind]

    return get


def test_shared_state_is_planned_where_its_layers_are(staged):
    """The shared layer's variables (and nothing else) are held by both stages, its summed
    gradient broadcast once; the L2 penalty and the recomputed block leave their variables on
    their own layer's stage, the penalty crossing the cut as a scalar; clipping's squared norms
    are broadcast as scalars, and no stage's update needs another stage's gradients otherwise."""
    import vfgraph
    from vfgraph import records
    from vfgraph.records import Stages

    rec = {k: records.read(staged(k)[1], Stages)["train"] for k in KINDS}
    assert rec["shared"].shared == ("shared/kernel", "shared/bias")
    for part in rec["shared"].parts:
        assert {"shared/kernel", "shared/bias"} <= set(part.variables)
    assert rec["tied"].shared == ("tokens/embeddings",)
    for part in rec["tied"].parts:  # the table and its Adam moments on both stages
        assert "tokens/embeddings" in part.variables and len(part.optimizer_state) >= 2
    for k in ("l2", "recompute", "clip"):
        assert rec[k].shared == (), k
        held = [set(p.variables) for p in rec[k].parts]
        assert not held[0] & held[1], k
    assert "hidden/kernel" in rec["l2"].parts[0].variables
    assert {"recomputed/block/kernel", "recomputed/block/bias"} <= set(rec["recompute"].parts[0].variables)

    def sent(kind, op, stage):
        """The static shapes of the ``op`` nodes of stage ``stage``'s functions."""
        item = vfgraph.load(staged(kind)[1])
        out = []
        for name, f in sorted(item.library.items()):
            for n in f.node_def if f"stage{stage}" in name else ():
                if n.op == op and (op == "VfRecv" or n.name.startswith("vf/stage/shared_")):
                    shape = n.attr["shape"].shape if "shape" in n.attr else n.attr["_output_shapes"].list.shape[0]
                    out.append([d.size for d in shape.dim])
        return out

    # L2: the penalty crosses (a scalar), not the kernel; no gradient crosses after the loop
    assert sent("l2", "VfRecv", 2) == [[-1, 32], []] and sent("l2", "VfBroadcast", 1) == []
    # recompute_grad: only the block's activation crosses (not its variables, which its custom
    # gradient is handed), and stage 1 recomputes the block in its backward
    assert sent("recompute", "VfRecv", 2) == [[-1, 32]]
    item = vfgraph.load(staged("recompute")[1])
    (backward,) = [f for name, f in item.library.items() if name.endswith("_stage1_backward")]
    assert any(n.op == "MatMul" and "block" in n.name and "gradient" not in n.name for n in backward.node_def)
    # clipping: each stage's two squared norms (scalars) to every stage, in the same order on both
    assert sent("clip", "VfBroadcast", 1) == sent("clip", "VfBroadcast", 2) == [[]] * 4
    # the shared layer: the summed gradient of each of its variables, once, from the stage summing it
    assert sent("shared", "VfBroadcast", 1) == sent("shared", "VfBroadcast", 2) == [[64, 64], [64]]


@pytest.mark.parametrize("kind", KINDS)
def test_shared_state_on_two_ranks_trains_what_one_process_trains(staged, digits, tmp_path, kind):
    original, model = staged(kind)
    one, ranks = str(tmp_path / "one"), str(tmp_path / "ranks")
    run_train(0, model, digits["train"], one, 2)
    run_train(2, model, digits["train"], ranks, 2)
    assert_same_params(one, ranks, 1e-6)
    assert losses(ranks) == pytest.approx(losses(one), rel=1e-6)
    before, after = params(model), params(ranks)
    trained = [k for k in before if "kernel" in k or "bias" in k]
    assert trained and all(not np.array_equal(before[k], after[k]) for k in trained), kind  # every layer trained


def test_a_sparse_gradient_several_stages_need_is_refused_by_its_variable(tmp_path, capsys):
    """An embedding looked up on both stages has sparse gradients (rows of no static count),
    which the stages cannot broadcast: one line naming the variable and what to do, nothing
    written."""
    from vfgraph.testing.cli import one_error, run_in_process

    original, out = str(tmp_path / "lookups"), tmp_path / "staged"
    _export("lookups", original)
    code, err = run_in_process(capsys, "rewrite", original, "-o", out, "--vnodes", "8", "--vnode-batch", "8",
                               "--stages", "2")
    one_error(code, err, "variable 'tokens/embeddings'", "several pipeline stages", "--devices", "--split-at")
    assert not out.exists()

