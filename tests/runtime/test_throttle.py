"""vfgraph.testing.throttle: the command gets at most its share of the time, on a loaded machine
too, and its exit status and signals pass through."""
import subprocess
import sys
import time

import pytest

pytestmark = pytest.mark.alone  # two CPU hogs and a timed command: not beside another test (pytest-xdist)

# 0.4 s of CPU time, measured by the process itself
BUSY = ("import time\nt = time.process_time()\nwhile time.process_time() - t < 0.4:\n    pass\n")


def throttled(share, *command):
    return [sys.executable, "-m", "vfgraph.testing.throttle", "--share", str(share), "--", *command]


def wall(cmd):
    began = time.monotonic()
    res = subprocess.run(cmd, capture_output=True, text=True, timeout=120)
    return time.monotonic() - began, res


def test_a_command_takes_at_least_one_over_its_share_as_long_on_a_loaded_machine():
    # two busy processes besides it on this 2-CPU machine: the throttle waits for a CPU
    hogs = [subprocess.Popen([sys.executable, "-c", "while True:\n    pass"]) for _ in range(2)]
    try:
        took, res = wall(throttled(0.1, sys.executable, "-c", BUSY))
    finally:
        for hog in hogs:
            hog.kill()
            hog.wait()
    assert res.returncode == 0, res.stderr
    # 0.4 s of CPU on a tenth of the time: 4 s, less the interpreter's start-up's share of it
    assert took >= 3.6, f"0.4 s of CPU time on a tenth of the time took only {took:.2f} s"


def test_exit_status_and_bad_arguments():
    _, res = wall(throttled(0.5, sys.executable, "-c", "import sys; sys.exit(7)"))
    assert res.returncode == 7
    for bad in (["--share", "0", "--", "true"], ["--share", "1.5", "--", "true"], ["--share", "0.5"]):
        res = subprocess.run([sys.executable, "-m", "vfgraph.testing.throttle", *bad], capture_output=True,
                             text=True, timeout=60)
        assert res.returncode == 2 and "Traceback" not in res.stderr, res.stderr
