"""The pass manager: runs a pipeline of passes over an item and holds them to their contract.

It owns copying (the caller's item is copied once, before the first pass that edits, unless
the caller hands it over), checks each pass's ``requires`` before it runs and ``produces``
after (and that it wrote no record of a type it does not declare), names the failing pass
(and the passes before it) in any error while keeping the error's cause, and, with
``verify_each``, checks after every pass what TensorFlow's loader would read
(:func:`vfgraph.verification.verify`), so the pass that broke a graph is the one named.
"""
from __future__ import annotations

import json
import logging
from typing import Callable, Dict, List, Optional, Sequence, Tuple, Type

from vfgraph import records
from vfgraph.errors import InternalError, PipelineError, VfgraphError
from vfgraph.item import GraphItem
from vfgraph.passes.base import Pass, registered
from vfgraph.verification import verify

log = logging.getLogger("vfgraph.passes")

AfterEach = Callable[[Pass, GraphItem], None]


class PassManager:
    """Runs ``passes`` in order.

    ``verify_each``: verify the item after every pass that changed it (a debugging aid: the
    first pass whose result TensorFlow's loader would refuse is named); the result of the
    whole pipeline is verified by :func:`vfgraph.rewrite` in any case. ``after_each(pass,
    item)`` sees each pass's result before the next pass edits it in place (``item.copy()``
    keeps one)."""

    def __init__(self, passes: Sequence[Pass], verify_each: bool = False, after_each: Optional[AfterEach] = None):
        self.passes = list(passes)
        self.verify_each = verify_each
        self.after_each = after_each

    def spec(self) -> str:
        return ",".join(p.spec() for p in self.passes)

    def run(self, item: GraphItem, owned: bool = False) -> Tuple[GraphItem, List[str]]:
        """Run the passes over ``item``; returns the resulting item and the passes' notes.
        ``owned``: the caller hands ``item`` over (nothing else holds it), so it is edited in
        place; otherwise it is left as it was and the result is a copy (or ``item`` itself
        when no pass edits)."""
        done: List[str] = []
        notes: List[str] = []
        for p in self.passes:
            where = f"pass {p.name}" + (f" (after {', '.join(done)})" if done else "")
            missing = [r for r in p.requires if not records.get(item, r)]
            if missing:
                raise PipelineError(f"{where}: needs the {missing[0].__name__} record; {_remedy(missing[0])}")
            if p.edits and not owned:
                item, owned = item.copy(), True
            before = _stored_records(item)
            try:
                result = p.call(item)
            except VfgraphError as e:
                raise _with_context(e, where) from e
            except Exception as e:  # a pass's bug: name the pass, keep the cause
                raise InternalError(f"{where} failed: {type(e).__name__}: {e}") from e
            if result.item is not item:
                raise InternalError(f"{where} returned another item than the one it was given")
            if result.modified and not p.edits:
                raise InternalError(f"{where} declares edits = False but changed the item")
            _check_writes(p, where, before, _stored_records(item))
            if result.modified:
                absent = [r for r in p.produces if not records.get(item, r)]
                if absent:
                    raise InternalError(f"{where} changed the model but published no {absent[0].__name__} record, which "
                                        "it declares it produces")
                if self.verify_each:
                    try:
                        verify(item, relinked=True)
                    except VfgraphError as e:
                        raise InternalError(f"{where} made a model TensorFlow would not load: {e}") from e
            notes.extend(result.notes)
            done.append(p.name)
            log.info("pass %s: %s", p.name, "modified" if result.modified else "no change")
            if self.after_each is not None:
                self.after_each(p, item)
        return item, notes


def _stored_records(item: GraphItem) -> Dict[str, str]:
    """The records an item holds, by the name they are stored under, as canonical JSON text."""
    return {name: json.dumps(stored, sort_keys=True) for name, stored in records.rewrites(item).items()}


def _check_writes(p: Pass, where: str, before: Dict[str, str], after: Dict[str, str]) -> None:
    """InternalError when pass ``p`` wrote a record it does not declare: one of a type neither
    in its ``produces`` nor amended by it (:func:`records.amended_by`), or stored under a name
    no record type has."""
    allowed = set(p.produces) | set(records.amended_by(p.name))
    for name in sorted(set(before) | set(after)):
        if before.get(name) == after.get(name):
            continue
        kind = records.kind_of(name)
        if kind is None:
            raise InternalError(f"{where} wrote records under {name!r}, which no record type of vfgraph.records is "
                                "stored under")
        if kind not in allowed:
            raise InternalError(f"{where} wrote the {kind.__name__} record, which it does not declare it produces")


def _remedy(record: Type) -> str:
    makers = [name for name, cls in registered().items() if record in cls.produces]
    if not makers:
        return "no registered pass produces it"
    return f"run {' or '.join(makers)} before it in the pipeline, or rewrite a model {makers[0]} already rewrote"


def _with_context(e: VfgraphError, where: str) -> VfgraphError:
    """``e`` with ``where`` before its message: the same type, exit code, rank and label
    (built without its class's constructor, which may wrap the message again)."""
    out = type(e).__new__(type(e))
    Exception.__init__(out, f"{where}: {e}" if str(e) else "")
    out.__dict__.update(e.__dict__)
    return out
