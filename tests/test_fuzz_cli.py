"""Random bad paths and options through the command line: every mistake is one line and exit
code 2, and nothing a user owns is ever changed.

The commands run in-process (``vfgraph.cli.main``, one TensorFlow import for all cases) on a
tree of their own, copied from a template before the first case and again after any case that
changed it: the inputs (a SavedModel, a rewrite of it, a symbolic link to it, a regular file, an
empty directory, good and bad .npz files), a user's unrelated files (a directory with files, an
empty directory, files where a training run would put its checkpoint and its serving export),
an earlier vfgraph output, an unfinished training run's checkpoint and an empty directory for
fresh outputs. For every case:

- the exit code is 0 or 2, or 1 for diff and verify (the models differ); 3, an internal error,
  or an exception out of ``main`` is never acceptable for a mistake in the command line;
- an output (-o) that is an input, contains one or lies inside one (paths resolved, symbolic
  links followed) is refused;
- after a non-zero exit the whole tree is byte-identical (every file's relative path and bytes,
  every symbolic link's target, the set of directories): the inputs are unchanged, an output
  that existed before is unchanged, nothing was written in part, no ``.vfgraph-*`` temporary
  entry is left;
- after exit 0 only the command's own outputs changed (rewrite: OUTPUT; export: OUTPUT, or
  OUTPUT/VERSION in an existing directory; train: OUTPUT, OUTPUT.ckpt and OUTPUT.serving),
  nothing that existed under the inputs' or the user's directories changed, and no temporary
  entry is left;
- on exit 2 stderr holds exactly one line starting with "vfgraph", that line starts with
  "vfgraph <command>", and there is no traceback.

In argv, "@rel" stands for the path ``rel`` in the case's tree.
"""
import contextlib
import hashlib
import io
import json
import os
import posixpath
import shutil
import subprocess
import sys

import numpy as np
import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from vfgraph import cli

COMPARING = ("diff", "verify")  # exit 1: the models differ
USER_OWNED = ("in", "user")  # what exists under these is never changed, whatever the command


# ----- the tree


def snapshot(root):
    """{relative path: what it is}: ("dir",), ("file", sha256 of the bytes) or ("link", target)."""
    entries = {}
    for top, dirs, files in os.walk(root):
        for name in dirs + files:
            path = os.path.join(top, name)
            rel = os.path.relpath(path, root).replace(os.sep, "/")
            if os.path.islink(path):
                entries[rel] = ("link", os.readlink(path))
            elif os.path.isdir(path):
                entries[rel] = ("dir",)
            else:
                with open(path, "rb") as f:
                    entries[rel] = ("file", hashlib.sha256(f.read()).hexdigest())
    return entries


def build_template(path, model, data):
    """The tree every case starts from (see the module docstring)."""
    import vfgraph

    inp = os.path.join(path, "in")
    os.makedirs(inp)
    shutil.copytree(model, os.path.join(inp, "model"))
    vfgraph.save(vfgraph.rewrite(os.path.join(inp, "model"), vnodes=2, vnode_batch=16),
                 os.path.join(inp, "rewritten"))
    os.symlink("model", os.path.join(inp, "link"))
    with open(os.path.join(inp, "file.txt"), "w") as f:
        f.write("a regular file\n")
    os.mkdir(os.path.join(inp, "empty"))
    shutil.copyfile(data, os.path.join(inp, "train.npz"))
    with np.load(data) as z:  # one feature too many per example
        np.savez(os.path.join(inp, "wide.npz"), x=np.zeros((64, 65), np.float32), y=z["y"][:64])
    with open(os.path.join(inp, "text.npz"), "w") as f:
        f.write("x,y\n0,1\n")
    docs = os.path.join(path, "user", "docs")
    os.makedirs(os.path.join(docs, "sub"))
    for rel, text in (("a.txt", "a user's file\n"), (os.path.join("sub", "b.txt"), "another\n")):
        with open(os.path.join(docs, rel), "w") as f:
            f.write(text)
    os.mkdir(os.path.join(path, "user", "empty"))
    for name in ("notes.txt", "report.ckpt", "log.serving"):  # the last two where 'train -o user/report'
        with open(os.path.join(path, "user", name), "w") as f:  # ('user/log') puts its checkpoint (serving
            f.write(f"{name}\n")  # export): a fresh output for rewrite and export, refused for train
    shutil.copytree(os.path.join(inp, "rewritten"), os.path.join(path, "earlier"))  # vfgraph wrote it
    os.mkdir(os.path.join(path, "stale.ckpt"))  # an unfinished run of 'train ... -o stale'
    with open(os.path.join(path, "stale.ckpt", "progress.json"), "w") as f:
        json.dump({"step": 1, "checkpoint": "step-1", "losses": [2.3], "config": {"batch_size": 1}}, f)
    os.mkdir(os.path.join(path, "out"))


