"""scripts/gpu_*.sh on a CPU machine, with stand-ins for python3, curl, nvidia-smi and pkill: every script shares
scripts/gpu_env.sh's preamble (steps, failure handling, the summary), runs every step to the end, and reports a
failed step by name with exit status 1; docs/benchmarking.md and benchmark/README.md list every script there is."""

from __future__ import annotations

import glob
import os
import re
import subprocess

import pytest

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
SCRIPTS = sorted(os.path.basename(p) for p in glob.glob(os.path.join(ROOT, "scripts", "gpu_*.sh"))
                 if not p.endswith("gpu_env.sh"))
# Scripts that need more than the stand-ins give: out/rev (the other revision) and the bf16 refusal (the stand-in
# python3 loads anything)
SETUP = {"gpu_engine_ab.sh": {"dirs": ["out/rev/python"]}, "gpu_flash_12l256e.sh": {"env": {"REFUSAL": "0"}}}


def stand_ins(tmp_path, fail_on: str) -> dict:
    """PATH with a python3 that prints a result line (`batch ...`) and succeeds, except (exit 3) when its arguments
    contain `fail_on`; a curl that answers; nvidia-smi and pkill that do nothing."""
    bin_dir = tmp_path / "bin"
    bin_dir.mkdir(exist_ok=True)
    (bin_dir / "python3").write_text(
        f'#!/bin/sh\ncase "$*" in *"{fail_on}"*) echo "stand-in failure"; exit 3;; esac\necho "batch ok $*"\n')
    for name in ("curl", "nvidia-smi", "pkill"):
        (bin_dir / name).write_text(f'#!/bin/sh\necho "{name} stand-in"\n')
    for path in bin_dir.iterdir():
        path.chmod(0o755)
    return {**os.environ, "PATH": f"{bin_dir}:{os.environ['PATH']}", "OUT": str(tmp_path / "out"),
            "PYTHONPATH": ""}


def run(tmp_path, script: str, fail_on: str = "no step has this in its arguments") -> subprocess.CompletedProcess:
    setup = SETUP.get(script, {})
    for d in setup.get("dirs", []):
        (tmp_path / d).mkdir(parents=True, exist_ok=True)
    env = {**stand_ins(tmp_path, fail_on), **setup.get("env", {})}
    return subprocess.run(["bash", os.path.join(ROOT, "scripts", script)], capture_output=True, text=True,
                          timeout=120, cwd=str(tmp_path), env=env)


def test_scripts_found():
    assert len(SCRIPTS) >= 10 and "gpu_validate.sh" in SCRIPTS


@pytest.mark.parametrize("script", SCRIPTS)
def test_each_script_is_its_steps(script):
    """The preamble is sourced, never copied: no script defines its own step runner or failure list."""
    text = open(os.path.join(ROOT, "scripts", script)).read()
    assert 'source "$(dirname "$0")/gpu_env.sh"' in text
    for own in (r"^\s*step\s*\(\)", r"^\s*finish\s*\(\)", r"FAILED\+?=", r"--target /tmp/site", r"PYTHONUNBUFFERED"):
        assert not re.search(own, text, re.M), f"{script} repeats the preamble ({own})"


@pytest.mark.parametrize("script", SCRIPTS)
def test_every_step_passes(tmp_path, script):
    proc = run(tmp_path, script)
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    assert proc.stdout.rstrip().endswith("all steps passed"), proc.stdout[-3000:]
    assert "=== FAILED" not in proc.stdout
    assert os.path.getsize(tmp_path / "out" / "log.txt") > 0  # each step's output is kept


