"""No lost work: outputs never touch inputs or what vfgraph did not write, training is safe to
stop and repeat, and every user mistake is one line with exit 2 (the command line's own code,
in-process where one TensorFlow import can serve many cases, as a real process where the
process matters: signals, the umask, file-size limits)."""
import contextlib
import json
import os
import shutil
import signal
import subprocess
import sys
import time

import numpy as np
import pytest

from vfgraph import cli
from vfgraph.testing.cli import ENV, one_error, run_in_process, tree_digest, vf

tree = tree_digest


def leftovers(path):
    return [os.path.join(r, n) for r, ds, fs in os.walk(path) for n in ds + fs if n.startswith(".vfgraph-")]


run = run_in_process


@pytest.fixture
def workdir(models, tmp_path):
    """A user's tree: a model (own copy) beside an unrelated file."""
    d = tmp_path / "in" / "p"
    d.mkdir(parents=True)
    shutil.copytree(models("mlp:adam"), d / "m")
    (d / "notes.txt").write_text("my notes\n")
    return d


def test_outputs_never_touch_the_input(workdir, capsys, tmp_path):
    m = workdir / "m"
    before = tree(tmp_path / "in")
    (workdir / "link").symlink_to(m)
    before = tree(tmp_path / "in")
    cases = {
        (workdir, "--force"): "contains the input",
        (m / "out",): "lies inside the input",
        (m / "variables" / "x",): "lies inside the input",
        (m,): "this is the input",
        (workdir / "link",): "this is the input",
        (workdir / "notes.txt" / "x",): "is a file, not a directory",
        (workdir / "notes.txt", "--force"): "was not written by vfgraph",
        (tmp_path / "missing" / "o",): "parent does not exist",
    }
    for (out, *flags), needle in cases.items():
        line = one_error(*run(capsys, "rewrite", m, "--vnodes", 2, "-o", out, *flags), needle)
        assert "--force" not in line or "pass --force" not in line, line
        assert tree(tmp_path / "in") == before, out
    assert not leftovers(tmp_path)
    # the same through a real process, the case that used to delete the model and its neighbours
    res = vf("rewrite", m, "--vnodes", 2, "-o", workdir, "--force")
    assert res.returncode == 2 and "contains the input" in res.stderr and "Traceback" not in res.stderr
    assert tree(tmp_path / "in") == before
    # after all that the input still rewrites
    assert run(capsys, "rewrite", m, "--vnodes", 2, "-o", tmp_path / "ok")[0] == 0


def test_force_replaces_only_what_vfgraph_wrote(workdir, capsys, tmp_path):
    m = workdir / "m"
    user = tmp_path / "user"
    user.mkdir()
    (user / "keep.txt").write_text("x")
    one_error(*run(capsys, "rewrite", m, "-o", user, "--force"), "not written by vfgraph")
    assert (user / "keep.txt").read_text() == "x"
    empty = tmp_path / "empty"
    empty.mkdir()
    line = one_error(*run(capsys, "rewrite", m, "-o", empty), "--force")
    assert run(capsys, "rewrite", m, "-o", empty, "--force")[0] == 0, line
    assert run(capsys, "rewrite", m, "--vnodes", 2, "-o", empty, "--force")[0] == 0  # its own output
    # a GraphDef file vfgraph did not emit is never replaced either
    pb = tmp_path / "frozen.pb"
    with open(m / "saved_model.pb", "rb") as f:
        pb.write_bytes(f.read())
    one_error(*run(capsys, "rewrite", m, "-o", pb, "--force"), "not written by vfgraph")
    # an export's version directory: only one vfgraph wrote
    base = tmp_path / "serve"
    (base / "1").mkdir(parents=True)
    (base / "1" / "mine").write_text("x")
    one_error(*run(capsys, "export", m, "-o", base, "--force"), "not written by vfgraph")
    assert run(capsys, "export", m, "-o", base, "--version", 2)[0] == 0
    assert run(capsys, "export", m, "-o", base, "--version", 2, "--force")[0] == 0
    assert (base / "1" / "mine").read_text() == "x" and not leftovers(tmp_path)
    # a serving base holds versions only; one of its versions may be exported beside itself
    one_error(*run(capsys, "export", m, "-o", workdir), "not a serving base directory")
    assert run(capsys, "export", base / "2", "-o", base, "--version", 3)[0] == 0
    one_error(*run(capsys, "export", base / "2", "-o", base, "--version", 2, "--force"), "this is the input")