class Tree:
    """A working copy of the template, put back whenever a case changed it."""

    def __init__(self, template, root):
        self.template, self.root = template, root
        self.restore()
        self.baseline = snapshot(root)
        assert self.baseline == snapshot(template)

    def restore(self):
        if os.path.lexists(self.root):
            shutil.rmtree(self.root)
        shutil.copytree(self.template, self.root, symlinks=True)

    def path(self, arg):
        return os.path.join(self.root, arg[1:].lstrip("/")) if arg.startswith("@") else arg

    def rel(self, arg):
        return posixpath.normpath(os.path.relpath(os.path.abspath(self.path(arg)), self.root).replace(os.sep, "/"))


@pytest.fixture(scope="module")
def template(models, digits, tmp_path_factory):
    path = os.path.realpath(tmp_path_factory.mktemp("fuzzcli") / "template")
    build_template(path, models("mlp:sgd"), digits["train"])
    return path


@pytest.fixture(scope="module")
def tree(template):
    return Tree(template, os.path.join(os.path.dirname(template), "tree"))


# ----- one case


def _under(rel, root):
    root = posixpath.normpath(root)
    return root == "." or rel == root or rel.startswith(root + "/")


def _value(argv, flag, default=None):
    return argv[argv.index(flag) + 1] if flag in argv else default


def allowed_outputs(tree, argv):
    """The paths (relative to the tree, symbolic links followed) a successful ``argv`` may write."""
    command = argv[0]
    out = _value(argv, "-o")
    if command == "rewrite" and out is None:
        out = "@" + posixpath.normpath(tree.rel(argv[1])) + f"_vnodes{_value(argv, '--vnodes', '1')}"
    if out is None or command not in ("rewrite", "export", "train"):
        return []
    if command == "export" and os.path.isdir(tree.path(out)):  # the version, beside the others
        out = posixpath.join(out, _value(argv, "--version", "1"))
    suffixes = ("", ".ckpt", ".serving") if command == "train" else ("",)
    return [tree.rel(os.path.realpath(tree.path(out)) + s) for s in suffixes]


def run_main(argv):
    """``vfgraph.cli.main(argv)`` with stdout and stderr captured: (exit code, stderr, an
    exception that escaped main or None); argparse's SystemExit is its exit code."""
    err = io.StringIO()
    escaped = None
    with contextlib.redirect_stderr(err), contextlib.redirect_stdout(io.StringIO()):
        try:
            code = cli.main(list(argv))
        except SystemExit as e:
            code = e.code if isinstance(e.code, int) else 2
        except Exception as e:  # noqa: BLE001 - reported as a violation of the rule
            code, escaped = None, e
    return code, err.getvalue(), escaped


def overlap(argv, cwd):
    """How the output of ``argv`` (run in ``cwd``) overlaps one of its inputs, resolved: "is",
    "contains" or "lies inside" the input; None when it does not, or there is no output."""
    out = _value(argv, "-o")
    if argv[0] not in ("rewrite", "export", "train") or out is None:
        return None
    real = lambda p: os.path.realpath(os.path.join(cwd, p))  # noqa: E731
    inputs = [argv[1]] + ([_value(argv, "--data")] if argv[0] == "train" and "--data" in argv else [])
    o = real(out)
    for inp in inputs:
        if not os.path.lexists(os.path.join(cwd, inp)):
            continue
        i = real(inp)
        if o == i:
            return f"is the input {inp}"
        if i.startswith(o.rstrip("/") + "/"):
            return f"contains the input {inp}"
        if o.startswith(i + "/"):
            return f"lies inside the input {inp}"
    return None


