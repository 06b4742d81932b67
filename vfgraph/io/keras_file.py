"""Keras 3 models in: a compiled ``.keras`` file, or an inference export given a loss and an
optimizer, become a SavedModel with the training step Keras' ``fit`` runs.

The one place that knows the ``.keras`` format and Keras' training step. The step is built in a
fresh Python process (``python -m vfgraph.io.keras_file``), so that the names TensorFlow gives
its traced functions, and with them the rewritten model, are the same for the same file in any
process; the SavedModel it writes to a private temporary directory is then read as any other
(:func:`vfgraph.io.savedmodel.load_saved_model`), the item naming the original file.

The step ``train`` takes the model's inputs under their Keras names and the label(s): ``label``
for a model with one output, ``label_<output name>`` for each output of a model with several;
it returns ``loss`` (the compiled losses with their weights, plus the regularization losses:
what ``fit`` reports) and each compiled metric's value on the batch alone (no metric state:
a mean over the batch, averaged over virtual nodes like the loss). ``serving_default`` runs the
model with ``training=False`` and returns ``output_0``, ``output_1``, ...
"""
from __future__ import annotations

import os
import shutil
import subprocess
import sys
import tempfile
import weakref
import zipfile
from typing import Dict, List, Sequence, Tuple

from vfgraph.errors import InputError, InternalError
from vfgraph.item import GraphItem

_ERROR = "vfgraph-keras-error: "  # how the building process reports a user's mistake
LOSS_FLAG, OPTIMIZER_FLAG = "--keras-loss", "--keras-optimizer"


def is_keras_file(path: str) -> bool:
    """Whether ``path`` is a Keras 3 ``.keras`` file: a zip holding ``config.json`` and
    ``metadata.json`` (read by content, whatever the name ends with)."""
    if not os.path.isfile(path) or not zipfile.is_zipfile(path):
        return False
    try:
        with zipfile.ZipFile(path) as z:
            names = set(z.namelist())
    except (zipfile.BadZipFile, OSError):
        return False
    return {"config.json", "metadata.json"} <= names


def load_keras_file(path: str, imports: Sequence[str] = ()) -> GraphItem:
    """The compiled Keras model in the ``.keras`` file at ``path`` as a SavedModel item with its
    ``train`` and ``serving_default`` steps; ``imports``: modules to import first (custom
    layers, losses, keras-hub)."""
    return _built(["keras", path], path, imports)


def fine_tuned(path: str, loss: str, optimizer: str, label: str = "label", imports: Sequence[str] = ()) -> GraphItem:
    """The inference SavedModel at ``path`` (``tf.saved_model.save`` or ``model.export()``) with
    a ``train`` step: its ``serving_default`` function, the Keras loss ``loss`` against the
    input ``label``, and the Keras optimizer ``optimizer`` (``NAME[:key=value,...]``)."""
    check_fine_tune_options(loss, optimizer, label)
    return _built(["fine-tune", path, "--loss", loss, "--optimizer", optimizer, "--label", label], path, imports)


def check_fine_tune_options(loss: str, optimizer: str, label: str = "label") -> None:
    """The fine-tuning options' rule: both or neither of the loss and the optimizer, each a name
    Keras knows, a label name; one line naming the option otherwise."""
    if bool(loss) != bool(optimizer):
        given, missing = (LOSS_FLAG, OPTIMIZER_FLAG) if loss else (OPTIMIZER_FLAG, LOSS_FLAG)
        raise InputError(f"{given} without {missing}: a training step needs both, e.g. "
                         f"{LOSS_FLAG} sparse_categorical_crossentropy {OPTIMIZER_FLAG} adam:learning_rate=1e-3")
    if not loss:
        return
    if not label or not label.replace("_", "a").isalnum():
        raise InputError(f"--label {label!r}: give an input name of letters, digits and '_'")
    _keras_loss(loss)
    _keras_optimizer(optimizer)


