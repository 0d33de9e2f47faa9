"""A benchmark/kernels script imported as a module, for tests of its pieces (registered in sys.modules, which its
dataclasses need)."""

from __future__ import annotations

import importlib.util
import os
import sys

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))


def load_benchmark(name: str):
    """benchmark/kernels/<name>.py as the module `name`."""
    spec = importlib.util.spec_from_file_location(name, os.path.join(ROOT, "benchmark", "kernels", f"{name}.py"))
    module = importlib.util.module_from_spec(spec)
    sys.modules.setdefault(name, module)
    spec.loader.exec_module(module)
    return module