def problems(argv, code, stderr, before, after, allowed, cwd):
    """What in one case breaks the command line's rule (see the module docstring); [] if nothing.
    ``argv``'s paths are relative to ``cwd``."""
    command = argv[0]
    found = []
    if code not in ((0, 1, 2) if command in COMPARING else (0, 2)):
        found.append(f"exit code {code}")
    how = overlap(argv, cwd)
    if code == 0 and how:
        found.append(f"exit 0 for an output that {how}")
    changed = sorted(k for k in before.keys() | after.keys() if before.get(k) != after.get(k))
    temps = [k for k in after if any(part.startswith(".vfgraph-") for part in k.split("/"))]
    if temps:
        found.append(f"temporary entries left: {temps}")
    if code != 0 and changed:
        found.append(f"exit {code} changed the tree: {changed[:6]}{' ...' if len(changed) > 6 else ''}")
    if code == 0:
        stray = [k for k in changed if not any(_under(k, a) for a in allowed)
                 or k in before and any(_under(k, u) for u in USER_OWNED)]
        if stray:
            found.append(f"changed outside its output {allowed}: {stray[:6]}")
    if code == 2:
        lines = [line for line in stderr.splitlines() if line.startswith("vfgraph")]
        if len(lines) != 1 or not lines[0].startswith(f"vfgraph {command}"):
            found.append(f"exit 2 without one 'vfgraph {command}' line: {stderr[-600:]!r}")
    if "Traceback" in stderr:
        found.append(f"traceback on stderr: {stderr[-600:]!r}")
    return found


def check(tree, argv):
    """Run ``argv`` (paths written "@rel") in-process on ``tree``; returns (exit code, the
    problems found). The tree is put back afterwards if the case changed it."""
    real = [tree.path(a) for a in argv]
    allowed = allowed_outputs(tree, argv)
    try:
        code, stderr, escaped = run_main(real)
        after = snapshot(tree.root)
        relative = [a[1:] if a.startswith("@") else a for a in argv]
        found = problems(relative, code, stderr, tree.baseline, after, allowed, tree.root)
        if escaped is not None:
            found.insert(0, f"main raised {type(escaped).__name__}: {escaped}")
    finally:
        if snapshot(tree.root) != tree.baseline:
            tree.restore()
    return code, found


def show(argv):
    """``argv`` as a command line to paste, the tree's root written ROOT."""
    return "vfgraph " + " ".join("ROOT/" + a[1:] if a.startswith("@") else repr(a) if "{" in a else a
                                 for a in argv)


# ----- the space


@st.composite
def pick(draw, ok, mistakes):
    """A value that is likely right three times in four, else a mistake (shrinking goes to ok[0])."""
    return draw(st.sampled_from(mistakes if draw(st.integers(0, 3)) == 3 else ok))


MODELS_OK = ("@in/model", "@in/rewritten", "@in/link")
MODELS_BAD = ("@in/missing", "@in/file.txt", "@in/empty")
OUTPUTS_OK = ("@out/new", "@earlier", "@user/empty", "@stale", "@user/report", "@user/log")


def outputs_bad(model):
    """Where no command may write when reading ``model``: the model itself (also spelt with a
    trailing slash and through '..'), its parent, paths inside it, a symbolic link to the model,
    a path under a regular file, one whose parent is missing, a user's directory with files, the
    data file, the tree's root."""
    return (model, model + "/", posixpath.dirname(model), model + "/out", model + "/variables/x",
            "@out/../" + model[1:], "@in/link", "@in/file.txt/out", "@nope/deeper/out", "@user/docs",
            "@in/train.npz", "@")


def _opt(argv, flag, value):
    if value is not None:
        argv += [flag, str(value)]


