"""Passes, the registry and the pipeline grammar.

A pass is a frozen dataclass with a kebab-case ``name`` and its options as fields, made
known by :func:`register`; ``call(item)`` returns a :class:`PassResult`. A pipeline is a
string users can paste: ``split-vnodes{vnodes=8},microbatch-inference{vnode-batch=16}``;
:class:`vfgraph.passes.manager.PassManager` runs one. An option declared with a flag
(:func:`option`) is also a flag of ``vfgraph rewrite`` (:func:`flags`), with the same help and
check: the one place an option is declared.
"""
from __future__ import annotations

import dataclasses
import importlib
import importlib.metadata
import pkgutil
import re
import typing
from dataclasses import dataclass
from typing import ClassVar, Dict, Iterable, List, Optional, Tuple, TypeVar, Union

from vfgraph.errors import PipelineError
from vfgraph.item import GraphItem


class OptionError(PipelineError):
    """A pass option's value is refused by its declaration (:func:`option`): ``pass_name``,
    ``option`` (kebab-case), ``value`` and ``problem`` (what to give instead), so that a command
    line can name its own flag for it."""

    def __init__(self, pass_name: str, option: str, value, problem: str):
        super().__init__(f"pass {pass_name!r}: option {option}={_fmt(value)}: {problem}")
        self.pass_name, self.option, self.value, self.problem = pass_name, option, value, problem


@dataclass
class PassResult:
    """What a pass returns: the item (the one it was given, edited or not), whether it
    changed, and notes for the user."""

    item: GraphItem
    modified: bool
    notes: List[str] = dataclasses.field(default_factory=list)


@dataclass(frozen=True)
class Pass:
    """Base class of passes: a frozen dataclass whose fields are its options.

    Subclasses set ``name`` (kebab-case, the pipeline name), implement :meth:`call` and are
    registered with :func:`register`. The contract, checked by :class:`PassManager`:

    - ``requires``: record types (:mod:`vfgraph.records`) the item must hold before the pass
      runs, from an earlier pass or from the model it was loaded from;
    - ``produces``: record types the pass publishes when it changes the item;
    - ``edits``: whether the pass may change the item. The item :meth:`call` gets is then the
      manager's own (a copy of the caller's, made once per pipeline), edited in place and
      returned; a pass with ``edits = False`` only reads it.
    """

    name: ClassVar[str] = ""
    requires: ClassVar[Tuple[type, ...]] = ()
    produces: ClassVar[Tuple[type, ...]] = ()
    edits: ClassVar[bool] = True

    def __post_init__(self) -> None:
        """Check every option against its declaration (:func:`option`): its type, a finite
        number, within its bounds; a pass built with a bad option is refused here, from a
        pipeline or from Python alike."""
        types = option_types(type(self))
        for f in dataclasses.fields(self):
            problem = _option_problem(getattr(self, f.name), types[f.name], f.metadata)
            if problem:
                raise OptionError(self.name, f.name.replace("_", "-"), getattr(self, f.name), problem)

    def call(self, item: GraphItem) -> PassResult:  # pragma: no cover - interface
        raise NotImplementedError

    def differences(self, record) -> Optional[List[str]]:
        """How this pass's options differ from those ``record`` (one this pass produced, of the
        signature it is asked to rewrite) says it ran with, as ``option=given (recorded: x)``
        texts: an empty list when running again would change nothing (the signature is then
        left as it is); None (the default) when the record cannot tell, so a second run is
        refused."""
        return None

    def rewritten_before(self, item: GraphItem, key: str) -> Optional[str]:
        """Whether a record of this pass's (its ``produces``) says it rewrote signature ``key``
        already: None when none does; a note when one does and :meth:`differences` finds none
        (the signature is left as it is); otherwise a :class:`PipelineError` saying what was
        rewritten and what to do. The one place a second run of a pass is decided."""
        from vfgraph import records

        for kind in self.produces:
            rec = records.get(item, kind).get(key)
            if rec is None:
                continue
            diff = self.differences(rec)
            if diff == []:
                return f"signature {key!r}: {self.name} rewrote it already with these options; left as it is"
            what = f" ({'; '.join(diff)})" if diff else ""
            raise PipelineError(f"signature {key!r} of {item.source} was rewritten by {self.name} already{what}; "
                                f"a second {self.name} does not compose with the first: rewrite the original model "
                                "(the one given to the first rewrite) with all the options at once")
        return None

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