def test_outputs_are_readable_as_the_umask_says(workdir, capsys, tmp_path):
    """Temporary directories are private; what is published has the umask's modes (copied files
    too), so a serving account can read it, or not, as the user chose."""
    m = workdir / "m"
    for mask in (0o022, 0o027):
        old = os.umask(mask)
        try:
            out, serve = tmp_path / f"o{mask:o}", tmp_path / f"s{mask:o}"
            assert run(capsys, "rewrite", m, "--vnodes", 2, "--vnode-batch", 16, "-o", out)[0] == 0
            assert run(capsys, "export", out, "-o", serve)[0] == 0
        finally:
            os.umask(old)
        for top in (out, serve):
            for root, _, files in os.walk(top):
                assert os.stat(root).st_mode & 0o777 == 0o777 & ~mask, root
                for f in files:
                    assert os.stat(os.path.join(root, f)).st_mode & 0o777 == 0o666 & ~mask, f


@contextlib.contextmanager
def mount(path, *options):
    """A real mount for the test (root only: skipped elsewhere)."""
    os.makedirs(path, exist_ok=True)
    if os.geteuid() != 0 or subprocess.run(["mount", *options, str(path)], capture_output=True).returncode:
        pytest.skip("needs root and mount(8) to make a read-only or full file system")
    try:
        yield path
    finally:
        subprocess.run(["umount", "-l", str(path)], capture_output=True)


def test_read_only_output_parent_is_refused_before_the_work(workdir, capsys, tmp_path):
    ro = tmp_path / "ro"
    with mount(ro, "-t", "tmpfs", "-o", "size=1m,ro", "tmpfs"):
        start = time.monotonic()
        one_error(*run(capsys, "rewrite", workdir / "m", "-o", ro / "o"), "cannot write here")
        assert time.monotonic() - start < 2, "the check came after the work"
        one_error(*run(capsys, "export", workdir / "m", "-o", ro / "s"), "cannot write here")


