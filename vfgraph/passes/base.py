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
import typing
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
        """This pass as pipeline text (options at their non-default values, kebab-case) that
        :func:`parse_pipeline` reads back as an equal pass."""
        opts = []
        for f in dataclasses.fields(self):
            v = getattr(self, f.name)
            if v != f.default:
                text = _fmt(v)
                if not text or text != text.strip() or any(c in text for c in ",{}"):
                    raise PipelineError(f"pass {self.name!r}: option {f.name.replace('_', '-')}={v!r} cannot be "
                                        "written in a pipeline (empty, spaces around it, or one of , { })")
                opts.append(f"{f.name.replace('_', '-')}={text}")
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


_NAME = re.compile(r"[A-Za-z0-9_-]+")


def parse_pipeline(text: str) -> List[Pass]:
    """Parse ``name{opt=v,...},name2`` into pass instances.

    Passes are separated by one ``,``; a pass's options are ``key=value`` pairs in one ``{...}``
    after its name, separated by one ``,``; spaces around names, keys and values are ignored.
    A malformed spec is refused with the 1-based column of the problem and what was expected there."""
    if not text.strip():
        raise PipelineError("empty pipeline; give at least one pass, e.g. 'split-vnodes{vnodes=8}'")
    n = len(text)
    pos = 0

    def fail(at: int, problem: str) -> PipelineError:
        return PipelineError(f"pipeline {text!r}, column {at + 1}: {problem}")

    def skip() -> str:
        """Move past spaces; the character there ('' at the end)."""
        nonlocal pos
        while pos < n and text[pos].isspace():
            pos += 1
        return text[pos] if pos < n else ""

    def found(c: str) -> str:
        return f"found {c!r}" if c else "found the end of the pipeline"

    def pass_name(comma: Optional[int]) -> str:
        nonlocal pos
        c = skip()
        m = _NAME.match(text, pos)
        if m:
            pos = m.end()
            return m.group(0)
        after = f" after the ',' at column {comma + 1}" if comma is not None else ""
        if c == "}":
            hint = "remove the '}' (it has no '{' before it)"
        elif c == ",":
            hint = "separate passes with one ','"
        elif not c:
            hint = "remove the trailing ','"
        else:
            hint = "pass names are words joined by '-', e.g. split-vnodes"
        raise fail(pos, f"expected a pass name{after}, {found(c)}; {hint}")

    def options(name: str, fields, types: Dict[str, type]) -> Dict[str, object]:
        nonlocal pos
        brace = pos
        close = next((i for i in range(brace + 1, n) if text[i] in "{}"), n)
        if close == n or text[close] == "{":
            before = f" before the '{{' at column {close + 1}" if close < n else ""
            raise fail(brace, f"the '{{' of pass {name!r} is not closed{before}; end its options with '}}', "
                              f"e.g. {name}{{key=value}}")
        pos = brace + 1
        if skip() == "}":  # '{}': no options
            pos += 1
            return {}
        kwargs: Dict[str, object] = {}
        given: Dict[str, str] = {}
        comma = None
        while True:
            c = skip()
            m = _NAME.match(text, pos)
            if not m:
                after = f" after the ',' at column {comma + 1}" if comma is not None else ""
                hint = ("separate options with one ','" if c == "," else
                        "remove the trailing ','" if c == "}" else "give options as key=value")
                raise fail(pos, f"expected an option (key=value) of pass {name!r}{after}, {found(c)}; {hint}")
            k = m.group(0)
            pos = m.end()
            c = skip()
            if c in (",", "}"):
                raise fail(pos, f"pass {name!r}: option {k!r} needs a value (key=value), {found(c)}")
            if c != "=":
                raise fail(pos, f"pass {name!r}: expected '=' after option {k!r}, {found(c)}; give options as "
                                "key=value")
            pos += 1
            skip()
            start = pos
            while pos < close and text[pos] != ",":
                pos += 1
            v = text[start:pos].strip()
            if not v:
                raise fail(start, f"pass {name!r}: option {k!r} needs a value after '=', {found(text[pos])}")
            key = k.replace("-", "_")
            if key not in fields:
                raise PipelineError(f"pass {name!r} has no option {k!r}; options: "
                                    f"{', '.join(f.replace('_', '-') for f in fields) or 'none'}")
            if key in given:
                raise PipelineError(f"pass {name!r}: option {k!r} given twice ({given[key]} and {v}); give it once")
            given[key] = v
            kwargs[key] = _convert(name, k, v, fields[key], types[key])
            if pos == close:
                pos += 1
                return kwargs
            comma = pos
            pos += 1

    passes: List[Pass] = []
    comma = None
    while True:
        name = pass_name(comma)
        cls = get_pass_class(name)
        fields = {f.name: f for f in dataclasses.fields(cls)}
        types = option_types(cls)
        braced = skip() == "{"
        passes.append(cls(**(options(name, fields, types) if braced else {})))
        c = skip()
        if not c:
            return passes
        if c != ",":
            if c == "}":
                hint = "" if braced else f", or open the options of pass {name!r} with '{{'"
                raise fail(pos, f"'}}' without a '{{' before it; remove it{hint}")
            what = f"after the options of pass {name!r}" if braced else f"after pass {name!r}"
            expect = "','" if braced else "',' or '{'"
            raise fail(pos, f"expected {expect} {what}, {found(c)}; separate passes with ',' and give a pass's "
                            "options in one {key=value,...}")
        comma = pos
        pos += 1


_OPTION_TYPES = {bool: "true or false", int: "a whole number", float: "a number", str: "a name"}


def option_types(cls) -> Dict[str, type]:
    """Each option field of pass class ``cls`` and its type (bool, int, float or str), from its
    resolved annotation, not its text."""
    hints = typing.get_type_hints(cls)
    out = {}
    for f in dataclasses.fields(cls):
        t = hints[f.name]
        if t not in _OPTION_TYPES:
            raise TypeError(f"{cls.__name__}.{f.name}: pass options are bool, int, float or str, not {t}")
        out[f.name] = t
    return out


def _convert(pass_name: str, key: str, value: str, field, typ: type):
    """An option's text as ``typ``, its field's type (bool, int, float; str stays text)."""
    try:
        if typ is bool:
            if value.lower() not in ("true", "false", "1", "0"):
                raise ValueError(value)
            return value.lower() in ("true", "1")
        if typ is int:
            return int(value)
        if typ is float:
            return float(value)
    except ValueError:
        example = "" if field.default is dataclasses.MISSING else f", e.g. {key}={_fmt(field.default)}"
        raise PipelineError(f"pass {pass_name!r}: option {key}={value!r} is not a valid {typ.__name__}; "
                            f"give {_OPTION_TYPES[typ]}{example}") from None
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