INT_MAX = 2 ** 31 - 1  # an int option is at most this: it becomes an int32 in the graph


def option(default, help: str, low: Optional[float] = None, high: Optional[float] = None,
           above: Optional[float] = None, flag: Union[bool, str] = False, metavar: Optional[str] = None,
           choices: Optional[Tuple[str, ...]] = None, check: Optional[typing.Callable[[typing.Any], str]] = None):
    """A pass option: its default, a line of help (``vfgraph passes`` and the flag's ``--help``
    show it) and, for a number, its bounds (``low`` / ``high`` inclusive, ``above`` exclusive;
    an int is at most :data:`INT_MAX`, a float is finite). The pass checks them when it is built
    (:meth:`Pass.__post_init__`).

    ``flag``: the command-line flag that sets it (:func:`flags`): True for ``--`` and the
    option's kebab-case name, or its spelling (``"--x"``); options of several passes may share
    one, which then sets each of them. ``metavar``: the flag's value in ``--help``.
    ``choices``: the texts a str option takes (the flag refuses others at once; the pass when
    it runs). ``check``: a further check of a value of the right type (a size's text), giving
    what is wrong with it ('' for nothing), made wherever the bounds are."""
    return dataclasses.field(default=default, metadata={"help": help, "low": low, "high": high, "above": above,
                                                        "flag": flag, "metavar": metavar, "choices": choices,
                                                        "check": check})


def _option_problem(value, typ: type, meta) -> str:
    """What is wrong with ``value`` for an option of type ``typ`` and bounds ``meta``, or ''."""
    import math

    if typ is bool:
        return "" if isinstance(value, bool) else "give true or false"
    if typ is str:
        if not isinstance(value, str):
            return "give a name (text)"
        return meta["check"](value) if meta.get("check") else ""
    if isinstance(value, bool) or not isinstance(value, (int, float)) or (typ is int and not isinstance(value, int)):
        return f"give {_OPTION_TYPES[typ]}"
    if typ is float and not math.isfinite(value):
        return "give a finite number"
    low, high, above = meta.get("low"), meta.get("high"), meta.get("above")
    if high is None and typ is int:
        high = INT_MAX
    if (low is not None and value < low) or (above is not None and value <= above) or (high is not None
                                                                                        and value > high):
        span = [f"at least {_fmt(low)}"] if low is not None else [f"above {_fmt(above)}"] if above is not None else []
        span += [f"at most {_fmt(high)}"] if high is not None else []
        return f"out of range; give {_OPTION_TYPES[typ]} {' and '.join(span)}"
    return ""


def describe(cls: type) -> dict:
    """What ``vfgraph passes`` shows of pass class ``cls``: its name, a summary (the first
    paragraph of its docstring), its options (type, default, help, command-line flag), the
    records it requires and produces, and whether it edits the model."""
    doc = (cls.__doc__ or "").strip().split("\n\n")[0]
    types = option_types(cls)
    return {"name": cls.name, "summary": " ".join(doc.split()),
            "options": [{"name": f.name.replace("_", "-"), "type": types[f.name].__name__, "default": f.default,
                         "help": f.metadata.get("help", ""), "flag": flag_of(f)} for f in dataclasses.fields(cls)],
            "requires": [r.__name__ for r in cls.requires], "produces": [r.__name__ for r in cls.produces],
            "edits": cls.edits}


# ------------------------------------------------------------- command-line flags
@dataclass(frozen=True)
class Flag:
    """A command-line flag made from the pass options that declare it (:func:`option`'s
    ``flag``): its spelling, the argparse ``dest`` it fills, its type, the value's name and
    choices, its help (the options' own), the (pass name, option field) pairs it sets, and the
    default they declare."""

    flag: str
    type: type
    metavar: Optional[str]
    choices: Optional[Tuple[str, ...]]
    help: str
    sets: Tuple[Tuple[str, str], ...]
    default: object = None  # the declared default of the first option it sets

    @property
    def dest(self) -> str:
        return self.flag[2:].replace("-", "_")

    def problem(self, value) -> Optional[OptionError]:
        """The first option this flag sets that refuses ``value`` (its declaration's check,
        the one :meth:`Pass.__post_init__` makes), as an :class:`OptionError`; None when
        every one takes it."""
        passes = registered()
        for pass_name, field in self.sets:
            cls = passes[pass_name]
            f = next(f for f in dataclasses.fields(cls) if f.name == field)
            problem = _option_problem(value, option_types(cls)[field], f.metadata)
            if not problem and self.choices and value not in self.choices:  # (argparse's check, for Python)
                problem = f"choose {' or '.join(self.choices)}"
            if problem:
                return OptionError(pass_name, field.replace("_", "-"), value, problem)
        return None


