import json
import os
import shutil
import sys

os.environ.setdefault("TF_CPP_MIN_LOG_LEVEL", "2")
os.environ.setdefault("TF_ENABLE_ONEDNN_OPTS", "0")

import pytest  # noqa: E402

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, os.path.join(ROOT, "examples"))


def pytest_addoption(parser):
    parser.addoption("--update-goldens", action="store_true", help="rewrite tests/goldens/*.after.pbtxt")


@pytest.hookimpl(wrapper=True)
def pytest_runtest_protocol(item, nextitem):
    """Under pytest-xdist: a test marked ``alone`` or ``mpi`` runs, with its fixtures' setup and
    teardown, while no other test runs (a timing test would measure the other worker's load, and
    2-4 MPI ranks busy-polling for their messages already fill the 2 CPUs); the others run side
    by side. Each holds a lock file of the run, shared, or exclusive when alone; a gate taken on
    the way in lets a waiting test that runs alone in before the others start new ones."""
    if not os.environ.get("PYTEST_XDIST_WORKER"):
        return (yield)
    import fcntl

    root = os.path.dirname(os.path.abspath(item.config.option.basetemp))  # the workers' common parent
    exclusive = any(item.get_closest_marker(m) for m in ("alone", "mpi"))
    with open(os.path.join(root, "tests.gate"), "a") as gate, open(os.path.join(root, "tests.running"), "a") as running:
        fcntl.flock(gate, fcntl.LOCK_EX)
        fcntl.flock(running, fcntl.LOCK_EX if exclusive else fcntl.LOCK_SH)
        if not exclusive:
            fcntl.flock(gate, fcntl.LOCK_UN)
        return (yield)  # (closing the files releases both)


def pytest_terminal_summary(terminalreporter):
    """The test files that took longest (setup, call and teardown summed), and how much of the
    run's time went to tests that run alone: where to look when the run grows."""
    files, alone = {}, 0.0
    for reports in terminalreporter.stats.values():
        for r in reports:
            if getattr(r, "when", None) and getattr(r, "duration", None):
                path = r.nodeid.split("::")[0]
                files[path] = files.get(path, 0.0) + r.duration
                if r.when == "call" and ("mpi" in r.keywords or "alone" in r.keywords):
                    alone += r.duration
    if not files:
        return
    terminalreporter.write_sep("=", "slowest test files")
    for path, seconds in sorted(files.items(), key=lambda kv: -kv[1])[:15]:
        terminalreporter.write_line(f"{seconds:8.1f}s {path}")
    terminalreporter.write_line(f"{sum(files.values()):8.1f}s in all; {alone:.1f}s in tests that run alone")


@pytest.fixture
def toy_passes():
    """A decorator registering a test's passes for that test only (the registry is
    process-wide): they are unregistered after it."""
    from vfgraph.passes import base

    names = []

    def add(cls):
        base.register(cls)
        names.append(cls.name)
        return cls

    yield add
    for n in names:
        base.unregister(n)


@pytest.fixture(scope="session")
def update_goldens(request):
    return request.config.getoption("--update-goldens")


@pytest.fixture(scope="session")
def shared(tmp_path_factory):
    """``get(name, make)``: the file or directory ``make(path)`` leaves at ``path``, made once per
    test run by whichever pytest process asks first. Under pytest-xdist the workers share it:
    their temporary directories have one parent, the others wait on a file lock while one makes
    it, and a ``.done`` file marks it finished (one left half-made by a process that died is made
    again). ``make`` may return the path to give instead (a file inside ``path``)."""
    from filelock import FileLock

    base = tmp_path_factory.getbasetemp()
    root = (base.parent if os.environ.get("PYTEST_XDIST_WORKER") else base) / "shared"
    root.mkdir(exist_ok=True)
    made = {}

    def get(name, make):
        if name not in made:
            path, done = root / name, root / f"{name}.done"
            with FileLock(str(root / f"{name}.flock")):  # (vfgraph's own output lock is NAME.lock)
                if not done.exists():
                    if path.is_dir():
                        shutil.rmtree(path)
                    elif path.exists():
                        path.unlink()
                    given = make(str(path))
                    done.write_text(json.dumps(given if isinstance(given, str) else str(path)))
            made[name] = json.loads(done.read_text())
        return made[name]

    return get


