"""tools/bench_docs.py: benchmark tables rendered from JSON reports, hand-written prose kept,
stale documents detected; and docs/benchmarks.md up to date with docs/results. No TensorFlow."""
import json
import os
import subprocess
import sys

import pytest

from tool_module import ROOT, load_tool, tool_path

TOOL = tool_path("bench_docs")
bench_docs = load_tool("bench_docs")

# What tools/bench_save.py writes, cut down to one row per group and made up for the test.
SAVE = {"benchmark": "save", "model": "resnet50", "checkpoint_mb": 270.4, "commit": "0123456789abcdef",
        "tracked_files_modified": False, "cpus": 2,
        "rows": [{"groups": "whole", "group_bytes": 1 << 40, "save_s": 1.5, "peak_mb": 500.0, "time_ratio": 1.0,
                  "peak_ratio": 1.0, "shards": 1, "runs": [{}, {}, {}]},
                 {"groups": "64 MB (default)", "group_bytes": 64 << 20, "save_s": 0.75, "peak_mb": 125.0,
                  "time_ratio": 0.5, "peak_ratio": 0.25, "shards": 5, "runs": [{}, {}, {}]}]}

DOC = """# Benchmarks

Prose before the table.

<!-- bench:save results/save.json -->
| an old table |
<!-- /bench:save -->

Prose after the table, kept as written.
"""


@pytest.fixture
def doc(tmp_path):
    (tmp_path / "results").mkdir()
    (tmp_path / "results" / "save.json").write_text(json.dumps(SAVE))
    (tmp_path / "results" / "runs.json").write_text(json.dumps(
        {"save.json": {"command": "python tools/bench_save.py", "date": "2026-01-02"}}))
    path = tmp_path / "benchmarks.md"
    path.write_text(DOC)
    return path


def test_renders_the_table_and_keeps_the_prose(doc):
    assert bench_docs.main(["--doc", str(doc), "--check"]) == 1
    assert doc.read_text() == DOC  # --check changes nothing
    assert bench_docs.main(["--doc", str(doc)]) == 0
    text = doc.read_text()
    assert "an old table" not in text
    assert "Prose before the table.\n" in text and "Prose after the table, kept as written.\n" in text
    assert "| 64 MB (default) | 0.75 | 125 | 0.50 | 0.25 | 5 |" in text
    assert "ResNet-50, checkpoint of 270 MB; medians of 3 saves" in text
    assert ("from `results/save.json`, `python tools/bench_save.py`, run on 2026-01-02, commit 0123456, "
            "2 CPUs.") in text
    assert bench_docs.main(["--doc", str(doc), "--check"]) == 0
    assert bench_docs.main(["--doc", str(doc)]) == 0 and doc.read_text() == text  # idempotent


def test_check_finds_a_report_newer_than_the_document(doc, capsys):
    assert bench_docs.main(["--doc", str(doc)]) == 0
    changed = dict(SAVE, rows=[dict(SAVE["rows"][0], save_s=2.25)] + SAVE["rows"][1:])
    (doc.parent / "results" / "save.json").write_text(json.dumps(changed))
    assert bench_docs.main(["--doc", str(doc), "--check"]) == 1
    assert "out of date" in capsys.readouterr().err and "save results/save.json" in doc.read_text()
    assert bench_docs.main(["--doc", str(doc)]) == 0
    assert "| whole | 2.25 |" in doc.read_text()


def test_check_finds_a_hand_edited_table(doc):
    assert bench_docs.main(["--doc", str(doc)]) == 0
    doc.write_text(doc.read_text().replace("| 0.75 |", "| 0.70 |"))
    assert bench_docs.main(["--doc", str(doc), "--check"]) == 1


@pytest.mark.parametrize("text, message", [
    ("<!-- bench:save results/missing.json -->\n<!-- /bench:save -->\n", "no such benchmark report"),
    ("<!-- bench:save results/save.json -->\nno end\n", "has no '<!-- /bench:save -->'"),
    ("<!-- bench:nosuch results/save.json -->\n<!-- /bench:nosuch -->\n", "unknown table kind 'nosuch'"),
    ("<!-- bench:step results/save.json -->\n<!-- /bench:step -->\n", "not a report the 'step' table can read"),
])
def test_mistakes_are_one_line(doc, capsys, text, message):
    doc.write_text(text)
    assert bench_docs.main(["--doc", str(doc)]) == 2
    err = capsys.readouterr().err
    assert message in err and err.count("\n") == 1
    assert doc.read_text() == text


def test_committed_benchmarks_are_up_to_date():
    """docs/benchmarks.md is what docs/results gives (run `python tools/bench_docs.py`)."""
    assert bench_docs.main(["--check"]) == 0


def test_every_report_in_docs_results_is_rendered_and_recorded():
    results = os.path.join(ROOT, "docs", "results")
    with open(os.path.join(ROOT, "docs", "benchmarks.md")) as f:
        used = {os.path.basename(m.group("file")) for m in bench_docs.BEGIN.finditer(f.read())}
    with open(os.path.join(results, bench_docs.MANIFEST)) as f:
        runs = json.load(f)
    reports = {n for n in os.listdir(results) if n.endswith(".json") and n != bench_docs.MANIFEST}
    assert reports == used
    assert reports <= set(runs) and all(runs[n].get("command") and runs[n].get("date") for n in reports)


def test_runs_without_tensorflow():
    code = (f"import runpy, sys\n"
            f"sys.argv = [{TOOL!r}, '--check']\n"
            f"try:\n    runpy.run_path({TOOL!r}, run_name='__main__')\n"
            f"except SystemExit as e:\n    rc = e.code\n"
            f"else:\n    rc = 0\n"
            f"assert 'tensorflow' not in sys.modules, 'imported tensorflow'\n"
            f"sys.exit(rc)\n")
    res = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, cwd=ROOT)
    assert res.returncode == 0, res.stderr