def flag_of(f: dataclasses.Field) -> Optional[str]:
    """The command-line flag option field ``f`` declares (its spelling), or None."""
    flag = f.metadata.get("flag")
    return ("--" + f.name.replace("_", "-") if flag is True else flag) or None


_FLAG = re.compile(r"--[a-z][a-z0-9]*(-[a-z0-9]+)*")


def flags(passes: Optional[Iterable[Union[str, type]]] = None) -> List[Flag]:
    """The command-line flags the options of the registered passes declare (of ``passes``
    only, by name or class, when given), in the order of the passes and their options; a flag
    several options declare appears once, with each one's help (named by its pass) and each
    one's check."""
    found: Dict[str, List[Tuple[type, dataclasses.Field]]] = {}
    chosen = registered() if passes is None else {
        getattr(p, "name", p): p if isinstance(p, type) else get_pass_class(p) for p in passes}
    for cls in chosen.values():
        for f in dataclasses.fields(cls):
            if flag_of(f):
                found.setdefault(flag_of(f), []).append((cls, f))
    out = []
    for flag, decls in found.items():
        kinds = {(option_types(cls)[f.name], f.metadata.get("choices")) for cls, f in decls}
        if len(kinds) > 1:
            raise TypeError(f"flag {flag}: options {', '.join(f'{c.name}.{f.name}' for c, f in decls)} declare it "
                            "with different types or choices")
        helps = list(dict.fromkeys(f.metadata.get("help", "") for _, f in decls))
        text = helps[0] if len(helps) == 1 else "; ".join(f"{c.name}: {f.metadata.get('help', '')}" for c, f in decls)
        cls, f = decls[0]
        out.append(Flag(flag, option_types(cls)[f.name], next((f.metadata.get("metavar") for _, f in decls
                                                               if f.metadata.get("metavar")), None),
                        f.metadata.get("choices"), text, tuple((c.name, f.name) for c, f in decls), f.default))
    return out


def _check_flags(cls: type) -> None:
    """The flags pass class ``cls`` declares are spelled as flags, a bool one is off by
    default (giving it turns it on), and choices are a str option's."""
    types = option_types(cls)
    for f in dataclasses.fields(cls):
        flag, choices = flag_of(f), f.metadata.get("choices")
        if flag and not _FLAG.fullmatch(flag):
            raise TypeError(f"{cls.__name__}.{f.name}: flag {flag!r}: give True or a kebab-case '--name'")
        if flag and types[f.name] is bool and f.default is not False:
            raise TypeError(f"{cls.__name__}.{f.name}: a bool option with a flag is false by default (the flag "
                            "turns it on)")
        if choices is not None and (types[f.name] is not str or f.default not in choices):
            raise TypeError(f"{cls.__name__}.{f.name}: choices are a str option's, its default among them")


def _fmt(v) -> str:
    return str(v).lower() if isinstance(v, bool) else str(v)


# ------------------------------------------------------------------- registry
_PASSES: Dict[str, type] = {}
_BUILTIN = "vfgraph.rewrites"  # the package of vfgraph's own passes, one module each
ENTRY_POINTS = "vfgraph.passes"  # the entry-point group other packages register passes under
_discovered = False

P = TypeVar("P", bound=type)


