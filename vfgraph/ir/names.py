"""Deterministic names: ``vf/<pass>/<origin>/<role>``, unique within one graph."""
from __future__ import annotations

import re
from typing import Iterable

_BAD = re.compile(r"[^A-Za-z0-9_./\-]")


class NameAuthority:
    """Hands out node names that are unique in one graph and depend only on the request.

    No global counters: the same sequence of requests on the same graph gives the same names.
    """

    def __init__(self, taken: Iterable[str] = ()):
        self._taken = set(taken)

    def reserve(self, name: str) -> None:
        self._taken.add(name)

    def fresh(self, pass_name: str, origin: str, role: str) -> str:
        base = "/".join(p for p in ("vf", pass_name, _BAD.sub("_", origin), role) if p)
        name, k = base, 1
        while name in self._taken:
            name = f"{base}_{k}"
            k += 1
        self._taken.add(name)
        return name


def function_name(*parts: str) -> str:
    """A library function name built from parts (letters, digits and underscores only)."""
    return "__vf_" + "_".join(re.sub(r"[^A-Za-z0-9_]", "_", p).strip("_") for p in parts if p)
