"""A pass written outside vfgraph: ``check-outputs`` makes every serving signature fail on a
NaN or infinite output instead of returning it.

It is the worked example of docs/architecture.md ("Writing a pass"): one module, registered
by its decorator. Import it (or declare it under the ``vfgraph.passes`` entry-point group of
your package) and name it in a pipeline:

    import check_outputs, vfgraph
    item = vfgraph.rewrite("model_dir", pipeline="check-outputs{message=bad output}")
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import ClassVar

from tensorflow.core.framework import types_pb2

from vfgraph.ir.attrs import type_attr
from vfgraph.ir.graph import FunctionGraph, parse_input
from vfgraph.passes.base import Pass, PassResult, option, register

FLOATS = (types_pb2.DT_HALF, types_pb2.DT_BFLOAT16, types_pb2.DT_FLOAT, types_pb2.DT_DOUBLE)


@register
@dataclass(frozen=True)
class CheckOutputsPass(Pass):
    """Check every floating-point output of the serving signatures with CheckNumerics: a
    request whose result holds a NaN or an infinity fails with ``message``."""

    name: ClassVar[str] = "check-outputs"
    message: str = option("vfgraph: non-finite serving output", "the error a bad output raises")

    def call(self, item):
        changed = False
        done = set()
        for sig in item.inference_signatures():
            if sig.function in done:
                continue
            done.add(sig.function)
            fdef = item.function(sig.function)
            g = FunctionGraph.over(fdef, item.library)  # reads the function and writes into it
            for out in g.signature.output_arg:
                if out.type not in FLOATS:
                    continue
                ref, _ = parse_input(fdef.ret[out.name])
                checked = g.op("CheckNumerics", [ref], name=f"check_{out.name}", T=type_attr(out.type),
                               message=self.message)
                fdef.ret[out.name] = str(checked[0])
                changed = True
            g.finish()  # verifies the edited function
        return PassResult(item, changed, [] if changed else ["check-outputs: no floating-point serving output"])
