"""Passes, pipelines and the registry.

A pass is a frozen dataclass with a kebab-case ``name`` and its options as fields;
``call(item)`` returns a :class:`PassResult`. A pipeline is a string users can paste:
``split-vnodes{vnodes=8},microbatch-inference{vnode-batch=16}``.
"""
from __future__ import annotations

import dataclasses
import importlib
import logging
import re
from dataclasses import dataclass
from typing import Callable, ClassVar, Dict, List, Optional, Sequence, Tuple

from vfgraph.errors import PipelineError, VfgraphError
from vfgraph.item import GraphItem

log = logging.getLogger("vfgraph.passes")


@dataclass
class PassResult:
    item: GraphItem
    modified: bool
    notes: List[str] = dataclasses.field(default_factory=list)


@dataclass(frozen=True)
class Pass:
    """Base class: subclasses set ``name`` and implement :meth:`call`."""

    name: ClassVar[str] = ""

    def call(self, item: GraphItem) -> PassResult:  # pragma: no cover - interface
        raise NotImplementedError

    def spec(self) -> str:
        """This pass as pipeline text (options at their non-default values, kebab-case)."""
        opts = []
        for f in dataclasses.fields(self):
            v = getattr(self, f.name)
            if v != f.default:
                opts.append(f"{f.name.replace('_', '-')}={_fmt(v)}")
        return self.name + ("{" + ",".join(opts) + "}" if opts else "")

    def __call__(self, item: GraphItem) -> PassResult:
        return self.call(item)


def _fmt(v) -> str:
    return str(v).lower() if isinstance(v, bool) else str(v)


# ------------------------------------------------------------------- registry
# name -> module under vfgraph.rewrites; imported on first use.
REGISTRY: Dict[str, str] = {
    "split-vnodes": "split_vnodes",
    "microbatch-inference": "microbatch_inference",
    "insert-allreduce": "insert_allreduce",
}


def get_pass_class(name: str):
    if name not in REGISTRY:
        raise PipelineError(f"unknown pass {name!r}; known passes: {', '.join(sorted(REGISTRY))}")
    module = importlib.import_module(f"vfgraph.rewrites.{REGISTRY[name]}")
    cls_name = "".join(p.capitalize() for p in name.split("-")) + "Pass"
    return getattr(module, cls_name)


_SPEC = re.compile(r"\s*([a-z][a-z0-9-]*)\s*(?:\{([^{}]*)\})?\s*(?:,|$)")


def parse_pipeline(text: str) -> List[Pass]:
    """Parse ``name{opt=v,...},name2`` into pass instances."""
    passes: List[Pass] = []
    pos = 0
    text = text.strip()
    if not text:
        raise PipelineError("empty pipeline; give at least one pass, e.g. 'split-vnodes{vnodes=8}'")
    while pos < len(text):
        m = _SPEC.match(text, pos)
        if not m or m.end() == pos:
            raise PipelineError(f"cannot parse pipeline at column {pos + 1}: {text[pos:pos + 30]!r}")
        name, body = m.group(1), m.group(2)
        cls = get_pass_class(name)
        fields = {f.name: f for f in dataclasses.fields(cls)}
        kwargs = {}
        for opt in filter(None, (o.strip() for o in (body or "").split(","))):
            if "=" not in opt:
                raise PipelineError(f"pass {name!r}: option {opt!r} needs a value (key=value)")
            k, v = (s.strip() for s in opt.split("=", 1))
            key = k.replace("-", "_")
            if key not in fields:
                raise PipelineError(f"pass {name!r} has no option {k!r}; options: "
                                    f"{', '.join(f.replace('_', '-') for f in fields) or 'none'}")
            kwargs[key] = _convert(name, k, v, fields[key])
        passes.append(cls(**kwargs))
        pos = m.end()
    return passes


def _convert(pass_name: str, key: str, value: str, field):
    typ = field.type if isinstance(field.type, str) else getattr(field.type, "__name__", "str")
    try:
        if "bool" in typ:
            if value.lower() not in ("true", "false", "1", "0"):
                raise ValueError(value)
            return value.lower() in ("true", "1")
        if "int" in typ:
            return int(value)
        if "float" in typ:
            return float(value)
    except ValueError:
        raise PipelineError(f"pass {pass_name!r}: option {key}={value!r} is not a valid {typ}") from None
    return value


class Sequential:
    """Runs passes in order; a failure names the pass and the passes that ran before it."""

    def __init__(self, passes: Sequence[Pass], after_each: Optional[Callable[[Pass, GraphItem], None]] = None):
        self.passes = list(passes)
        self.after_each = after_each

    def spec(self) -> str:
        return ",".join(p.spec() for p in self.passes)

    def __call__(self, item: GraphItem) -> Tuple[GraphItem, List[str]]:
        """Run the passes. A pass's new item is handed to the next pass to edit in place
        (only the first copy is made); ``after_each`` sees each one before the next pass runs."""
        done: List[str] = []
        notes: List[str] = []
        try:
            for p in self.passes:
                try:
                    result = p.call(item)
                except VfgraphError as e:
                    before = f" (after {', '.join(done)})" if done else ""
                    raise type(e)(f"pass {p.name}{before}: {e}") from None
                if result.item is not item:
                    result.item._pipeline_owned = True
                item = result.item
                notes.extend(result.notes)
                done.append(p.name)
                log.info("pass %s: %s", p.name, "modified" if result.modified else "no change")
                if self.after_each is not None:
                    self.after_each(p, item)
        finally:
            item._pipeline_owned = False
        return item, notes
