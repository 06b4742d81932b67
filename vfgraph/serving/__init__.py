"""``vfgraph serve``: TF Serving's REST and gRPC APIs over the SavedModels of a base path.

The modules, from the bottom: :mod:`.status` (errors with TF Serving's status codes),
:mod:`.tensors` (TF Serving's JSON mapping of tensors), :mod:`.versions` (the model's numbered
versions: loading, polling, draining), :mod:`.rest` and :mod:`.grpc_api` (the two APIs), and
:mod:`.server` (both servers in one process, signals, the access log). Nothing here imports
TensorFlow at import time except :mod:`.versions` when it loads a model.
"""
