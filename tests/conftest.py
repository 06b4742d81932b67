import os
import sys

os.environ.setdefault("TF_CPP_MIN_LOG_LEVEL", "2")
os.environ.setdefault("TF_ENABLE_ONEDNN_OPTS", "0")

import pytest  # noqa: E402

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, os.path.join(ROOT, "examples"))


def pytest_addoption(parser):
    parser.addoption("--update-goldens", action="store_true", help="rewrite tests/goldens/*.after.pbtxt")


@pytest.fixture(scope="session")
def update_goldens(request):
    return request.config.getoption("--update-goldens")


@pytest.fixture(scope="session")
def models(tmp_path_factory, exported):
    """Example models exported once per session, by name (exported lazily on first use); a
    name of the real-architecture corpus (``corpus.CORPUS``) gives that model, with its own
    optimizer."""
    import corpus
    import export

    root = tmp_path_factory.mktemp("models")
    made = {}

    def get(name):
        if name not in made:
            kind, _, opt = name.partition(":")
            if name in corpus.CORPUS:
                return exported(name)
            path = str(root / name.replace(":", "_"))
            if kind == "mlp":
                export.digits_mlp(path, optimizer=opt or "sgd", lr=0.05, hidden=32)
            elif kind == "mlp32":  # static batch dimension of 32
                export.digits_mlp(path, optimizer=opt or "sgd", lr=0.05, hidden=32, batch=32)
            elif kind == "cnn":
                export.digits_cnn(path, optimizer=opt or "momentum")
            elif kind in ("embedding", "lstm", "transformer", "dropout"):
                getattr(export, f"digits_{kind}")(path, **({"optimizer": opt} if opt else {}))
            elif kind in ("tf1", "tf1-ref"):  # TF1 SavedModel, resource or reference variables
                export.tf1_momentum_bn(path, resource=kind == "tf1", **({"optimizer": opt} if opt else {}))
            elif kind == "tf1-serve-train":  # tags serve+train, loss-only 'train', train op in a collection
                flags = set(opt.split(",")) if opt else set()  # e.g. "ref,ema" or "sgd"
                optimizer = next((f for f in flags if f in ("sgd", "momentum", "adam")), "momentum")
                export.tf1_serve_train(path, optimizer=optimizer, resource="ref" not in flags, ema="ema" in flags)
            elif kind in ("tf1ckpt", "tf1ckpt-resource"):  # a .meta + checkpoint (returns the .meta)
                made[name] = export.tf1_checkpoint(path, resource=kind.endswith("resource"),
                                                   **({"optimizer": opt} if opt else {}))
                return made[name]
            elif kind == "keras-export":
                export.keras_export(path)
            else:
                raise KeyError(name)
            made[name] = path
        return made[name]

    return get


@pytest.fixture(scope="session")
def exported(tmp_path_factory):
    """Models of the real-architecture corpus (examples/corpus.py), exported once per session:
    ``get(name, optimizer=None)`` (its own optimizer unless given)."""
    import corpus

    root = tmp_path_factory.mktemp("corpus")
    made = {}

    def get(name, optimizer=None):
        key = (name, optimizer)
        if key not in made:
            made[key] = corpus.export(name, str(root / f"{name}_{optimizer or 'own'}"), optimizer)
        return made[key]

    return get


@pytest.fixture(scope="session")
def corpus_data(exported, tmp_path_factory):
    """``get(name, n)``: an .npz of ``n`` examples for corpus model ``name``'s training signature
    (``corpus.sample``: token ids and labels in range, padding masks with padded tails)."""
    import numpy as np

    import corpus

    root = tmp_path_factory.mktemp("corpus_data")
    made = {}

    def get(name, n):
        if (name, n) not in made:
            import tensorflow as tf

            path = str(root / f"{name}_{n}.npz")
            np.savez(path, **corpus.sample(tf.saved_model.load(exported(name)).signatures["train"], n, seed=1))
            made[name, n] = path
        return made[name, n]

    return get


@pytest.fixture(scope="session")
def digits(tmp_path_factory):
    import export

    root = tmp_path_factory.mktemp("data")
    export.digits_data(str(root))
    return {"train": str(root / "train.npz"), "test": str(root / "test.npz")}


@pytest.fixture(scope="session")
def rewritten(tmp_path_factory, models):
    """Rewritten models, cached per (model, vnodes, vnode_batch)."""
    import vfgraph

    root = tmp_path_factory.mktemp("rewritten")
    made = {}

    def get(name, vnodes, vnode_batch=0):
        key = (name, vnodes, vnode_batch)
        if key not in made:
            out = str(root / f"{name.replace(':', '_')}_v{vnodes}_b{vnode_batch}")
            vfgraph.save(vfgraph.rewrite(models(name), vnodes=vnodes, vnode_batch=vnode_batch), out)
            made[key] = out
        return made[key]

    return get


@pytest.fixture(scope="session")
def c_client(tmp_path_factory):
    """The C API serving client (vfgraph/testing/serve_c_api.c), built once against the TensorFlow wheel."""
    from vfgraph.testing import c_api

    try:
        return c_api.build_client(str(tmp_path_factory.mktemp("c_api")))
    except c_api.CApiUnavailable as e:
        pytest.skip(str(e))
