"""benchmark/ and scripts/ on a CPU machine: every engine import they name exists, the MoE register report compiles
the kernels' launches with the constexprs those kernels take, and bench_moe_mxfp4.py --config-from picks only
launches the kernels still have."""

from __future__ import annotations

import ast
import glob
import importlib
import importlib.util
import inspect
import json
import os
import subprocess
import sys

import pytest

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
SOURCES = sorted(glob.glob(os.path.join(ROOT, "benchmark", "**", "*.py"), recursive=True)
                 + glob.glob(os.path.join(ROOT, "scripts", "*.py")))
PACKAGES = ("sgl_kernel", "sglang")


def _load(relpath: str):
    """A benchmark script as a module (its own imports resolved as when run from the repository root)."""
    path = os.path.join(ROOT, relpath)
    sys.path.insert(0, os.path.dirname(path))
    try:
        spec = importlib.util.spec_from_file_location(os.path.splitext(os.path.basename(path))[0], path)
        module = importlib.util.module_from_spec(spec)
        spec.loader.exec_module(module)
    finally:
        sys.path.remove(os.path.dirname(path))
    return module


def _engine_imports(path: str) -> list:
    """(line, module, names) of every import of sgl_kernel / sglang in a file (names empty for `import m`)."""
    found = []
    for node in ast.walk(ast.parse(open(path).read(), path)):
        if isinstance(node, ast.ImportFrom) and node.level == 0 and (node.module or "").split(".")[0] in PACKAGES:
            found.append((node.lineno, node.module, [a.name for a in node.names]))
        elif isinstance(node, ast.Import):
            found += [(node.lineno, a.name, []) for a in node.names if a.name.split(".")[0] in PACKAGES]
    return found


def test_sources_found():
    names = {os.path.relpath(p, ROOT) for p in SOURCES}
    assert {"benchmark/bench_moe_mxfp4.py", "benchmark/kernels/moe_registers.py",
            "scripts/make_slice_checkpoint.py"} <= names


@pytest.mark.parametrize("path", SOURCES, ids=lambda p: os.path.relpath(p, ROOT))
def test_engine_imports_exist(path):
    """Each `from sgl_kernel.x import a` / `from sglang.y import b` a benchmark or script names resolves: the module
    exists and has the name (or the name is a submodule)."""
    for line, module, names in _engine_imports(path):
        where = f"{os.path.relpath(path, ROOT)}:{line}"
        assert importlib.util.find_spec(module) is not None, f"{where}: no module {module}"
        loaded = importlib.import_module(module)
        for name in names:
            assert hasattr(loaded, name) or importlib.util.find_spec(f"{module}.{name}") is not None, \
                f"{where}: {module} has no {name}"


def _constexpr_names(kernel) -> set:
    return {name for name, p in inspect.signature(kernel.fn).parameters.items() if "constexpr" in str(p.annotation)}


@pytest.mark.parametrize("planes", [False, True])
@pytest.mark.parametrize("tokens", [1, 4, 32, 4096])
def test_register_report_passes_each_kernels_constexprs(tokens, planes):
    """moe_registers.py compiles each launch of moe_config with exactly the constexprs its kernel declares (the
    planes' or the general kernels'), so the figures are the engine's kernel."""
    from sgl_kernel.dsv4_moe import moe_config

    registers = _load("benchmark/kernels/moe_registers.py")
    cfg = moe_config(tokens * 6, 256, tma=not planes, planes=planes)
    assert cfg.gate_up.planes == (planes and tokens < 100)  # prefill sizes keep the scaled dot
    for index, launch in enumerate((cfg.gate_up, cfg.down)):
        kernel = registers.kernels_of(launch)[index]
        for tma in ([False] if launch.planes else [False, True]):
            assert set(registers.constexprs(cfg.block_m, launch, tma)) == _constexpr_names(kernel), kernel


def test_register_report_compiles_for_sm90_on_a_cpu():
    """A real run (Triton's bundled ptxas and cuobjdump; no GPU, no interpreter): the planes' launches with K splits
    at one token, the general kernels' at a prefill size."""
    env = {k: v for k, v in os.environ.items() if k != "TRITON_INTERPRET"}
    proc = subprocess.run([sys.executable, os.path.join(ROOT, "benchmark", "kernels", "moe_registers.py"), "--planes",
                           "--tokens", "1", "4096", "--tma", "off"], capture_output=True, text=True, timeout=600,
                          cwd=ROOT, env=env)
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    lines = [ln for ln in proc.stdout.splitlines() if "REG:" in ln]
    assert len(lines) == 4, proc.stdout
    assert all("planes=True" in ln for ln in lines[:2]) and "split_k=4" in lines[0], proc.stdout
    assert all("planes=False" in ln for ln in lines[2:]), proc.stdout


def _row(tokens: int, kernel: str, ms: float, launch, **extra) -> dict:
    import dataclasses

    return {"tokens": tokens, "kernel": kernel, "block_m": 16, **dataclasses.asdict(launch), **extra, "ms": ms,
            "floor_ms": 0.01, "fraction_of_copy_bw": 0.5, "relative_error_vs_default": 0.0}


def test_config_from_passes_over_launches_the_kernels_dropped():
    """Older sweeps hold rows of general-kernel K splits, per-byte scale loads and other dropped variants; the best
    config is built from the launches the kernels still have, and a current sweep's rows round-trip."""
    from sgl_kernel.dsv4_moe import PLANES_DOWN, PLANES_GATE_UP_ONE, MoeLaunch

    bench = _load("benchmark/bench_moe_mxfp4.py")
    plain = MoeLaunch(64, 256, 4, 1)
    split = {**_row(1, "gate_up", 0.001, plain), "split_k": 2}  # the general kernels' K splits, gone
    rows = [split, _row(1, "gate_up", 0.002, plain, scale_bcast=False), _row(1, "gate_up", 0.003, plain, fma=True),
            _row(1, "gate_up", 0.030, PLANES_GATE_UP_ONE), _row(1, "gate_up", 0.040, plain, scale_bcast=True),
            _row(1, "down", 0.001, plain, prefetch=True), _row(1, "down", 0.020, PLANES_DOWN, group_dot=False),
            {**_row(1, "down", 0.0, plain), "failed": "OutOfResources"}]
    del rows[-1]["ms"]
    cfg = bench.swept_config(rows, 1)
    assert (cfg.block_m, cfg.gate_up, cfg.down) == (16, PLANES_GATE_UP_ONE, PLANES_DOWN)
    assert bench.swept_launch(_row(1, "down", 0.1, PLANES_GATE_UP_ONE)) == PLANES_GATE_UP_ONE
    assert bench.swept_config(rows, 8) is None


@pytest.mark.parametrize("content", ["not json", json.dumps([1, 2]), json.dumps({"rows": [{"tokens": 1}]}), None])
def test_config_from_names_the_flag_on_a_bad_file(tmp_path, content):
    bench = _load("benchmark/bench_moe_mxfp4.py")
    path = tmp_path / "sweep.json"
    if content is not None:
        path.write_text(content)
    with pytest.raises(SystemExit, match="--config-from"):
        bench.load_sweep(str(path))
