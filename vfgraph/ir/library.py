"""A model's function library: its FunctionDefs by name, over the protobuf itself."""
from __future__ import annotations

from typing import Dict, Iterator, List, Mapping, Optional

from tensorflow.core.framework import function_pb2


class Library(Mapping[str, function_pb2.FunctionDef]):
    """The ``FunctionDefLibrary`` of a model as a mapping from name to FunctionDef. Reads and
    writes go to the protobuf: nothing is copied.

    Lookups use an index of each name's position, checked against the protobuf at every hit
    (the function stored there still has that name), so functions added, replaced, renamed or
    removed by any means are seen: a stale entry, or a miss, reads the names afresh (what one
    lookup cost before the index)."""

    def __init__(self, proto: function_pb2.FunctionDefLibrary):
        self.proto = proto
        self._pos: Dict[str, int] = {}

    def _reindex(self) -> Dict[str, int]:
        self._pos = {f.signature.name: i for i, f in enumerate(self.proto.function)}
        return self._pos

    def _find(self, name: str) -> Optional[function_pb2.FunctionDef]:
        functions = self.proto.function
        i = self._pos.get(name)
        if i is not None and i < len(functions):
            f = functions[i]
            if f.signature.name == name:
                return f
        i = self._reindex().get(name)
        return None if i is None else functions[i]

    def get(self, name: str, default: Optional[function_pb2.FunctionDef] = None):
        f = self._find(name)
        return default if f is None else f

    def __getitem__(self, name: str) -> function_pb2.FunctionDef:
        f = self._find(name)
        if f is None:
            raise KeyError(name)
        return f

    def __contains__(self, name) -> bool:
        return self._find(name) is not None

    def __iter__(self) -> Iterator[str]:
        return iter(self.names())  # a snapshot: functions may be added while iterating

    def __len__(self) -> int:
        return len(self.proto.function)

    def names(self) -> List[str]:
        """The functions' names, in stored order."""
        return [f.signature.name for f in self.proto.function]

    def snapshot(self) -> Dict[str, function_pb2.FunctionDef]:
        """The functions by name as they are now: a dict that functions added, replaced or
        renamed later do not change (the FunctionDefs themselves are the library's)."""
        out = {f.signature.name: f for f in self.proto.function}
        self._pos = {name: i for i, name in enumerate(out)} if len(out) == len(self.proto.function) else {}
        return out

    def new(self, name: str) -> function_pb2.FunctionDef:
        """An empty function ``name``, to be filled in place (a large generated function then
        is not built once and copied again); replaces a function of that name where it stands."""
        fdef = self._find(name)
        if fdef is None:
            self._pos[name] = len(self.proto.function)
            fdef = self.proto.function.add()
        fdef.Clear()
        fdef.signature.name = name
        return fdef

    def put(self, fdef: function_pb2.FunctionDef) -> function_pb2.FunctionDef:
        """A copy of ``fdef`` in the library, replacing a function of the same name."""
        out = self.new(fdef.signature.name)
        out.CopyFrom(fdef)
        return out

    def remove(self, name: str) -> None:
        i = self._reindex().get(name)
        if i is not None:
            del self.proto.function[i]
            self._pos = {}
