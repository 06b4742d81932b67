"""A script of tools/ loaded as a module, for the tests of tools/."""
import importlib.util
import os
import sys

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))


def tool_path(name: str) -> str:
    """tools/NAME.py."""
    return os.path.join(ROOT, "tools", f"{name}.py")


def load_tool(name: str):
    """tools/NAME.py, imported as the module NAME."""
    spec = importlib.util.spec_from_file_location(name, tool_path(name))
    module = importlib.util.module_from_spec(spec)
    sys.modules[name] = module  # (a dataclass looks its module up)
    spec.loader.exec_module(module)
    return module
