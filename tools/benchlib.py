"""What the benchmark scripts share. Importing it (before TensorFlow) quiets TensorFlow's
start-up logs and makes the repository and its examples importable."""
import os
import subprocess
import sys

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
os.environ.setdefault("TF_CPP_MIN_LOG_LEVEL", "2")
os.environ.setdefault("TF_ENABLE_ONEDNN_OPTS", "0")
for _path in (os.path.join(ROOT, "examples"), ROOT):
    if _path not in sys.path:
        sys.path.insert(0, _path)


def git_state():
    """The commit the benchmark ran against, and whether tracked files differed from it."""
    try:
        head = subprocess.run(["git", "-C", ROOT, "rev-parse", "HEAD"], capture_output=True, text=True).stdout.strip()
        dirty = subprocess.run(["git", "-C", ROOT, "status", "--porcelain", "--untracked-files=no"],
                               capture_output=True, text=True).stdout.strip()
        return {"commit": head or None, "tracked_files_modified": bool(dirty)}
    except OSError:
        return {"commit": None, "tracked_files_modified": None}


def write_report(path: str, report: dict) -> None:
    """Write a benchmark's JSON report and say where."""
    import json

    os.makedirs(os.path.dirname(os.path.abspath(path)), exist_ok=True)
    with open(path, "w") as f:
        json.dump(report, f, indent=2)
    print(f"\nwrote {path}")


def proc_status(field: str) -> float:
    """A /proc/self/status memory field in bytes (VmRSS, VmHWM); NaN where /proc lacks it."""
    from vfgraph.runtime.world import resident_bytes

    return float(resident_bytes(field) or "nan")


def reset_hwm() -> bool:
    """Reset this process's resident-set high-water mark (VmHWM); False where not allowed."""
    try:
        with open("/proc/self/clear_refs", "w") as f:
            f.write("5")
        return True
    except OSError:
        return False
