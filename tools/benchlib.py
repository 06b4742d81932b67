"""What the benchmark scripts share."""
import os
import subprocess

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


def git_state():
    """The commit the benchmark ran against, and whether tracked files differed from it."""
    try:
        head = subprocess.run(["git", "-C", ROOT, "rev-parse", "HEAD"], capture_output=True, text=True).stdout.strip()
        dirty = subprocess.run(["git", "-C", ROOT, "status", "--porcelain", "--untracked-files=no"],
                               capture_output=True, text=True).stdout.strip()
        return {"commit": head or None, "tracked_files_modified": bool(dirty)}
    except OSError:
        return {"commit": None, "tracked_files_modified": None}
