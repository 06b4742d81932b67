"""GraphItem: what a pass sees (the GrapplerItem analogue)."""
from __future__ import annotations

import pickle
from dataclasses import dataclass, field
from typing import Dict, List, Optional

from tensorflow.core.framework import function_pb2
from tensorflow.core.protobuf import saved_model_pb2


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

    @property
    def meta_graph(self):
        return self.saved_model.meta_graphs[0]

    @property
    def library(self) -> Dict[str, function_pb2.FunctionDef]:
        return {f.signature.name: f for f in self.meta_graph.graph_def.library.function}

    def function(self, name: str) -> function_pb2.FunctionDef:
        for f in self.meta_graph.graph_def.library.function:
            if f.signature.name == name:
                return f
        raise KeyError(name)

    def set_function(self, fdef: function_pb2.FunctionDef) -> None:
        """Add ``fdef`` to the library, replacing a function of the same name."""
        self.new_function(fdef.signature.name).CopyFrom(fdef)

    def new_function(self, name: str) -> function_pb2.FunctionDef:
        """An empty function ``name`` in the library, to be filled in place (a large generated
        function then is not built once and copied again); replaces a function of that name."""
        lib = self.meta_graph.graph_def.library.function
        fdef = next((f for f in lib if f.signature.name == name), None)
        if fdef is None:
            fdef = lib.add()
        fdef.Clear()
        fdef.signature.name = name
        return fdef

    def has_function(self, name: str) -> bool:
        return any(f.signature.name == name for f in self.meta_graph.graph_def.library.function)

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