def fine_tune_refused(path: str) -> InputError:
    """The error for the fine-tuning options given with a model other than a SavedModel
    directory."""
    return InputError(f"{path}: {LOSS_FLAG} and {OPTIMIZER_FLAG} give an inference SavedModel directory a training "
                      "step; a .keras file brings its own compiled loss and optimizer: leave them out")


def _keras_loss(name: str):
    import keras

    try:
        fn = keras.losses.get(name)
    except (ValueError, TypeError):
        fn = None
    if fn is None or not name.replace("_", "a").isalnum():
        raise InputError(f"{LOSS_FLAG} {name}: not a Keras loss; give one of Keras' loss names, e.g. "
                         "sparse_categorical_crossentropy, categorical_crossentropy, binary_crossentropy, mse")
    return fn


def _keras_optimizer(spec: str):
    """A new Keras optimizer from ``NAME[:key=value,...]`` (``lr`` is ``learning_rate``)."""
    import keras

    name, _, rest = spec.partition(":")
    options: Dict[str, object] = {}
    for part in filter(None, rest.split(",")):
        key, eq, value = part.partition("=")
        try:
            options[{"lr": "learning_rate"}.get(key.strip(), key.strip())] = _number(value) if eq else None
        except ValueError:
            options = {"": None}
            break
    if not name.isidentifier() or "" in options or None in options.values():
        raise InputError(f"{OPTIMIZER_FLAG} {spec}: give NAME[:key=value,...], e.g. adam:learning_rate=1e-3 or "
                         "sgd:lr=0.1,momentum=0.9")
    try:
        cls = type(keras.optimizers.get(name))
        return cls(**options)
    except (ValueError, TypeError) as e:
        raise InputError(f"{OPTIMIZER_FLAG} {spec}: not a Keras optimizer and its options ({_first(e)}); give one "
                         "of Keras' names (sgd, adam, adamw, rmsprop, adagrad, ...) and its constructor's "
                         "arguments, e.g. adam:learning_rate=1e-3") from None


def _number(text: str):
    text = text.strip()
    if text.lower() in ("true", "false"):
        return text.lower() == "true"
    return int(text) if text.lstrip("-").isdigit() else float(text)


def _first(e: BaseException) -> str:
    return (str(e).strip().splitlines() or [type(e).__name__])[0][:300]


class _TempPrefix(str):
    """The checkpoint prefix of a built SavedModel in a temporary directory: the directory goes
    when the last item (or copy of one) holding this prefix does, or when the process ends."""


def variables_read(item: GraphItem) -> str:
    """The checkpoint prefix whose files count as an input of ``item`` besides ``item.source``:
    none for a model built here (the .keras file holds all it was built from)."""
    return "" if isinstance(item.variables_prefix, _TempPrefix) else item.variables_prefix


def _built(args: List[str], source: str, imports: Sequence[str]) -> GraphItem:
    """The SavedModel the building process makes from ``source``, loaded and naming ``source``."""
    from vfgraph.io import savedmodel

    tmp = tempfile.mkdtemp(prefix="vfgraph-keras-")
    try:
        out = os.path.join(tmp, "model")
        _run_builder(args + [out] + [a for m in imports for a in ("--import", m)], source)
        if os.path.isdir(os.path.join(out, "assets")) and os.listdir(os.path.join(out, "assets")):
            raise InputError(f"{source}: the model holds asset files (vocabularies, tables), which a model built "
                             "from it cannot carry yet; export the training step with tf.saved_model.save")
        item = savedmodel.load_saved_model(out)
    except BaseException:
        shutil.rmtree(tmp, ignore_errors=True)
        raise
    item.source = os.path.abspath(source)
    item.variables_prefix = _TempPrefix(os.path.join(out, "variables", "variables"))
    weakref.finalize(item.variables_prefix, shutil.rmtree, tmp, True)
    return item


