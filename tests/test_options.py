"""Each pass option is declared once, by its pass: the command line's flags (their spelling, type,
choices, help and check) are made from the declarations, so a pass's new option is a flag of
``vfgraph rewrite`` and a line of ``vfgraph passes`` without a change to the command line."""
import json
import os
from dataclasses import dataclass
from typing import ClassVar

import pytest

from vfgraph import cli
from vfgraph.passes import base
from vfgraph.passes.base import Pass, PassResult, flags, option, register, registered
from vfgraph.testing.cli import error_line, run_in_process

MODEL = os.path.join(os.path.dirname(os.path.abspath(__file__)), "goldens", "split-vnodes",
                     "linear_manual.before.pbtxt")
TOY_HELP = "the most slices a toy keeps (a test's option, declared only here)"


@pytest.fixture
def toy_pass():
    """A pass registered for one test only, with options the command line has never seen."""

    @register
    @dataclass(frozen=True)
    class ToyLimitPass(Pass):
        """Keep the model as it is (a test's pass with its own options)."""

        name: ClassVar[str] = "toy-limit"
        edits: ClassVar[bool] = False
        toy_limit: int = option(3, TOY_HELP, low=1, flag=True, metavar="L")
        toy_mode: str = option("keep", "what the toy does with the model", flag="--toy-way", choices=("keep", "look"))
        toy_quiet: bool = option(False, "say nothing about the toy", flag=True)

        def call(self, item):
            return PassResult(item, False, [f"toy-limit {self.toy_limit} {self.toy_mode}"])

    yield ToyLimitPass
    base.unregister("toy-limit")


def _words(text: str) -> str:
    return " ".join(text.split())


def _help_text(capsys, *command) -> str:
    """``vfgraph COMMAND --help``'s text, its words joined by single spaces."""
    capsys.readouterr()
    with pytest.raises(SystemExit) as done:
        cli.main([*command, "--help"])
    assert done.value.code == 0
    return _words(capsys.readouterr().out)


def test_every_flag_of_a_pass_option_is_made_from_its_declaration():
    """The flags of ``vfgraph rewrite`` that set pass options are those the passes declare, with
    the declaration's help, type and choices; the command line declares none of them itself."""
    made = {f.flag: f for f in flags()}
    assert {"--vnodes", "--vnode-batch", "--fusion-mb", "--stages", "--devices", "--split-at", "--schedule",
            "--balance", "--profile-batch", "--profile", "--deterministic", "--train-signature"} <= set(made)
    actions = {s: a for a in cli._parser("rewrite")._subparsers._group_actions[0].choices["rewrite"]._actions
               for s in a.option_strings}
    for flag, f in made.items():
        assert actions[flag].help == f.help.replace("%", "%%"), flag
        assert actions[flag].choices == f.choices and actions[flag].metavar == f.metavar, flag
        assert actions[flag].type in (f.type, None), flag
    # without the passes' flags, the command line has no flag of its own for any of them
    bare = cli._parser()._subparsers._group_actions[0].choices["rewrite"]
    assert not set(made) & {s for a in bare._actions for s in a.option_strings}


def test_a_flag_several_passes_declare_sets_each_with_each_ones_help():
    vnode_batch = next(f for f in flags() if f.flag == "--vnode-batch")
    assert vnode_batch.sets == (("microbatch-inference", "vnode_batch"), ("split-vnodes", "vnode_batch"))
    for pass_name, field in vnode_batch.sets:
        declared = next(o for o in base.describe(registered()[pass_name])["options"] if o["name"] == "vnode-batch")
        assert f"{pass_name}: {declared['help']}" in vnode_batch.help
    assert vnode_batch.problem(-1).pass_name == "microbatch-inference" and vnode_batch.problem(4) is None
    # one help where the passes declare the same text
    signature = next(f for f in flags() if f.flag == "--train-signature")
    assert signature.sets == (("partition-stages", "signature"), ("split-vnodes", "signature"))
    assert signature.help == "the training signature (default: 'train', or the one found to update variables)"


def test_rewrite_help_and_passes_show_the_same_help(capsys):
    text = _help_text(capsys, "rewrite")
    capsys.readouterr()
    assert cli.main(["passes", "--json"]) == 0
    listed = {d["name"]: d for d in json.loads(capsys.readouterr().out)}
    for d in listed.values():
        for o in d["options"]:
            if o["flag"] and o["flag"] != "--vnode-batch":  # (a shared flag names each pass: above)
                assert f"{o['flag']}" in text and _words(o["help"]) in text, o
    assert listed["split-vnodes"]["options"][0]["flag"] == "--vnodes"
    assert listed["split-vnodes"]["options"][2]["flag"] == "--train-signature"
    assert listed["insert-allreduce"]["options"][1]["flag"] is None  # (its signature is not one of the flag's)


