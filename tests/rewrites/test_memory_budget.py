"""--memory-budget: the virtual-node batch b chosen from the training step's measured memory.

The step's peak is read from TensorFlow's BFC allocator on the CPU, in a process of its own
(vfgraph.analysis.memory); the checks measure the real step the same way at the b chosen and
at the next one."""
import json
import shutil

import pytest

import vfgraph
from vfgraph import cli
from vfgraph.analysis.memory import DEFAULT_MARGIN, measure_peaks, parse_size
from vfgraph.passes.base import OptionError
from vfgraph.records import VirtualNodes, get
from vfgraph.testing.cli import one_error, run_in_process, tree_digest, vf

MODEL = "cnn"  # the digits CNN: batch dimension not fixed, convolutions, a training step of a second


@pytest.fixture(scope="module")
def profiled(models, tmp_path_factory):
    """(the model, a profile of its step written by 'vfgraph profile', that profile's memory)."""
    path = str(tmp_path_factory.mktemp("budget") / "profile.json")
    res = vf("profile", models(MODEL), "-o", path, "--batch", 8, "--steps", 2)
    assert res.returncode == 0, res.stderr[-2000:]
    with open(path) as f:
        memory = json.load(f)["memory"]
    return models(MODEL), path, memory


@pytest.mark.parametrize("text, size", [("2GiB", 2 * 2 ** 30), ("512MiB", 512 * 2 ** 20), ("1.5GB", 1500 * 10 ** 6),
                                        ("1048576", 1048576), ("64 kb", 64000), ("3tib", 3 * 2 ** 40)])
def test_sizes(text, size):
    assert parse_size(text) == size


def test_bad_sizes_are_refused_where_the_option_is_declared(models, capsys, tmp_path):
    model = models(MODEL)
    for bad in ("2xB", "1.5", "0", "0.0001KB", "GiB", "2 GiB extra"):
        line = one_error(*run_in_process(capsys, "rewrite", model, "--memory-budget", bad, "-o", tmp_path / "o"),
                         f"--memory-budget {bad}")
        assert "give" in line, line
        with pytest.raises(OptionError, match="memory-budget"):
            vfgraph.rewrite(model, memory_budget=bad)
    code, err = run_in_process(capsys, "rewrite", model, "--pipeline", "split-vnodes{memory-budget=12xB}",
                               "-o", tmp_path / "o")
    one_error(code, err, "memory-budget=12xB", "not a size")
    assert not (tmp_path / "o").exists()


def test_a_budget_with_the_virtual_nodes_given_is_refused(models, capsys, tmp_path):
    model = models(MODEL)
    for flags in (["--vnodes", 4], ["--vnode-batch", 8]):
        one_error(*run_in_process(capsys, "rewrite", model, "--memory-budget", "1GiB", *flags, "-o", tmp_path / "o"),
                  "--memory-budget 1GiB", "leave out one of them")
    one_error(*run_in_process(capsys, "rewrite", model, "--memory-margin", 0.2, "-o", tmp_path / "o"),
              "--memory-margin 0.2", "without memory-budget")
    one_error(*run_in_process(capsys, "rewrite", model, "--memory-budget", "1GiB", "--memory-margin", 0.95,
                              "-o", tmp_path / "o"), "--memory-margin 0.95")
    one_error(*run_in_process(capsys, "rewrite", model, "--memory-budget", "1GiB", "--stages", 2, "-o", tmp_path / "o"),
              "memory-budget with pipeline stages", "give vnode-batch")
    with pytest.raises(OptionError, match="memory-margin"):
        vfgraph.rewrite(model, memory_margin=0.2)
    assert not (tmp_path / "o").exists()