def _run_builder(args: List[str], source: str) -> None:
    env = dict(os.environ, PYTHONHASHSEED="0", PYTHONPATH=os.pathsep.join(p for p in sys.path if p))
    env.setdefault("TF_CPP_MIN_LOG_LEVEL", "2")
    res = subprocess.run([sys.executable, "-m", "vfgraph.io.keras_file", *args], capture_output=True, text=True,
                         env=env)
    if res.returncode == 0:
        return
    mine = [line[len(_ERROR):] for line in res.stderr.splitlines() if line.startswith(_ERROR)]
    if mine:
        raise InputError(mine[-1])
    last = ([line for line in res.stderr.splitlines() if line.strip()] or [f"exit {res.returncode}"])[-1]
    raise InternalError(f"building the training step of {source} failed ({last[:300]})")


class CompiledMetrics:
    """The compiled loss and metrics of the Keras model in the ``.keras`` file at ``path`` (Keras'
    own objects, loaded in this process; ``imports``: modules to import first), applied to
    outputs computed elsewhere: the serving signature's ``output_0``, ``output_1``, ... against
    the labels ``label_names`` (as the training step names them). The metrics keep a state over
    the batches of a validation (:meth:`reset`, :meth:`update`), which :meth:`state` and
    :meth:`set_state` let ranks add up."""

    def __init__(self, path: str, imports: Sequence[str] = ()):
        import importlib

        import numpy as np
        from keras import tree

        for name in imports:
            try:
                importlib.import_module(name)
            except Exception as e:  # the user's module: any error it raises, in one line
                raise InputError(f"--import {name}: cannot import it ({_first(e)}); give a module on the Python "
                                 "path (PYTHONPATH, or the current directory)") from None
        model = _load_model(path)
        model_inputs, labels, self.label_names = _specs(model)
        zeros = [np.zeros([1, *[d or 1 for d in s.shape[1:]]], s.dtype.as_numpy_dtype) for s in model_inputs + labels]
        structure = model._inputs_struct if hasattr(model, "_inputs_struct") else None
        xs = zeros[:len(model_inputs)]
        x = tree.pack_sequence_as(structure, xs) if structure is not None else (xs[0] if len(xs) == 1 else xs)
        self.structure = model(x, training=False)  # (the outputs' structure, as the loss and metrics take them)
        self.loss, self.metrics = model._compile_loss, getattr(model, "_compile_metrics", None)
        y0, y_pred0 = self._pack(zeros[len(model_inputs):], tree.flatten(self.structure))
        self.loss.build(y0, y_pred0)
        if self.metrics is not None and not self.metrics.built:
            self.metrics.build(y0, y_pred0)

    def _pack(self, ys: list, outputs: list) -> tuple:
        from keras import tree

        if tree.is_nested(self.structure):
            y_pred = tree.pack_sequence_as(self.structure, list(outputs))
            return tree.pack_sequence_as(y_pred, list(ys)), y_pred
        return ys[0], outputs[0]

    def reset(self) -> None:
        if self.metrics is not None:
            self.metrics.reset_state()

    def update(self, outputs: list, labels: list) -> float:
        """Add a batch (the serving outputs in order, the labels as :attr:`label_names`) to the
        metrics; its compiled loss (a mean over the batch, the outputs' losses weighted)."""
        y, y_pred = self._pack(labels, outputs)
        if self.metrics is not None:
            self.metrics.update_state(y, y_pred)
        return float(self.loss(y, y_pred))

    def state(self) -> list:
        import numpy as np

        return [np.array(v.numpy()) for v in self.metrics.variables] if self.metrics is not None else []

    def set_state(self, values: list) -> None:
        for v, value in zip(self.metrics.variables if self.metrics is not None else [], values):
            v.assign(value)

    def result(self):
        """The compiled metrics' values, by name (the loss aside)."""
        if self.metrics is None:
            return {}
        return {k: float(v) for k, v in sorted(self.metrics.result().items()) if k != "loss"}


