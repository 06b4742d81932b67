"""Deterministic names for the library functions passes add."""
from __future__ import annotations

import re


def function_name(*parts: str) -> str:
    """A library function name built from parts (letters, digits and underscores only)."""
    return "__vf_" + "_".join(re.sub(r"[^A-Za-z0-9_]", "_", p).strip("_") for p in parts if p)