def register(cls: P) -> P:
    """Class decorator: make pass ``cls`` known to pipelines and ``vfgraph passes`` by its
    ``name``. Checks what a pipeline relies on: a frozen dataclass subclass of :class:`Pass`,
    a kebab-case name no other pass has, options of bool, int, float or str with defaults,
    and record types in ``requires`` / ``produces``."""
    if not (isinstance(cls, type) and issubclass(cls, Pass) and dataclasses.is_dataclass(cls)
            and cls.__dataclass_params__.frozen):
        raise TypeError(f"{cls!r}: a pass is a @dataclass(frozen=True) subclass of vfgraph.passes.base.Pass")
    if not _PASS_NAME.fullmatch(cls.name or ""):
        raise TypeError(f"{cls.__name__}.name = {cls.name!r}: give a kebab-case name, e.g. 'strip-identity'")
    other = _PASSES.get(cls.name)
    if other is not None and other.__qualname__ != cls.__qualname__:
        raise TypeError(f"{cls.__name__}: pass name {cls.name!r} is taken by {other.__module__}.{other.__qualname__}")
    option_types(cls)
    _check_flags(cls)
    missing = [f.name for f in dataclasses.fields(cls)
               if f.default is dataclasses.MISSING and f.default_factory is dataclasses.MISSING]
    if missing:
        raise TypeError(f"{cls.__name__}: options {', '.join(missing)} need defaults (a pipeline may omit them)")
    for attr in ("requires", "produces"):
        bad = [r for r in getattr(cls, attr) if not (isinstance(r, type) and isinstance(getattr(r, "PASS", None), str))]
        if bad:
            raise TypeError(f"{cls.__name__}.{attr}: {bad!r} are not record types of vfgraph.records")
    _PASSES[cls.name] = cls
    return cls


def unregister(name: str) -> None:
    """Forget the pass registered as ``name`` (a pass defined for a test)."""
    _PASSES.pop(name, None)


def registered() -> Dict[str, type]:
    """Every pass a pipeline can name, by name: vfgraph's own (each module of
    ``vfgraph.rewrites``), those other installed packages declare under the
    ``vfgraph.passes`` entry-point group, and any registered since."""
    global _discovered
    if not _discovered:
        _discovered = True
        package = importlib.import_module(_BUILTIN)
        for info in sorted(pkgutil.iter_modules(package.__path__), key=lambda m: m.name):
            importlib.import_module(f"{_BUILTIN}.{info.name}")
        for ep in sorted(importlib.metadata.entry_points(group=ENTRY_POINTS), key=lambda e: e.name):
            try:
                ep.load()
            except Exception as e:  # another package's broken plug-in: say which
                raise PipelineError(f"pass plug-in {ep.name!r} ({ep.value}) of entry-point group {ENTRY_POINTS!r} "
                                    f"failed to load: {type(e).__name__}: {e}") from e
    return dict(sorted(_PASSES.items()))


def get_pass_class(name: str) -> type:
    passes = registered()
    if name not in passes:
        raise PipelineError(f"unknown pass {name!r}; known passes: {', '.join(passes)}")
    return passes[name]


_PASS_NAME = re.compile(r"[a-z][a-z0-9]*(-[a-z0-9]+)*")
_NAME = re.compile(r"[A-Za-z0-9_-]+")


def parse_pipeline(text: str) -> List[Pass]:
    """Parse ``name{opt=v,...},name2`` into pass instances.

    Passes are separated by one ``,``; a pass's options are ``key=value`` pairs in one ``{...}``
    after its name, separated by one ``,``; spaces around names, keys and values are ignored.
    A malformed spec is refused with the 1-based column of the problem and what was expected there."""
    if not text.strip():
        raise PipelineError("empty pipeline; give at least one pass, e.g. 'split-vnodes{vnodes=8}'")
    return _PipelineReader(text).passes()