@st.composite
def command_lines(draw, command):
    """An argv of ``command`` with a few mistakes among its paths and options."""
    model = draw(pick(MODELS_OK, MODELS_BAD))
    argv = [command, model]
    if command in COMPARING:
        argv.append(draw(pick(MODELS_OK[::-1], MODELS_BAD)))
    if command in ("rewrite", "export", "train"):
        ok = OUTPUTS_OK + ((None,) if command == "rewrite" else ())
        _opt(argv, "-o", draw(pick(ok, outputs_bad(model) + (() if command == "rewrite" else (None,)))))
    if command == "rewrite":
        _opt(argv, "--vnodes", draw(pick((None, 2, 1, 3), (-1, 0))))
        _opt(argv, "--vnode-batch", draw(pick((None, 16, 0, 7), (-2,))))
        _opt(argv, "--pipeline", draw(pick((None, "split-vnodes{vnodes=2}"),
                                           ("split-vnodes{vnodes=2,vnodes=3}", "split-vnodes{vnodes=2", "nope"))))
    elif command == "export":
        _opt(argv, "--version", draw(pick((None, 1, 0), (-1,))))
        _opt(argv, "--vnode-batch", draw(pick((None, 0, 16, 7), (-2,))))
    elif command == "train":
        _opt(argv, "--data", draw(pick(("@in/train.npz",), (None, "@in/missing.npz", "@in/wide.npz", "@in/text.npz"))))
        _opt(argv, "--steps", draw(pick((1, 2), (None, -5, 0))))
        _opt(argv, "--batch-size", draw(pick((16, 32, 20), (None, 0, 100000))))
        _opt(argv, "--checkpoint-every", draw(pick((None, 1, 0), (-1,))))
        argv += draw(pick(([], ["--resume"]), (["--resume", "--force"],)))
        argv += ["--no-progress"] if draw(st.booleans()) else []
    elif command == "inspect":
        argv += ["--json"] if draw(st.booleans()) else []
    elif command == "diff":
        argv += ["--graphs-only"] if draw(st.booleans()) else []
    else:
        _opt(argv, "--steps", draw(pick((1,), (0,))))
        _opt(argv, "--batch-size", draw(pick((None, 32, 20), (0,))))
    if command in ("rewrite", "export", "train") and "--force" not in argv and draw(st.booleans()):
        argv.append("--force")
    return argv


# ----- the tests


VALID = {
    "rewrite": ["rewrite", "@in/model", "--vnodes", "2"],
    "export": ["export", "@in/model"],
    "train": ["train", "@in/model", "--data", "@in/train.npz", "--steps", "1", "--batch-size", "16", "--no-progress"],
}


@pytest.mark.parametrize("command", VALID)
def test_every_output_choice_keeps_the_rule(tree, command):
    """Each output choice of the space, with and without --force, for an otherwise valid command
    line: every refusal and every success keeps the invariants (all cases run; the failures are
    listed together)."""
    failures = []
    for model, out in [(m, o) for m in ("@in/model", "@in/link") for o in OUTPUTS_OK + outputs_bad(m)]:
        for force in ([], ["--force"]):
            argv = [command, model] + VALID[command][2:] + ["-o", out] + force
            code, found = check(tree, argv)
            if found:
                failures.append(f"{show(argv)} (exit {code}):\n  " + "\n  ".join(found))
    assert not failures, "\n".join(failures)


EXAMPLES = {"rewrite": 60, "export": 50, "train": 50, "inspect": 12, "diff": 25, "verify": 15}


@pytest.mark.parametrize("command", EXAMPLES)
def test_random_command_lines_keep_the_rule(tree, command):
    """Random paths and options of ``command`` (a mistake or more in most) keep every invariant
    of the module docstring. The examples are the same on every run (derandomized, no example
    database); a failure is shrunk to the fewest mistakes that still break the rule."""

    @settings(max_examples=EXAMPLES[command], deadline=None, derandomize=True, database=None,
              suppress_health_check=list(HealthCheck))
    @given(argv=command_lines(command))
    def case(argv):
        code, found = check(tree, argv)
        assert not found, f"{show(argv)} (exit {code}):\n  " + "\n  ".join(found)

    case()