# ---- in the building process ----------------------------------------------------------------

def _load_model(path: str):
    import keras

    try:
        model = keras.saving.load_model(path, compile=True)
    except Exception as e:  # Keras' errors are of every type: one line naming the file
        raise InputError(f"{path}: Keras cannot load this model ({_first(e)}); if it uses custom layers, losses or "
                         "keras-hub models, pass --import MODULE with the module that defines them") from None
    _compile_as_saved(model, path)
    loss = getattr(model, "_compile_loss", None)
    if not getattr(model, "compiled", False) or model.optimizer is None or loss is None:
        raise InputError(f"{path}: the model is not compiled (no optimizer and loss saved), so there is no training "
                         "step to rewrite; call model.compile(optimizer=..., loss=...) and model.save() again")
    if not getattr(model, "inputs", None):
        raise InputError(f"{path}: the model declares no inputs (a subclassed model); build it from keras.Input "
                         "(functional or Sequential) or export its training step with tf.saved_model.save")
    return model


def _compile_as_saved(model, path: str) -> None:
    """Compile ``model`` as the file says where Keras' loader does not: a model class with its
    own ``compile`` (keras-hub's tasks) is loaded compiled with its defaults, not with the
    optimizer and loss it was saved with; the saved optimizer's state is restored as Keras does."""
    import io
    import json

    import h5py
    import numpy as np
    import keras
    from keras.src.saving import serialization_lib

    if type(model).compile is keras.Model.compile:
        return
    with zipfile.ZipFile(path) as z:
        config = json.loads(z.read("config.json")).get("compile_config")
        weights = z.read("model.weights.h5") if config and "model.weights.h5" in z.namelist() else b""
    if not config:
        return
    model.compile(**serialization_lib.deserialize_keras_object(config))
    if not weights:
        return
    with h5py.File(io.BytesIO(weights), "r") as h5:
        saved = h5.get("optimizer/vars")
        values = {k: np.asarray(saved[k]) for k in saved.keys()} if saved is not None else {}
    optimizer = model.optimizer
    if values and len(values) > 2:  # (a never-built optimizer saves its iterations and learning rate only)
        optimizer.build(model.trainable_variables)
        if len(values) != len(optimizer.variables):
            raise InputError(f"{path}: its optimizer state holds {len(values)} variables, the compiled optimizer "
                             f"{len(optimizer.variables)}; save the model again after compiling it")
        optimizer.load_own_variables(values)
    elif "0" in values:  # its iterations (and learning rate, from the config)
        optimizer.iterations.assign(values["0"])


def _is_sparse(loss) -> bool:
    name = loss if isinstance(loss, str) else getattr(loss, "name", None) or getattr(loss, "__name__", "")
    return "sparse" in str(name).lower()


def _input_name(tensor) -> str:
    """The name of the Input layer that makes ``tensor`` (what Keras' own exports call it)."""
    history = getattr(tensor, "_keras_history", None)
    return getattr(getattr(history, "operation", None), "name", None) or tensor.name


def _specs(model) -> Tuple[list, list, List[str]]:
    """(input specs, label specs, label names) of ``model``'s training step."""
    import tensorflow as tf
    from keras import tree

    inputs = [tf.TensorSpec([None, *t.shape[1:]], t.dtype, name=_input_name(t)) for t in tree.flatten(model.inputs)]
    outputs = tree.flatten(model.outputs)
    names = list(getattr(model, "output_names", None) or range(len(outputs)))
    losses = model.loss if isinstance(model.loss, (list, tuple)) else (
        [model.loss.get(n) for n in names] if isinstance(model.loss, dict) else [model.loss] * len(outputs))
    labels, label_names = [], (["label"] if len(outputs) == 1 else [f"label_{n}" for n in names])
    for t, loss, name in zip(outputs, losses, label_names):
        sparse = _is_sparse(loss)
        labels.append(tf.TensorSpec([None, *t.shape[1:-1 if sparse else None]], "int32" if sparse else t.dtype,
                                    name=name))
    clash = sorted({s.name for s in inputs} & set(label_names))
    if clash:
        raise InputError(f"model input {clash[0]!r} has the name of a label; rename the input")
    return inputs, labels, label_names