def fresh_keras():
    """Start an export from Keras' initial global state, so that its layer and optimizer names
    ("dense", "adam" rather than "dense_4", "adam_1") do not depend on what the process built
    before (the exports are shared between processes)."""
    import keras

    keras.backend.clear_session(free_memory=False)


def export_model(name, path):
    """Export example model ``name`` ("KIND[:OPTIONS]", see ``models``) to ``path``; returns the
    path to give (the .meta file for a TF1 checkpoint)."""
    import export

    kind, _, opt = name.partition(":")
    fresh_keras()
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
        return export.tf1_checkpoint(path, resource=kind.endswith("resource"), **({"optimizer": opt} if opt else {}))
    elif kind == "keras-export":
        export.keras_export(path)
    else:
        raise KeyError(name)
    return path


@pytest.fixture(scope="session")
def models(shared, exported):
    """Example models exported once per test run, by name (exported lazily on first use); a
    name of the real-architecture corpus (``corpus.CORPUS``) gives that model, with its own
    optimizer."""
    import corpus

    def get(name):
        if name in corpus.CORPUS:
            return exported(name)
        return shared("model_" + name.replace(":", "_"), lambda path: export_model(name, path))

    return get


@pytest.fixture(scope="session")
def exported(shared):
    """Models of the real-architecture corpus (examples/corpus.py), exported once per test run:
    ``get(name, optimizer=None)`` (its own optimizer unless given)."""
    import corpus

    def make(name, optimizer, path):
        fresh_keras()
        return corpus.export(name, path, optimizer)

    def get(name, optimizer=None):
        return shared(f"corpus_{name}_{optimizer or 'own'}", lambda path: make(name, optimizer, path))

    return get


@pytest.fixture(scope="session")
def corpus_data(exported, shared):
    """``get(name, n)``: an .npz of ``n`` examples for corpus model ``name``'s training signature
    (``corpus.sample``: token ids and labels in range, padding masks with padded tails)."""

    def make(name, n, path):
        import numpy as np
        import tensorflow as tf

        import corpus

        signature = tf.saved_model.load(exported(name)).signatures["train"]
        with open(path, "wb") as f:  # np.savez would add ".npz" to a name without it
            np.savez(f, **corpus.sample(signature, n, seed=1))

    def get(name, n):
        return shared(f"corpus_data_{name}_{n}.npz", lambda path: make(name, n, path))

    return get


@pytest.fixture(scope="session")
def digits(shared):
    import export

    root = shared("data", export.digits_data)
    return {"train": os.path.join(root, "train.npz"), "test": os.path.join(root, "test.npz")}


@pytest.fixture(scope="session")
def rewritten(shared, models):
    """Rewritten models, made once per test run per (model, vnodes, vnode_batch)."""
    import vfgraph

    def make(name, vnodes, vnode_batch, out):
        vfgraph.save(vfgraph.rewrite(models(name), vnodes=vnodes, vnode_batch=vnode_batch), out)

    def get(name, vnodes, vnode_batch=0):
        return shared(f"rewritten_{name.replace(':', '_')}_v{vnodes}_b{vnode_batch}",
                      lambda out: make(name, vnodes, vnode_batch, out))

    return get


@pytest.fixture(scope="session")
def c_client(shared):
    """The C API serving client (vfgraph/testing/serve_c_api.c), built once against the TensorFlow wheel."""
    from vfgraph.testing import c_api

    try:
        return shared("c_api", c_api.build_client)
    except c_api.CApiUnavailable as e:
        pytest.skip(str(e))