def test_a_budget_too_small_names_the_smallest_that_fits(profiled, capsys, tmp_path):
    model, profile, _ = profiled
    line = one_error(*run_in_process(capsys, "rewrite", model, "--memory-budget", "1MiB", "--profile", profile,
                                     "-o", tmp_path / "o"), "below what a step of one example needs")
    smallest = int(line.split("give at least ")[1].split(" bytes")[0])
    assert not (tmp_path / "o").exists()
    one_error(*run_in_process(capsys, "rewrite", model, "--memory-budget", smallest - 2, "--profile", profile,
                              "-o", tmp_path / "o"), f"give at least {smallest} bytes")
    item = vfgraph.rewrite(model, memory_budget=str(smallest), profile=profile)
    assert get(item, VirtualNodes)["train"].vnode_batch >= 1  # (more where b=2 measured below b=1: noise)


def test_the_chosen_b_fits_and_the_next_does_not(profiled):
    """Measured here (no profile): the real step's peak at the chosen b is within the budget,
    at b + 1 it is over the budget less the margin, or short of it by no more than 1% of the
    budget (the allocator's rounding: a fitted line, not every byte); the record holds the fit."""
    model, _, memory = profiled
    fixed = max(memory["peaks"])
    budget = int((fixed + 24 * 2600) / (1 - DEFAULT_MARGIN))  # about 24 examples' worth above the step's fixed part
    item = vfgraph.rewrite(model, memory_budget=str(budget), allreduce="none")
    rec = get(item, VirtualNodes)["train"]
    b, fit = rec.vnode_batch, rec.memory
    assert b == fit.chosen and b > 1 and rec.vnodes == 1
    assert fit.budget == budget and fit.margin == DEFAULT_MARGIN and fit.source == "measured"
    assert fit.per_example > 0 and fit.fixed > 0 and len(fit.batches) == len(fit.peaks) >= 2
    usable = budget * (1 - DEFAULT_MARGIN)
    measured = dict(zip(fit.batches, fit.peaks))
    assert fit.fixed + fit.per_example * b <= usable
    assert fit.fixed + fit.per_example * (b + 1) > usable or measured.get(b + 1, 0) > usable
    at_b, at_next = measure_peaks(model, "train", (b, b + 1)).peaks
    assert at_b <= budget, (b, at_b, budget)
    assert at_next > budget * (1 - DEFAULT_MARGIN - 0.01), (b, at_next, budget)


def test_the_same_profile_gives_the_same_bytes_and_inspect_shows_the_fit(profiled, capsys, tmp_path):
    model, profile, memory = profiled
    moved = tmp_path / "elsewhere.json"  # (the file, not where it lies, decides)
    shutil.copy(profile, moved)
    outs = []
    for k in range(2):
        out = tmp_path / f"o{k}"
        code, err = run_in_process(capsys, "rewrite", model, "--memory-budget", "20MiB", "--profile", moved, "-o", out)
        assert code == 0, err
        outs.append(tree_digest(out))
    assert outs[0] == outs[1]
    capsys.readouterr()
    assert cli.main(["inspect", str(tmp_path / "o0")]) == 0
    text = capsys.readouterr().out
    line = next(ln for ln in text.splitlines() if "memory budget" in ln)
    rec = vfgraph.load(str(tmp_path / "o0"))
    fit = get(rec, VirtualNodes)["train"].memory
    assert fit.source == "profile" and list(fit.peaks) == memory["peaks"] and fit.budget == 20 * 2 ** 20
    assert f"b={fit.chosen}" in line and "less a 10% margin" in line and "at b=1" in line, line


def test_a_profile_without_memory_is_refused(profiled, capsys, tmp_path):
    model, profile, _ = profiled
    with open(profile) as f:
        record = json.load(f)
    del record["memory"]  # (a profile of an earlier vfgraph)
    old = tmp_path / "old.json"
    old.write_text(json.dumps(record))
    one_error(*run_in_process(capsys, "rewrite", model, "--memory-budget", "1GiB", "--profile", old,
                              "-o", tmp_path / "o"), "holds no memory measurement", "vfgraph profile")
    assert not (tmp_path / "o").exists()
