"""Training steps written the way users export them: a ``tf.Module`` whose ``train`` signature
runs one step on a batch dict and whose ``serving_default`` runs the model, saved by
``tf.saved_model.save``. For tests and tools that need such a model with a particular
training option or construct."""
from __future__ import annotations

import os
from typing import Callable, Dict, Iterable, Optional, Union


def save_step(path: Union[str, os.PathLike], step: Callable[[dict], Dict[str, object]], specs: dict,
              variables: Iterable, tracked: Iterable = (), serve: Optional[Callable] = None,
              serve_spec=None) -> str:
    """Write a SavedModel at ``path`` whose ``train`` signature runs ``step(batch)`` (a dict of
    outputs) over the batch ``specs``, and with ``serve`` a ``serving_default`` running
    ``serve(x)`` over ``serve_spec``. ``variables``: every variable the functions read (the
    module keeps them, Keras state included); ``tracked``: objects whose state is saved too
    (optimizers). Returns the path."""
    import tensorflow as tf

    class Step(tf.Module):
        def __init__(self):
            super().__init__()
            self.model_variables = list(variables)
            self.tracked = list(tracked)

        @tf.function(input_signature=[specs])
        def train(self, batch):
            return step(batch)

    module = Step()
    signatures = {"train": module.train}
    if serve is not None:
        module.serve = tf.function(serve, input_signature=[serve_spec])
        signatures["serving_default"] = module.serve
    tf.saved_model.save(module, os.fspath(path), signatures=signatures)
    return os.fspath(path)