class _PipelineReader:
    """Reads a pipeline's text left to right (:func:`parse_pipeline`); ``pos`` is where it is."""

    def __init__(self, text: str):
        self.text, self.n, self.pos = text, len(text), 0

    def fail(self, at: int, problem: str) -> PipelineError:
        return PipelineError(f"pipeline {self.text!r}, column {at + 1}: {problem}")

    def skip(self) -> str:
        """Move past spaces; the character there ('' at the end)."""
        while self.pos < self.n and self.text[self.pos].isspace():
            self.pos += 1
        return self.text[self.pos] if self.pos < self.n else ""

    @staticmethod
    def found(c: str) -> str:
        return f"found {c!r}" if c else "found the end of the pipeline"

    def passes(self) -> List[Pass]:
        """Every pass of the pipeline, built with its options."""
        passes: List[Pass] = []
        comma = None
        while True:
            name = self.pass_name(comma)
            cls = get_pass_class(name)
            braced = self.skip() == "{"
            passes.append(cls(**(self.options(name, cls) if braced else {})))
            c = self.skip()
            if not c:
                return passes
            if c != ",":
                raise self._after_pass(name, braced, c)
            comma = self.pos
            self.pos += 1

    def _after_pass(self, name: str, braced: bool, c: str) -> PipelineError:
        """The error for character ``c`` where a ',' (or a '{') should follow pass ``name``."""
        if c == "}":
            hint = "" if braced else f", or open the options of pass {name!r} with '{{'"
            return self.fail(self.pos, f"'}}' without a '{{' before it; remove it{hint}")
        what = f"after the options of pass {name!r}" if braced else f"after pass {name!r}"
        expect = "','" if braced else "',' or '{'"
        return self.fail(self.pos, f"expected {expect} {what}, {self.found(c)}; separate passes with ',' and give a "
                                   "pass's options in one {key=value,...}")

    def pass_name(self, comma: Optional[int]) -> str:
        """The pass name here (``comma``: the column of the ',' before it, if any)."""
        c = self.skip()
        m = _NAME.match(self.text, self.pos)
        if m:
            self.pos = m.end()
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
        raise self.fail(self.pos, f"expected a pass name{after}, {self.found(c)}; {hint}")

    def options(self, name: str, cls: type) -> Dict[str, object]:
        """The ``{key=value,...}`` here of pass ``name`` (class ``cls``), as its options' values."""
        text, brace = self.text, self.pos
        close = next((i for i in range(brace + 1, self.n) if text[i] in "{}"), self.n)
        if close == self.n or text[close] == "{":
            before = f" before the '{{' at column {close + 1}" if close < self.n else ""
            raise self.fail(brace, f"the '{{' of pass {name!r} is not closed{before}; end its options with '}}', "
                                   f"e.g. {name}{{key=value}}")
        self.pos = brace + 1
        if self.skip() == "}":  # '{}': no options
            self.pos += 1
            return {}
        fields = {f.name: f for f in dataclasses.fields(cls)}
        types = option_types(cls)
        kwargs: Dict[str, object] = {}
        given: Dict[str, str] = {}
        comma = None
        while True:
            k, v = self.option(name, comma, close)
            key = k.replace("-", "_")
            if key not in fields:
                raise PipelineError(f"pass {name!r} has no option {k!r}; options: "
                                    f"{', '.join(f.replace('_', '-') for f in fields) or 'none'}")
            if key in given:
                raise PipelineError(f"pass {name!r}: option {k!r} given twice ({given[key]} and {v}); give it once")
            given[key] = v
            kwargs[key] = _convert(name, k, v, fields[key], types[key])
            if self.pos == close:
                self.pos += 1
                return kwargs
            comma = self.pos
            self.pos += 1

    def option(self, name: str, comma: Optional[int], close: int) -> Tuple[str, str]:
        """The ``key=value`` here, among the options of pass ``name`` that end at ``close``."""
        text = self.text
        c = self.skip()
        m = _NAME.match(text, self.pos)
        if not m:
            after = f" after the ',' at column {comma + 1}" if comma is not None else ""
            hint = ("separate options with one ','" if c == "," else
                    "remove the trailing ','" if c == "}" else "give options as key=value")
            raise self.fail(self.pos, f"expected an option (key=value) of pass {name!r}{after}, {self.found(c)}; "
                                      f"{hint}")
        k = m.group(0)
        self.pos = m.end()
        c = self.skip()
        if c in (",", "}"):
            raise self.fail(self.pos, f"pass {name!r}: option {k!r} needs a value (key=value), {self.found(c)}")
        if c != "=":
            raise self.fail(self.pos, f"pass {name!r}: expected '=' after option {k!r}, {self.found(c)}; give "
                                      "options as key=value")
        self.pos += 1
        self.skip()
        start = self.pos
        while self.pos < close and text[self.pos] != ",":
            self.pos += 1
        v = text[start:self.pos].strip()
        if not v:
            raise self.fail(start, f"pass {name!r}: option {k!r} needs a value after '=', {self.found(text[self.pos])}")
        return k, v


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
