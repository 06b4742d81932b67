"""parse_pipeline: valid specs round-trip through Pass.spec(); malformed ones name the column and what was expected."""
import re

import pytest

from vfgraph.errors import PipelineError
from vfgraph.passes.base import parse_pipeline

VALID = "split-vnodes{vnodes=8,vnode-batch=4},insert-allreduce{fusion-mb=2},microbatch-inference"


def spec_of(passes):
    return ",".join(p.spec() for p in passes)


def test_a_valid_spec_parses_and_round_trips():
    passes = parse_pipeline(VALID)
    assert [p.name for p in passes] == ["split-vnodes", "insert-allreduce", "microbatch-inference"]
    assert (passes[0].vnodes, passes[0].vnode_batch, passes[1].fusion_mb) == (8, 4, 2.0)
    text = spec_of(passes)
    assert text == "split-vnodes{vnodes=8,vnode-batch=4},insert-allreduce{fusion-mb=2.0},microbatch-inference"
    assert parse_pipeline(text) == passes and spec_of(parse_pipeline(text)) == text


@pytest.mark.parametrize("text", [
    " split-vnodes { vnodes = 8 , vnode_batch=4 } , insert-allreduce{fusion-mb=1e-05},microbatch-inference{} ",
    "split-vnodes{vnodes=2,stepwise=false,signature=train}",
    "microbatch-inference{vnode-batch=16}",
])
def test_spaces_underscores_and_every_option_type_round_trip(text):
    passes = parse_pipeline(text)
    assert parse_pipeline(spec_of(passes)) == passes


def test_a_repeated_option_is_refused():
    with pytest.raises(PipelineError) as e:
        parse_pipeline("split-vnodes{vnodes=8,vnodes=2}")
    assert str(e.value) == "pass 'split-vnodes': option 'vnodes' given twice (8 and 2); give it once"
    with pytest.raises(PipelineError, match=re.escape("option 'vnode_batch' given twice (4 and 2)")):
        parse_pipeline("split-vnodes{vnode-batch=4,vnode_batch=2}")  # the same option, spelt two ways


@pytest.mark.parametrize("text, column, problem", [
    ("split-vnodes{vnodes=8", 13, "the '{' of pass 'split-vnodes' is not closed; end its options with '}'"),
    ("microbatch-inference,split-vnodes{vnodes=8", 34, "the '{' of pass 'split-vnodes' is not closed"),
    ("split-vnodes{vnodes=8,microbatch-inference{vnode-batch=2}", 13,
     "the '{' of pass 'split-vnodes' is not closed before the '{' at column 43"),
    ("split-vnodes}", 13, "'}' without a '{' before it; remove it, or open the options of pass 'split-vnodes'"),
    ("split-vnodes{vnodes=8}}", 23, "'}' without a '{' before it; remove it"),
    ("}split-vnodes", 1, "expected a pass name, found '}'"),
    ("split-vnodes,,microbatch-inference", 14,
     "expected a pass name after the ',' at column 13, found ','; separate passes with one ','"),
    ("split-vnodes,", 14, "expected a pass name after the ',' at column 13, found the end of the pipeline; "
                          "remove the trailing ','"),
    (",split-vnodes", 1, "expected a pass name, found ','"),
    ("split-vnodes{vnodes=8,,vnode-batch=4}", 23,
     "expected an option (key=value) of pass 'split-vnodes' after the ',' at column 22, found ','; "
     "separate options with one ','"),
    ("split-vnodes{vnodes=8,}", 23, "expected an option (key=value) of pass 'split-vnodes' after the ',' at "
                                    "column 22, found '}'; remove the trailing ','"),
    ("split-vnodes{,vnodes=8}", 14, "expected an option (key=value) of pass 'split-vnodes', found ','"),
    ("split-vnodes{vnodes}", 20, "pass 'split-vnodes': option 'vnodes' needs a value (key=value), found '}'"),
    ("split-vnodes{vnodes=}", 21, "pass 'split-vnodes': option 'vnodes' needs a value after '=', found '}'"),
    ("split-vnodes{vnodes 8}", 21, "pass 'split-vnodes': expected '=' after option 'vnodes', found '8'"),
    ("split-vnodes;microbatch-inference", 13, "expected ',' or '{' after pass 'split-vnodes', found ';'"),
    ("split-vnodes{vnodes=8}microbatch-inference", 23,
     "expected ',' after the options of pass 'split-vnodes', found 'm'"),
    ("split-vnodes{vnodes=8}{vnode-batch=2}", 23, "expected ',' after the options of pass 'split-vnodes', found '{'"),
    ("@split-vnodes", 1, "expected a pass name, found '@'"),
])
def test_a_malformed_spec_names_the_column_and_what_was_expected(text, column, problem):
    with pytest.raises(PipelineError) as e:
        parse_pipeline(text)
    assert str(e.value).startswith(f"pipeline {text!r}, column {column}: {problem}"), str(e.value)


@pytest.mark.parametrize("text, message", [
    ("nonsense", "unknown pass 'nonsense'; known passes: insert-allreduce, microbatch-inference, partition-stages, split-vnodes"),
    ("split-vnodes{vnodez=2}", "pass 'split-vnodes' has no option 'vnodez'; options: vnodes, vnode-batch, "
                               "signature, stepwise"),
    ("split-vnodes{vnodes=eight}", "pass 'split-vnodes': option vnodes='eight' is not a valid int; give a whole "
                                   "number, e.g. vnodes=1"),
    ("split-vnodes{stepwise=maybe}", "option stepwise='maybe' is not a valid bool; give true or false"),
    ("insert-allreduce{fusion-mb=big}", "option fusion-mb='big' is not a valid float; give a number"),
    ("  ", "empty pipeline; give at least one pass"),
])
def test_unknown_names_and_bad_values_are_named(text, message):
    with pytest.raises(PipelineError, match=re.escape(message)):
        parse_pipeline(text)


def test_every_pass_round_trips_through_its_spec():
    """parse(spec(p)) == p for generated option values of every registered pass."""
    from hypothesis import HealthCheck, given, settings
    from hypothesis import strategies as st

    from vfgraph.passes.base import option_types, registered

    values = {bool: st.booleans(), int: st.integers(1, 10 ** 6),
              float: st.floats(1e-6, 1e6, allow_nan=False, allow_infinity=False),
              str: st.from_regex(r"[A-Za-z_][A-Za-z0-9_.=:/-]{0,12}", fullmatch=True)}
    classes = list(registered().values())
    # a memory budget excludes vnodes and vnode-batch, and its margin is given only with one
    from vfgraph.analysis.memory import DEFAULT_MARGIN

    special = {"memory_budget": st.just(""), "memory_margin": st.just(DEFAULT_MARGIN)}
    passes = st.one_of(*[st.builds(c, **{k: special.get(k, values[t]) for k, t in option_types(c).items()})
                         for c in classes])

    @settings(max_examples=300, derandomize=True, database=None, suppress_health_check=list(HealthCheck))
    @given(st.lists(passes, min_size=1, max_size=4))
    def check(ps):
        assert parse_pipeline(spec_of(ps)) == ps

    check()


def test_a_spec_that_cannot_be_read_back_is_refused():
    from vfgraph.rewrites.split_vnodes import SplitVnodesPass

    with pytest.raises(PipelineError, match="cannot be written in a pipeline"):
        SplitVnodesPass(signature="a,b").spec()