@pytest.mark.parametrize("script, fail_on, failed_step, later_step", [
    ("gpu_moe.sh", "sweep_moe_mxfp4.py", "sweep", "=== whole op, the parity planes at every decode batch"),
    ("gpu_fp8_prefill.sh", "test_dsv4_fp8_gemm.py", "FP8 GEMM GPU tests", "=== producers that quantize"),
    ("gpu_kv_dtype.sh", "bench_kv_cache_dtype.py", "agreement: fp8 vs bf16 KV vs exact",
     "=== decode, 16,384-token prompts, --kv-cache-dtype fp8_e4m3"),
    ("gpu_engine_ab.sh", "print('rev:", "rev, round 1", "=== this, round 2"),
    ("gpu_prefix_cache.sh", "multi_turn_on.jsonl", "multi-turn, cache on", "=== shared prefix, cache off"),
    ("gpu_multi.sh", "--tp 2 --ep 2", "decode: /tmp/w/base --dtype bfloat16 --tp 2 --ep 2", "=== engine log: --tp 2"),
])
def test_a_failed_step_is_named_and_the_rest_still_run(tmp_path, script, fail_on, failed_step, later_step):
    proc = run(tmp_path, script, fail_on)
    assert proc.returncode == 1, proc.stdout[-3000:] + proc.stderr[-3000:]
    assert f"=== FAILED: {failed_step}\n" in proc.stdout
    assert f"failed step: {failed_step}\n" in proc.stdout
    assert later_step in proc.stdout
    assert "all steps passed" not in proc.stdout


def test_a_step_past_its_bound_fails(tmp_path):
    """STEP_S bounds each step: a hang fails its step instead of the whole call."""
    env = stand_ins(tmp_path, "-")
    (tmp_path / "bin" / "python3").write_text('#!/bin/sh\ncase "$*" in *hang*) sleep 30;; esac\necho ok\n')
    code = f'source {os.path.join(ROOT, "scripts", "gpu_env.sh")}; STEP_S=1 step "hangs" python3 hang; finish'
    proc = subprocess.run(["bash", "-c", code], capture_output=True, text=True, timeout=60, cwd=str(tmp_path),
                          env=env)
    assert proc.returncode == 1 and "failed step: hangs" in proc.stdout, proc.stdout + proc.stderr


@pytest.mark.parametrize("script", SCRIPTS)
def test_files_a_script_names_exist(script):
    """Every repository path a script passes (tests, benchmarks, scripts, configs) is there: a renamed test file or
    benchmark fails here, not as a missing file on a GPU machine."""
    text = open(os.path.join(ROOT, "scripts", script)).read()
    named = set(re.findall(r"(?<![\w/.$-])((?:test|benchmark|scripts)/[\w/.-]+\.(?:py|sh|json))", text))
    assert named, script
    missing = sorted(p for p in named if not os.path.exists(os.path.join(ROOT, p)))
    assert missing == [], f"{script} names files that do not exist"


def test_docs_list_every_script():
    """docs/benchmarking.md names every GPU script, benchmark/README.md every benchmark script, one line each."""
    docs = open(os.path.join(ROOT, "docs", "benchmarking.md")).read()
    for script in SCRIPTS:
        assert len(re.findall(rf"^\| `{re.escape(script)}`", docs, re.M)) == 1, script
    readme = open(os.path.join(ROOT, "benchmark", "README.md")).read()
    scripts = [os.path.relpath(p, os.path.join(ROOT, "benchmark"))
               for sub in ("*.py", "kernels/*.py", "*/bench_sglang.py", "tiny_model/train.py",
                           "tiny_model/evaluate.py")
               for p in glob.glob(os.path.join(ROOT, "benchmark", sub))]
    for script in scripts:
        assert len(re.findall(rf"^\| `{re.escape(script)}`", readme, re.M)) == 1, script
    for listed in re.findall(r"^\| `([\w/]+\.py)`", readme, re.M):
        assert listed in scripts, f"benchmark/README.md lists {listed}, which does not exist"
    for listed in re.findall(r"^\| `(gpu_\w+\.sh)`", docs, re.M):
        assert listed in SCRIPTS, f"docs/benchmarking.md lists {listed}, which does not exist"


def test_results_page_and_raw_files_agree():
    """benchmark/RESULTS.md cites every raw file under benchmark/results/ by name, and every file it cites is there."""
    page = open(os.path.join(ROOT, "benchmark", "RESULTS.md")).read()
    kept = set(os.listdir(os.path.join(ROOT, "benchmark", "results")))
    cited = set(re.findall(r"`(?:benchmark/results/)?([\w.-]+\.(?:json|jsonl|txt))`", page))
    assert sorted(kept - cited) == [], "raw files no section cites"
    assert sorted(cited - kept) == [], "cited raw files that are not in benchmark/results/"