SUCCEEDS = [
    (["rewrite", "@in/model", "--vnodes", "2", "-o", "@out/new"], 0),
    (["rewrite", "@in/link", "--vnodes", "2", "--vnode-batch", "16"], 0),  # beside the link: in/link_vnodes2
    (["rewrite", "@in/model", "-o", "@earlier", "--force"], 0),
    (["rewrite", "@in/model", "--pipeline", "split-vnodes{vnodes=2}", "-o", "@user/empty", "--force"], 0),
    (["export", "@in/rewritten", "-o", "@out/new"], 0),
    (["export", "@in/model", "-o", "@user/empty", "--version", "0", "--vnode-batch", "7"], 0),
    (["train", "@in/model", "--data", "@in/train.npz", "--steps", "2", "--batch-size", "20", "-o", "@out/new",
      "--checkpoint-every", "1", "--no-progress"], 0),
    (["train", "@in/rewritten", "--data", "@in/train.npz", "--steps", "1", "--batch-size", "32", "-o", "@earlier",
      "--force"], 0),
    (["train", "@in/link", "--data", "@in/train.npz", "--steps", "1", "--batch-size", "16", "-o", "@stale",
      "--force", "--no-progress"], 0),
    (["train", "@in/model", "--data", "@in/train.npz", "--steps", "1", "--batch-size", "16", "-o", "@out/new",
      "--resume", "--no-progress"], 0),
    (["inspect", "@in/link", "--json"], 0),
    (["diff", "@in/model", "@in/link"], 0),
    (["diff", "@in/model", "@in/rewritten"], 1),
    (["verify", "@in/model", "@in/rewritten", "--steps", "1", "--batch-size", "32"], 0),
]


@pytest.mark.parametrize("argv,expected", SUCCEEDS, ids=[" ".join(a[:2]) + f" #{i}" for i, (a, _) in
                                                         enumerate(SUCCEEDS)])
def test_commands_that_succeed_write_only_their_output(tree, argv, expected):
    """The fuzz space's right answers: each command succeeds (diff of different models: 1),
    writing only its own output, the inputs and the user's files untouched, no temporary entry
    left; so the random cases' refusals are refusals of mistakes, not of everything."""
    code, found = check(tree, argv)
    assert code == expected and not found, f"{show(argv)} (exit {code}):\n  " + "\n  ".join(found)


SUBPROCESS_CASES = [
    ["rewrite", "in/model", "-o", "in/model/variables/x", "--force"],  # inside the input
    ["train", "in/link", "--data", "in/wide.npz", "--steps", "1", "--batch-size", "16", "-o", "earlier",
     "--force"],  # data refused after the model is loaded; the earlier output stays
    ["export", "in/link", "-o", "in/link/variables/x", "--version", "0"],  # inside the input, through the link
]


def test_mistakes_across_the_process_boundary(template, tmp_path):
    """The same invariants for ``python -m vfgraph.cli`` run as a user runs it (relative paths
    from the tree as working directory), each case on its own copy of the tree: exit code 2,
    one 'vfgraph <command>' line and no traceback on stderr, the tree byte-identical."""
    env = dict(os.environ, TF_CPP_MIN_LOG_LEVEL="3", TF_ENABLE_ONEDNN_OPTS="0")
    trees = [Tree(template, str(tmp_path / f"tree{i}")) for i in range(len(SUBPROCESS_CASES))]
    procs = [subprocess.Popen([sys.executable, "-m", "vfgraph.cli", *argv], cwd=t.root, env=env, text=True,
                              stdout=subprocess.PIPE, stderr=subprocess.PIPE)
             for t, argv in zip(trees, SUBPROCESS_CASES)]
    failures = []
    for t, argv, p in zip(trees, SUBPROCESS_CASES, procs):
        _, stderr = p.communicate(timeout=300)
        found = problems(argv, p.returncode, stderr, t.baseline, snapshot(t.root), [], t.root)
        if p.returncode != 2:
            found.insert(0, f"exit code {p.returncode}, expected 2")
        if found:
            failures.append(f"vfgraph {' '.join(argv)} (cwd ROOT, exit {p.returncode}):\n  " + "\n  ".join(found))
    assert not failures, "\n".join(failures)
