"""GraphItem: what a pass sees (the GrapplerItem analogue)."""
from __future__ import annotations

import pickle
from dataclasses import dataclass, field
from typing import Dict, List, Optional

from tensorflow.core.framework import function_pb2
from tensorflow.core.protobuf import saved_model_pb2

from vfgraph.ir.library import Library


@dataclass
class TensorSpecInfo:
    """One user-facing input or output of a signature."""

    key: str          # name in the signature (what users feed / fetch)
    dtype: int        # types_pb2 enum
    shape: Optional[List[int]]  # -1 for unknown dims; None for unknown rank


@dataclass
class VariableInfo:
    """A variable captured by a signature function (a resource argument)."""

    name: str
    dtype: int
    shape: Optional[List[int]]
    trainable: Optional[bool] = None


@dataclass
class SignatureInfo:
    """A serving/training signature and the library function that implements it."""

    key: str
    function: str                       # the library function holding the real ops
    batch_args: List[str]               # data (non-resource) arguments of ``function``, in order
    input_keys: Dict[str, str]          # function arg name -> signature input key
    resource_args: List[str]            # resource arguments of ``function``
    variables: Dict[str, VariableInfo]  # resource arg name -> variable
    inputs: List[TensorSpecInfo] = field(default_factory=list)
    outputs: List[TensorSpecInfo] = field(default_factory=list)
    call_inputs: List[str] = field(default_factory=list)  # TF1: graph nodes feeding ``function``
    output_keys: List[str] = field(default_factory=list)  # TF1: signature output keys, in order
    # non-resource arguments bound to captured values rather than fed (a constant captured from
    # eager code: Gemma's embedding scale, a Normalization layer's mean)
    captured_args: List[str] = field(default_factory=list)

    @property
    def invariant_args(self) -> List[str]:
        """Arguments every virtual node and slice reads unchanged: the variables, then the captured values."""
        return self.resource_args + self.captured_args

    @property
    def is_training(self) -> bool:
        return self.key == "train" or self.key.startswith("train")


@dataclass
class GraphItem:
    """A loaded model: its protos, its signatures and what passes must preserve."""

    source: str
    kind: str  # "saved_model"
    saved_model: saved_model_pb2.SavedModel
    signatures: Dict[str, SignatureInfo]
    preserve: set = field(default_factory=set)
    metadata: Dict[str, object] = field(default_factory=dict)
    variables_prefix: str = ""  # checkpoint holding the variables when not source/variables (TF1 .meta)
    _library: Optional[Library] = field(default=None, init=False, repr=False, compare=False)

    @property
    def meta_graph(self):
        return self.saved_model.meta_graphs[0]

    @property
    def functions(self) -> Library:
        """The function library, read and written in place (see :class:`vfgraph.ir.library.Library`)."""
        proto = self.meta_graph.graph_def.library
        if self._library is None or self._library.proto is not proto:
            self._library = Library(proto)
        return self._library

    @property
    def library(self) -> Dict[str, function_pb2.FunctionDef]:
        """The library's functions by name, as they are now: a snapshot that functions added
        later do not change (the FunctionDefs themselves are the library's)."""
        return self.functions.snapshot()

    def function(self, name: str) -> function_pb2.FunctionDef:
        return self.functions[name]

    def set_function(self, fdef: function_pb2.FunctionDef) -> None:
        """Add ``fdef`` to the library, replacing a function of the same name."""
        self.functions.put(fdef)

    def new_function(self, name: str) -> function_pb2.FunctionDef:
        """An empty function ``name`` in the library, to be filled in place; replaces a
        function of that name."""
        return self.functions.new(name)

    def has_function(self, name: str) -> bool:
        return name in self.functions

    def copy(self) -> "GraphItem":
        sm = saved_model_pb2.SavedModel()
        sm.CopyFrom(self.saved_model)
        # a pickle round trip copies the signature records and metadata (plain dataclasses,
        # dicts, lists) several times faster than copy.deepcopy
        signatures, metadata = pickle.loads(pickle.dumps((self.signatures, self.metadata), pickle.HIGHEST_PROTOCOL))
        return GraphItem(self.source, self.kind, sm, signatures, set(self.preserve), metadata, self.variables_prefix)

    def training_signature(self, key: Optional[str] = None) -> Optional[SignatureInfo]:
        if key is not None:
            return self.signatures.get(key)
        cands = [s for s in self.signatures.values() if s.is_training]
        return cands[0] if len(cands) == 1 else (self.signatures.get("train") if cands else None)

    def inference_signatures(self, train_key: Optional[str] = None) -> List[SignatureInfo]:
        t = self.training_signature(train_key)
        return [s for k, s in sorted(self.signatures.items()) if t is None or k != t.key]