def test_inspect_takes_the_stage_planning_flags_of_partition_stages(capsys):
    text = _help_text(capsys, "inspect")
    for flag in ("--stages K", "--split-at OP,...", "--balance {estimate,profile}", "--profile-batch N",
                 "--profile FILE"):
        assert flag in text, flag
    assert "--devices" not in text and "--vnodes" not in text and "--schedule" not in text


def test_train_has_no_flag_for_what_a_rewrite_recorded(capsys):
    """V, b, the all-reduce and the stages of a rewritten model are in its records, which train
    reads: none of the passes' flags is one of train's, even when the parser is asked for them."""
    text = _help_text(capsys, "train")
    assert "virtual-node batch b" in text
    made = {f.flag for f in flags()} - {"--train-signature"}  # (which signature to run: theirs to name)
    for command in ("train", "verify"):
        parser = cli._parser(command)._subparsers._group_actions[0].choices[command]
        assert not made & {s for a in parser._actions for s in a.option_strings}, command
    assert not made & set(text.split())


def test_a_new_pass_option_is_a_flag_with_its_help_and_check(toy_pass, tmp_path, capsys):
    """A pass registered here, with options declared only in it, is a flag of ``vfgraph rewrite``
    (its help in --help and in ``vfgraph passes``) checked by its declaration; cli.py is not
    changed for it."""
    text = _help_text(capsys, "rewrite")
    assert f"--toy-limit L {TOY_HELP}" in text
    assert "--toy-way {keep,look} what the toy does with the model" in text
    assert "--toy-quiet say nothing about the toy" in text
    capsys.readouterr()
    assert cli.main(["passes"]) == 0
    listed = _words(capsys.readouterr().out)
    assert f"toy-limit=3 (int, --toy-limit) {TOY_HELP}" in listed
    assert "toy-mode=keep (str, --toy-way) what the toy does" in listed

    out = tmp_path / "out.pbtxt"
    for argv, want in [
        (["--toy-limit", 0], "vfgraph rewrite: error: --toy-limit 0: out of range; give a whole number at least 1"),
        (["--toy-limit", 2 ** 31], "--toy-limit 2147483648: out of range; give a whole number at least 1 and at "
                                   "most 2147483647"),
        (["--toy-limit", "x"], "vfgraph rewrite: error: argument --toy-limit: invalid int value: 'x'"),
        (["--toy-way", "jump"], "argument --toy-way: invalid choice: 'jump' (choose from"),
        # a good value: the rewrite without --pipeline does not run the toy; said, with the pipeline to give
        (["--toy-limit", 5], "--toy-limit 5: 'vfgraph rewrite' runs pass 'toy-limit' only in a pipeline; give it "
                             "there, e.g. --pipeline 'toy-limit{toy-limit=5}'"),
    ]:
        code, err = run_in_process(capsys, "rewrite", MODEL, *argv, "-o", out)
        assert code == 2 and want in error_line(err), err
        assert not out.exists()
    # the pipeline's option is the same declaration, with the same check
    code, err = run_in_process(capsys, "rewrite", MODEL, "--pipeline", "toy-limit{toy-limit=0}", "-o", out)
    assert code == 2 and "option toy-limit=0: out of range; give a whole number at least 1" in error_line(err)
    assert not out.exists()


def test_the_toy_pass_is_gone_with_its_test(capsys):
    assert "toy-limit" not in registered()
    assert "--toy-limit" not in _help_text(capsys, "rewrite")


def test_a_bad_flag_declaration_is_refused_when_the_pass_is_registered():
    def toy(**fields):
        cls = type("BadFlagPass", (Pass,), {"__annotations__": {k: t for k, (t, _) in fields.items()},
                                            "name": "bad-flag", **{k: v for k, (_, v) in fields.items()}})
        return register(dataclass(frozen=True)(cls))

    with pytest.raises(TypeError, match="flag 'toy': give True or a kebab-case '--name'"):
        toy(x=(int, option(1, "x", flag="toy")))
    with pytest.raises(TypeError, match="a bool option with a flag is false by default"):
        toy(x=(bool, option(True, "x", flag=True)))
    with pytest.raises(TypeError, match="choices are a str option's, its default among them"):
        toy(x=(str, option("c", "x", flag=True, choices=("a", "b"))))
    assert "bad-flag" not in registered()


def test_two_passes_declaring_one_flag_with_other_types_are_refused(toy_pass):
    @register
    @dataclass(frozen=True)
    class OtherToyPass(Pass):
        """Another toy."""

        name: ClassVar[str] = "toy-other"
        toy_limit: float = option(1.0, "a float under the int's flag", flag=True)

    try:
        with pytest.raises(TypeError, match="flag --toy-limit: options toy-limit.toy_limit, toy-other.toy_limit"):
            flags()
    finally:
        base.unregister("toy-other")