def _keras_step(model):
    """(train, serve, input specs, label specs): Keras' ``train_step`` on one batch, its metrics
    stateless, and the model in inference mode."""
    import numpy as np
    import keras
    from keras import tree

    model_inputs, labels, _ = _specs(model)
    structure = model._inputs_struct if hasattr(model, "_inputs_struct") else None

    def pack_x(xs):
        return tree.pack_sequence_as(structure, list(xs)) if structure is not None else (
            xs[0] if len(xs) == 1 else list(xs))

    def pack_y(ys, y_pred):
        return tree.pack_sequence_as(y_pred, list(ys)) if tree.is_nested(y_pred) else ys[0]

    # the compiled loss and metrics build their trackers eagerly, before the step is traced
    zeros = [np.zeros([1, *[d or 1 for d in s.shape[1:]]], s.dtype.as_numpy_dtype) for s in model_inputs + labels]
    y_pred0 = model(pack_x(zeros[:len(model_inputs)]), training=False)
    y0 = pack_y(zeros[len(model_inputs):], y_pred0)
    model._compile_loss.build(y0, y_pred0)
    metrics = getattr(model, "_compile_metrics", None)
    if metrics is not None and not metrics.built:
        metrics.build(y0, y_pred0)
    optimizer = model.optimizer
    if not optimizer.built:
        optimizer.build(model.trainable_variables)

    def train(*args):
        import tensorflow as tf

        x = pack_x(args[:len(model_inputs)])
        with tf.GradientTape() as tape:
            y_pred = model(x, training=True) if model._call_has_training_arg else model(x)
            y = pack_y(args[len(model_inputs):], y_pred)
            # the compiled loss's per-output trackers start from nothing and keep no state:
            # each reports its value on this batch
            trackers = list(model._compile_loss.metrics)
            fresh = [(v, value) for t in trackers for v, value in zip(t.variables, t.stateless_reset_state())]
            held = {id(v) for v, _ in fresh}
            state = [(v, v.value) for v in model.variables if id(v) not in held]
            with keras.StatelessScope(state_mapping=state + fresh) as scope:
                loss = model._compute_loss(x=x, y=y, y_pred=y_pred, sample_weight=None, training=True)
            scaled = optimizer.scale_loss(loss)
        weights = model.trainable_weights
        optimizer.apply_gradients(zip(tape.gradient(scaled, weights), weights))
        out = {"loss": loss}
        for t in trackers:
            out[t.name] = tf.cast(t.stateless_result([scope.get_current_value(v) for v in t.variables]), tf.float32)
        if metrics is not None and metrics.variables:
            values = metrics.stateless_update_state(metrics.stateless_reset_state(), y, y_pred)
            for key, value in sorted(metrics.stateless_result(values).items()):
                if key != "loss":
                    out[key] = tf.cast(value, tf.float32)
        return out

    def serve(*args):
        y = model(pack_x(args), training=False)
        return {f"output_{i}": t for i, t in enumerate(tree.flatten(y))}

    return train, serve, model_inputs, labels


