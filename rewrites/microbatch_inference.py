"""microbatch-inference: serve requests of any size in slices of at most ``b`` examples."""
from __future__ import annotations

from dataclasses import dataclass
from typing import ClassVar

from vfgraph.item import GraphItem
from vfgraph.passes.base import Pass, PassResult


@dataclass(frozen=True)
class MicrobatchInferencePass(Pass):
    name: ClassVar[str] = "microbatch-inference"
    vnode_batch: int = 0

    def call(self, item: GraphItem) -> PassResult:
        return PassResult(item, False)
