"""The function library: indexed by name over the protobuf itself, right after additions,
replacements, removals and changes made behind its back."""
from google.protobuf import text_format
from tensorflow.core.framework import function_pb2

from vfgraph.ir.library import Library


def _fdef(name: str, op: str = "NoOp") -> function_pb2.FunctionDef:
    return text_format.Parse(f'signature {{ name: "{name}" }} node_def {{ name: "n" op: "{op}" }}',
                             function_pb2.FunctionDef())


def test_lookups_additions_and_replacements_go_to_the_protobuf():
    proto = function_pb2.FunctionDefLibrary()
    proto.function.add().CopyFrom(_fdef("a"))
    lib = Library(proto)
    assert list(lib) == ["a"] and lib["a"] is proto.function[0] and "b" not in lib and lib.get("b") is None
    b = lib.new("b")
    b.node_def.add(name="m", op="NoOp")  # filled in place
    assert [n.name for n in proto.function[1].node_def] == ["m"]
    again = lib.put(_fdef("a", "Identity"))  # replaces where it stands
    assert again is proto.function[0] and proto.function[0].node_def[0].op == "Identity" and len(proto.function) == 2
    snap = lib.snapshot()
    lib.remove("a")
    assert list(lib) == ["b"] and "a" not in lib and set(snap) == {"a", "b"}


def test_changes_behind_the_index_are_seen():
    proto = function_pb2.FunctionDefLibrary()
    lib = Library(proto)
    assert len(lib) == 0
    proto.function.add().CopyFrom(_fdef("a"))  # added to the protobuf directly
    assert "a" in lib
    proto.function[0].signature.name = "renamed"  # renamed in place: same count
    assert "a" not in lib and lib["renamed"] is proto.function[0]
    del proto.function[0]
    proto.function.add().CopyFrom(_fdef("c"))  # removed and added: same count again
    assert "renamed" not in lib and list(lib) == ["c"]


def test_iterating_while_adding_sees_a_snapshot():
    proto = function_pb2.FunctionDefLibrary()
    lib = Library(proto)
    lib.new("a")
    for name in lib:
        lib.new(name + "_copy")
    assert lib.names() == ["a", "a_copy"]