def test_a_full_disk_is_one_line_and_leaves_nothing(workdir, capsys, rewritten, tmp_path):
    m = workdir / "m"
    small = tmp_path / "small"
    with mount(small, "-t", "tmpfs", "-o", "size=64k", "tmpfs"):  # less than the model
        one_error(*run(capsys, "rewrite", m, "-o", small / "o"), "free, the output needs at least")
        assert os.listdir(small) == []
    need = sum(os.path.getsize(os.path.join(r, f)) for r, _, fs in os.walk(m) for f in fs)
    got = sum(os.path.getsize(os.path.join(r, f)) for r, _, fs in os.walk(rewritten("mlp:adam", 2, 16))
              for f in fs)
    assert got > need + (32 << 10)
    size = ((need + got) // 2 + 4095) // 4096 * 4096  # room for the input's size, not for the output
    with mount(small, "-t", "tmpfs", "-o", f"size={size}", "tmpfs"):
        one_error(*run(capsys, "rewrite", m, "--vnodes", 2, "--vnode-batch", 16, "-o", small / "o"),
                  "writing failed", "nothing was written")
        assert os.listdir(small) == []
    assert not leftovers(tmp_path)


def test_a_full_disk_at_the_end_of_training_keeps_the_checkpoint(rewritten, digits, capsys, tmp_path):
    model = rewritten("mlp:sgd", 2, 16)
    need = sum(os.path.getsize(os.path.join(r, f)) for r, _, fs in os.walk(model) for f in fs)
    small = tmp_path / "small"
    with mount(small, "-t", "tmpfs", "-o", f"size={(need // 4096 + 4) * 4096}", "tmpfs"):
        cmd = ["train", model, "--data", digits["train"], "--steps", 4, "--batch-size", 32, "-o", small / "t",
               "--checkpoint-every", 2, "--no-progress"]
        one_error(*run(capsys, *cmd), "writing failed")
        assert sorted(os.listdir(small)) == ["t.ckpt"] and not leftovers(small)
        with open(small / "t.ckpt" / "progress.json") as f:
            assert json.load(f)["step"] == 2  # --resume continues from it once there is room


def nan_at_step(digits, tmp_path, step, batch):
    """The training data with NaN in exactly the examples of ``step``'s batch."""
    from vfgraph.runtime.train import batches_for, load_npz

    data = load_npz(digits["train"])
    n = len(data["x"])
    rows = np.arange(n)
    idx = batches_for({"i": rows}, ["i"], batch, step)["i"]
    for earlier in range(step):
        assert not set(idx) & set(batches_for({"i": rows}, ["i"], batch, earlier)["i"])
    data["x"] = data["x"].astype(np.float32)
    data["x"][idx] = np.nan
    path = tmp_path / "nan.npz"
    np.savez(path, **data)
    return path


def test_nonfinite_loss_stops_and_keeps_the_last_good_checkpoint(rewritten, digits, capsys, tmp_path):
    model = rewritten("mlp:sgd", 2, 16)
    data = nan_at_step(digits, tmp_path, 5, 32)
    out = tmp_path / "t"
    common = ["train", model, "--data", data, "--steps", 8, "--batch-size", 32, "-o", out, "--no-progress"]
    line = one_error(*run(capsys, *common, "--checkpoint-every", 2), "step 5", "not finite",
                     "checkpoint (step 4) is kept", "'x' has")
    assert not out.exists() and not (tmp_path / "t.serving").exists(), line
    with open(tmp_path / "t.ckpt" / "progress.json") as f:
        assert json.load(f)["step"] == 4
    # the unfinished run's checkpoint is not thrown away by running again
    kept = tree(tmp_path / "t.ckpt")
    one_error(*run(capsys, *common), "unfinished run (step 4)", "--resume")
    assert tree(tmp_path / "t.ckpt") == kept
    # --resume with changed data or options names what changed
    one_error(*run(capsys, *common, "--resume", "--data", digits["train"]), "data fingerprint")
    one_error(*run(capsys, *common[:7], 64, *common[8:], "--resume"), "--batch-size 32 -> 64")
    assert tree(tmp_path / "t.ckpt") == kept
    code, err = run(capsys, *common, "--allow-nonfinite", "--force")
    assert code == 0 and out.exists(), err


def test_interrupted_training_checkpoints_and_resumes(rewritten, digits, capsys, tmp_path):
    model = rewritten("mlp:sgd", 2, 16)
    out = tmp_path / "t"
    cmd = ["train", model, "--data", digits["train"], "--steps", 4000, "--batch-size", 32, "-o", out]
    proc = subprocess.Popen([sys.executable, "-m", "vfgraph.cli", *map(str, cmd), "--checkpoint-every", "100",
                             "--no-progress"], env=ENV, stderr=subprocess.PIPE, text=True)
    progress = tmp_path / "t.ckpt" / "progress.json"
    deadline = time.time() + 120
    while not progress.exists() and proc.poll() is None and time.time() < deadline:
        time.sleep(0.02)
    proc.send_signal(signal.SIGINT)
    err = proc.communicate(timeout=120)[1]
    assert proc.returncode == 130, err
    line = [x for x in err.splitlines() if x.startswith("vfgraph")][-1]
    assert "interrupted: stopped after" in line and "--resume" in line and str(progress.parent) in line, line
    with open(progress) as f:
        step = json.load(f)["step"]
    assert 100 <= step < 4000 and not out.exists()
    code, err = run(capsys, *cmd, "--resume", "--no-progress")
    assert code == 0, err
    with open(out / "assets.extra" / "vfgraph.json") as f:
        assert json.load(f)["training"]["steps"] == 4000
    assert not progress.parent.exists()
    one_error(*run(capsys, *cmd, "--resume"), "a finished run of 4000 steps")
    one_error(*run(capsys, *cmd), "exists", "--force")


def test_training_mistakes_are_one_line(rewritten, digits, capsys, tmp_path):
    model = rewritten("mlp:sgd", 2, 16)
    wide = tmp_path / "wide.npz"
    np.savez(wide, x=np.zeros((64, 96), np.float32), y=np.zeros(64, np.int32))
    text = tmp_path / "data.npz"
    text.write_text("not an npz\n")

    def train(*extra, data=digits["train"]):
        return run(capsys, "train", model, "--data", data, "-o", tmp_path / "o", "--no-progress", *extra)

    one_error(*train("--steps", 0, "--batch-size", 32), "--steps 0")
    one_error(*train("--steps", -5, "--batch-size", 32), "--steps -5")
    one_error(*train("--steps", 1, "--batch-size", 20), "--batch-size 20", "b=16")
    one_error(*train("--steps", 1, "--batch-size", 32, data=wide), "'x'", "[96]", "[64]")
    one_error(*train("--steps", 1, "--batch-size", 32, data=text), "data.npz")
    one_error(*train("--steps", 1, "--batch-size", 32, "--checkpoint-every", -1), "--checkpoint-every -1")
    assert run(capsys, "train", model, "--data", digits["train"], "--steps", 1, "--batch-size", 32, "-o",
               tmp_path / "o", "--resume", "--force")[0] == 2
    assert sorted(os.listdir(tmp_path)) == ["data.npz", "wide.npz"]


def test_verify_and_diff_exit_codes(models, rewritten, digits, capsys, tmp_path):
    src, v2 = models("mlp:sgd"), rewritten("mlp:sgd", 2, 16)
    one_error(*run(capsys, "verify", src, models("cnn:momentum")), "not the same model")
    one_error(*run(capsys, "verify", src, v2, "--batch-size", 20), "--batch-size 20", "16")
    code, err = run(capsys, "train", src, "--data", digits["train"], "--steps", 3, "--batch-size", 32,
                    "-o", tmp_path / "trained", "--no-progress")
    assert code == 0, err
    assert run(capsys, "verify", src, v2)[0] == 0
    assert run(capsys, "verify", src, tmp_path / "trained")[0] == 1  # other parameters: a mismatch
    capsys.readouterr()
    assert cli.main(["diff", str(src), str(tmp_path / "trained"), "--graphs-only"]) in (0, 1)
    assert cli.main(["diff", str(src), str(tmp_path / "trained")]) == 1
    assert "max abs difference" in capsys.readouterr().out
    assert cli.main(["diff", str(src), str(src)]) == 0
    one_error(*run(capsys, "diff", src, tmp_path / "nope"), "nope")


def test_pipeline_mistakes_are_one_line_before_any_work(models, capsys, tmp_path):
    m = models("mlp:sgd")
    one_error(*run(capsys, "rewrite", m, "--vnodes", 4, "--pipeline", "split-vnodes{vnodes=8}"),
              "--vnodes with --pipeline")
    one_error(*run(capsys, "rewrite", m, "--pipeline", "split-vnodes{vnodes=8,vnodes=2}"), "given twice")
    one_error(*run(capsys, "rewrite", m, "--pipeline", "split-vnodes{vnodes=8"), "column 13", "not closed")
    one_error(*run(capsys, "rewrite", m, "--vnodes", 0), "--vnodes 0")
    one_error(*run(capsys, "rewrite", m, "--vnode-batch", -2), "--vnode-batch -2")
    assert not any(p.name.endswith("_vnodes1") for p in tmp_path.parent.iterdir())


def test_help_is_complete():
    """Every option of every command says what it does; options with a value say their default;
    -v works after the command; help text never breaks a pipeline spec or an option mid-word."""
    parser = cli._parser()
    sub = next(a for a in parser._actions if a.__class__.__name__ == "_SubParsersAction")
    for name, p in sub.choices.items():
        for a in p._actions:
            if a.help == "==SUPPRESS==" or a.dest == "help":
                continue
            assert a.help, f"{name} {a.option_strings or a.dest}: no help"
            takes_value = a.option_strings and a.nargs != 0 and not a.required
            if takes_value and a.default not in (None, False, "") and a.choices is None:
                assert "default" in a.help, f"{name} {a.option_strings}: default {a.default!r} not stated"
        text = p.format_help()
        for line in text.splitlines():
            assert not line.rstrip().endswith("-") or line.rstrip().endswith(" -"), f"{name}: {line!r}"
    assert "'split-vnodes{vnodes=8},microbatch-inference'" in sub.choices["rewrite"].format_help()
    assert parser.parse_args(["inspect", "m", "-v"]).verbose is True
    assert parser.parse_args(["-v", "inspect", "m"]).verbose is True
    assert parser.parse_args(["inspect", "m"]).verbose is False


def test_a_damaged_model_is_one_line_for_every_command(workdir, digits, capsys, tmp_path):
    """A truncated checkpoint (an interrupted copy) is the user's input, not a bug: exit 2."""
    broken = tmp_path / "broken"
    shutil.copytree(workdir / "m", broken)
    data = next(p for p in (broken / "variables").iterdir() if ".data-" in p.name)
    data.write_bytes(data.read_bytes()[:100])
    before = tree(broken)
    for argv in (["verify", workdir / "m", broken], ["rewrite", broken, "-o", tmp_path / "r"],
                 ["export", broken, "-o", tmp_path / "e"], ["diff", workdir / "m", broken],
                 ["train", broken, "--data", digits["train"], "--steps", 1, "--batch-size", 32, "-o", tmp_path / "t"]):
        one_error(*run(capsys, *argv), str(broken))
    assert tree(broken) == before and sorted(os.listdir(tmp_path)) == ["broken", "in"]


def test_a_tf1_checkpoint_is_an_input_too(models, capsys):
    meta = models("tf1ckpt:sgd")  # the export other tests share
    prefix = meta[:-len(".meta")]
    before = tree(os.path.dirname(meta))
    for out in (prefix + ".index", os.path.dirname(meta)):
        one_error(*run(capsys, "rewrite", meta, "-o", out, "--force"), "the input")
    assert tree(os.path.dirname(meta)) == before