def _fine_tune_step(path: str, loss_name: str, optimizer_spec: str, label: str):
    """(train, serve, input specs, label specs, objects to save) over the serving function of
    the inference SavedModel at ``path``."""
    import tensorflow as tf

    from vfgraph.io.savedmodel import load_to_run

    loss_fn, optimizer = _keras_loss(loss_name), _keras_optimizer(optimizer_spec)
    loaded = load_to_run(path)
    if "serving_default" not in loaded.signatures:
        raise InputError(f"{path}: no serving_default signature to fine-tune (has: "
                         f"{', '.join(sorted(loaded.signatures)) or 'none'}); export the model with model.export()")
    trains = sorted(k for k in loaded.signatures if k.startswith("train"))
    if trains:
        raise InputError(f"{path}: the model has a training step already (signature {trains[0]!r}); leave out "
                         f"{LOSS_FLAG} and {OPTIMIZER_FLAG} to rewrite it")
    fn = loaded.signatures["serving_default"]
    weights = [v for v in fn.variables if v.trainable]
    if not weights:
        raise InputError(f"{path}: its serving function reads no trainable variable, so there is nothing to "
                         "fine-tune; export the model with its variables trainable (tf.saved_model.save(model))")
    specs = fn.structured_input_signature[1]
    names = sorted(specs)
    outputs = sorted(fn.structured_outputs)
    if len(outputs) != 1:
        raise InputError(f"{path}: serving_default has {len(outputs)} outputs ({', '.join(outputs)}); "
                         f"{LOSS_FLAG} applies to a model with one output")
    if label in specs:
        raise InputError(f"--label {label}: the model has an input of that name; give another with --label")
    out_spec = fn.structured_outputs[outputs[0]]
    sparse = _is_sparse(loss_name)
    label_spec = tf.TensorSpec([None, *out_spec.shape[1:-1 if sparse else None]], tf.int32 if sparse
                               else out_spec.dtype, name=label)
    inputs = [tf.TensorSpec(specs[n].shape, specs[n].dtype, name=n) for n in names]
    optimizer.build(weights)

    def train(*args):
        with tf.GradientTape() as tape:
            y_pred = fn(**dict(zip(names, args[:-1])))[outputs[0]]
            loss = tf.reduce_mean(loss_fn(args[-1], y_pred))
        optimizer.apply_gradients(zip(tape.gradient(loss, weights), weights))
        return {"loss": loss}

    def serve(*args):
        return fn(**dict(zip(names, args)))

    return train, serve, inputs, [label_spec], (loaded, optimizer, weights)


def _save_step(train, serve, inputs, labels, keep, out: str) -> None:
    """Save the two steps (and the objects ``keep`` holds, their variables) as a SavedModel at ``out``."""
    import tensorflow as tf

    module = tf.Module()
    module.keep = keep
    module.train = tf.function(train, input_signature=inputs + labels, autograph=False)
    module.serve = tf.function(serve, input_signature=inputs, autograph=False)
    tf.saved_model.save(module, out, signatures={"train": module.train.get_concrete_function(),
                                                 "serving_default": module.serve.get_concrete_function()})


def _main(argv: List[str]) -> int:
    import argparse
    import importlib

    p = argparse.ArgumentParser(prog="python -m vfgraph.io.keras_file")
    p.add_argument("kind", choices=["keras", "fine-tune"])
    p.add_argument("source")
    p.add_argument("out")
    p.add_argument("--import", dest="imports", action="append", default=[])
    p.add_argument("--loss", default="")
    p.add_argument("--optimizer", default="")
    p.add_argument("--label", default="label")
    a = p.parse_args(argv)
    try:
        for name in a.imports:
            try:
                importlib.import_module(name)
            except Exception as e:  # the user's module: any error it raises, in one line
                raise InputError(f"--import {name}: cannot import it ({_first(e)}); give a module on the Python "
                                 "path (PYTHONPATH, or the current directory)") from None
        if a.kind == "keras":
            model = _load_model(a.source)
            train, serve, inputs, labels = _keras_step(model)
            keep = (model, model.optimizer)
        else:
            train, serve, inputs, labels, keep = _fine_tune_step(a.source, a.loss, a.optimizer, a.label)
        _save_step(train, serve, inputs, labels, keep, a.out)
    except InputError as e:
        print(_ERROR + str(e), file=sys.stderr)
        return 2
    return 0


if __name__ == "__main__":
    sys.exit(_main(sys.argv[1:]))
