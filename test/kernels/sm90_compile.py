"""Kernels compiled for an sm90 GPU on the CPU, for tests of what the compiler makes of them (layouts, instructions):
in a subprocess, since the test process may run the Triton interpreter."""

from __future__ import annotations

import json
import os
import subprocess
import sys

import pytest


# The head of a compile script: the imports, and usage(cubin) -> (registers, stack bytes) of its kernel (cuobjdump).
SM90_PREAMBLE = r"""
import json, os, subprocess, tempfile
import triton
from triton.backends.compiler import GPUTarget

def usage(cubin):
    tool = os.path.join(os.path.dirname(triton.__file__), "backends", "nvidia", "bin", "cuobjdump")
    with tempfile.NamedTemporaryFile(suffix=".cubin") as f:
        f.write(cubin)
        f.flush()
        out = subprocess.run([tool, "-res-usage", f.name], capture_output=True, text=True, check=True).stdout
    line = next(ln for ln in out.splitlines() if "REG:" in ln).split()
    return int(line[0].split(":")[1]), int(line[1].split(":")[1])
"""


def compiled_facts(script: str, *args: str, timeout: int = 900):
    """Runs `script` (Python that compiles for GPUTarget("cuda", 90, 32) and prints what it found as JSON on its last
    line) without TRITON_INTERPRET and returns that JSON; skips where Triton has no NVIDIA backend."""
    pytest.importorskip("triton.backends.nvidia")
    env = {k: v for k, v in os.environ.items() if k != "TRITON_INTERPRET"}
    run = subprocess.run([sys.executable, "-c", script, *args], env=env, capture_output=True, text=True,
                         timeout=timeout)
    assert run.returncode == 0, run.stderr[-2000:]
    return json.loads(run.stdout.strip().splitlines()[-1])
