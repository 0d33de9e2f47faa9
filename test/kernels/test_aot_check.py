"""sgl_kernel.aot_check: every kernel launch of the engine's plan compiles for gfx942, gfx950 and sm90 (on this CPU,
without the interpreter; held by the committed manifest, checked against a sample compiled each run), the plan names
every launched kernel, and the check reports what goes wrong."""

from __future__ import annotations

import ast
import json
import os
import subprocess
import sys

import pytest

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
KERNEL_DIR = os.path.join(ROOT, "sgl-kernel", "python", "sgl_kernel")
UNRECORDED_LAUNCHES = 12  # launches the manifest may lack (a new shape in a change) before the refresh is due


def _run(*args: str, timeout: int = 1500) -> subprocess.CompletedProcess:
    env = {k: v for k, v in os.environ.items() if k != "TRITON_INTERPRET"}
    return subprocess.run([sys.executable, *args], env=env, capture_output=True, text=True, timeout=timeout)


@pytest.fixture(scope="module")
def checked(tmp_path_factory):
    """The check's rows for every launch of the plan on gfx942, gfx950 and sm90 (~1,450): from the committed manifest
    (sgl_kernel/aot_manifest.json), launches it lacks compiled now, and a rotating sample of 24 it holds compiled
    again with an empty Triton cache, which must reproduce their rows (~60-100 s on two cores, no kernel changed)."""
    pytest.importorskip("triton.backends.amd")
    pytest.importorskip("triton.backends.nvidia")
    out = tmp_path_factory.mktemp("aot") / "rows.json"
    run = _run("-m", "sgl_kernel.aot_check", "--target", "gfx942", "gfx950", "sm90", "--manifest", "--jobs", "2",
               "--json", str(out))
    print(next((ln for ln in run.stdout.splitlines() if ln.startswith("manifest:")), run.stderr[-2000:]))
    return run, json.loads(out.read_text()) if out.exists() else []


def test_every_planned_launch_compiles_for_gfx942_gfx950_sm90(checked):
    """Every launch compiles for each target within its shared memory (LDS), gfx950 (MI355X) runs without register
    spills (scratch), the sample compiled now reproduces the manifest, and the exit status says so."""
    run, rows = checked
    assert run.returncode != 2, run.stderr[-3000:]  # the manifest is missing or of another Triton
    assert {r["target"] for r in rows} == {"gfx942", "gfx950", "sm90"}
    failed = [f"{r['target']} {r['kernel']} [{r['config']}] {r['error']}" for r in rows if not r["ok"]]
    over = [f"{r['target']} {r['kernel']} [{r['config']}] {r['shared']} > {r['shared_limit']}" for r in rows
            if r["ok"] and r["shared"] > r["shared_limit"]]
    spills = [f"{r['kernel']} [{r['config']}] {r['spill']} B" for r in rows if r["target"] == "gfx950" and r["spill"]]
    differ = [ln for ln in run.stdout.splitlines() if ln.startswith("differs from the manifest")]
    sources = {s: sum(r["source"] == s for r in rows) for s in ("manifest", "compiled", "sample")}
    print(f"{len(rows)} launches {sources}, {len(failed)} failed, {len(over)} over shared memory, {len(spills)} "
          f"gfx950 rows with scratch ({sum(r['decode'] for r in rows if r['target'] == 'gfx950')} decode-path rows)")
    assert len(rows) > 1000 and sources["sample"] > 0  # the whole plan, and a real compile every run
    # Launches the manifest lacks compile on every run (~3 s each on two cores): a kernel change refreshes it.
    assert sources["compiled"] <= UNRECORDED_LAUNCHES, (
        f"{sources['compiled']} launches are not in sgl_kernel/aot_manifest.json: refresh it with python -m "
        f"sgl_kernel.aot_check --target gfx942 gfx950 sm90 --update-manifest")
    assert not failed, "\n".join(failed)
    assert not over, "\n".join(over)
    assert not spills, "\n".join(spills)
    assert not differ, "\n".join(differ)
    assert run.returncode == 0, run.stdout[-3000:] + run.stderr[-3000:]


CUOBJDUMP = """
Resource usage:
 Common:
  GLOBAL:35 CONSTANT[4]:16
 Function __internal_trig_reduction_slowpathd:
  REG:32 STACK:6144 SHARED:0 LOCAL:0 TEXTURE:0 SURFACE:0 SAMPLER:0
 Function _dsv4_rope_kernel:
  REG:40 STACK:0 SHARED:0 LOCAL:0 CONSTANT[0]:600 TEXTURE:0 SURFACE:0 SAMPLER:0
"""


def test_nvidia_usage_is_the_kernels_not_a_callees():
    from sgl_kernel.aot_check import parse_res_usage

    assert parse_res_usage(CUOBJDUMP, "_dsv4_rope_kernel") == (40, 0)
    with pytest.raises(ValueError, match="_other_kernel"):
        parse_res_usage(CUOBJDUMP, "_other_kernel")


def _launched_kernels() -> dict:
    """Kernel name -> module, for every @triton.jit function of sgl_kernel launched with a grid (`name[grid](`)."""
    found = {}
    for name in sorted(os.listdir(KERNEL_DIR)):
        if not name.startswith("dsv4_") or not name.endswith(".py"):
            continue
        with open(os.path.join(KERNEL_DIR, name), encoding="utf-8") as f:
            tree = ast.parse(f.read())
        for node in ast.walk(tree):
            if isinstance(node, ast.Call) and isinstance(node.func, ast.Subscript) \
                    and isinstance(node.func.value, ast.Name):
                found[node.func.value.id] = name
    return found


def test_plan_launches_every_kernel_with_a_launcher(checked):
    from sgl_kernel.aot_plan import KERNEL_EXCLUSIONS

    _, rows = checked
    planned = {r["kernel"] for r in rows}
    launched = _launched_kernels()
    assert len(launched) > 20  # the walk finds the launch sites
    missing = sorted(k for k in launched if k not in planned and k not in KERNEL_EXCLUSIONS)
    assert not missing, f"kernels with a launcher that the plan never launches: {missing}"


def test_targets_see_their_own_paths_and_fp8(checked):
    """The device probes answer per target: NVIDIA-only paths (PTX planes, GEMV MoE, PDL) in sm90's plan only;
    gfx942's FP8 operands are e4m3fnuz (fp8e4b8), gfx950's and sm90's OCP e4m3 (fp8e4nv)."""
    _, rows = checked
    kernels = {t: {r["kernel"] for r in rows if r["target"] == t} for t in ("gfx942", "gfx950", "sm90")}
    nvidia_only = {"_planes_gate_up_kernel", "_gate_up_kernel", "_prepare_kernel"}
    assert nvidia_only <= kernels["sm90"] and not nvidia_only & (kernels["gfx942"] | kernels["gfx950"])
    fp8 = {t: {"fnuz" if "*fp8e4b8" in r["signature"] else "ocp" for r in rows if r["target"] == t
               and r["kernel"] == "_moe_gate_up_kernel" and "fp8e4" in r["signature"]} for t in kernels}
    assert fp8 == {"gfx942": {"fnuz"}, "gfx950": {"ocp"}, "sm90": {"ocp"}}


CHECKER = r"""
import json, sys
from dataclasses import asdict, replace
from sgl_kernel import aot_check
from sgl_kernel.aot_targets import TARGETS
[norm] = [l for l in aot_check.capture(TARGETS["gfx950"], "_dsv4_rms_norm_kernel", ("flash",))
          if l.constexpr_names()["QUANT"]][:1]
names = list(norm.signature)
bad = replace(norm, constexprs={k: (3000 if names[k[0]] == "BLOCK_D" else v) for k, v in norm.constexprs.items()})
pdl = replace(norm, options={**norm.options, "launch_pdl": True})
rows = [aot_check.compile_launch(bad, "gfx950"), aot_check.compile_launch(pdl, "gfx950")]
over = replace(rows[1], shared=200 * 1024)
aot_check.check = lambda *a, **k: [rows[1]]
ok = aot_check.main(["--target", "gfx950"])
aot_check.check = lambda *a, **k: [over]
print(json.dumps({"rows": [asdict(r) for r in rows], "ok": ok, "over": aot_check.main(["--target", "gfx950"]),
                  "rounding": norm.constexpr_names()["ROUND_IN_FP32"]}))
"""


def test_check_reports_compile_errors_dropped_options_and_shared_memory_over_the_limit():
    """A launch the compiler rejects is a failed row with its error; a launch option the target lacks (launch_pdl
    on hip) is dropped with a note; the exit status is 0 only with every row compiled within shared memory. Also:
    the recorded launch carries the GPU's constexprs, not the CPU interpreter's rounding."""
    pytest.importorskip("triton.backends.amd")
    run = _run("-c", CHECKER, timeout=600)
    assert run.returncode == 0, run.stderr[-3000:]
    out = json.loads(run.stdout.strip().splitlines()[-1])
    bad, pdl = out["rows"]
    assert not bad["ok"] and ("power of 2" in bad["error"].lower() or "arange" in bad["error"].lower()), bad
    assert pdl["ok"] and "launch_pdl" in pdl["notes"] and pdl["regs"].count("/") == 2, pdl
    assert (out["ok"], out["over"], out["rounding"]) == (0, 1, False)


def test_summary_counts_rows_and_compile_seconds_per_target():
    from sgl_kernel.aot_check import Row, summary

    rows = [Row("gfx950", "k", "c", ok=True, spill=8, seconds=1.25), Row("gfx950", "k", "c", error="x", seconds=2.0),
            Row("sm90", "k", "c", ok=True, shared=300000, shared_limit=232448, seconds=0.5)]
    assert summary(rows) == ("gfx950: 2 configs, 1 compiled, 1 failed, 1 with spills, 0 over shared memory, 3 s "
                             "compiling; sm90: 1 configs, 1 compiled, 0 failed, 0 with spills, 1 over shared memory, "
                             "0 s compiling")


def _fake_plan(monkeypatch) -> list:
    """Three gfx950 launches (a decode, a prefill and a verify case) as planned(), compiles that record their
    kernels and find 8 VGPRs and, for the verify launch, 64 bytes of scratch."""
    from sgl_kernel import aot_check

    monkeypatch.delenv("TRITON_INTERPRET", raising=False)
    plan = [(aot_check.Launch("m", f"k{i}", {"x": "*bf16"}, {}, {}, {"num_warps": 4}, [f"flash T={t} bf16 case"]),
             "gfx950", f"key{i}") for i, t in enumerate((1, 8192, 4))]
    compiled = []

    def compile_all(work, jobs, cache_dir=None):
        compiled.extend(launch.name for launch, _ in work)
        return [aot_check._plan_row(launch, name, ok=True, regs="8/8/0", spill=64 if launch.name == "k2" else 0)
                for launch, name in work]

    monkeypatch.setattr(aot_check, "planned", lambda *args, **kwargs: plan)
    monkeypatch.setattr(aot_check, "compile_all", compile_all)
    return compiled


def test_manifest_holds_rows_and_a_sample_must_reproduce_them(monkeypatch, tmp_path):
    """--update-manifest compiles what the manifest lacks and keeps what it holds; --manifest takes held rows,
    compiles missing launches and the sample, names a sampled row the compiler no longer gives, counts gfx950
    decode-path scratch, and exits 1 on either."""
    import triton

    from sgl_kernel import aot_check
    from sgl_kernel.aot_manifest import Manifest

    compiled, path = _fake_plan(monkeypatch), str(tmp_path / "manifest.json")
    aot_check.update_manifest(path, ["gfx950"], 1)
    assert [r.source for r in aot_check.update_manifest(path, ["gfx950"], 1)] == ["manifest"] * 3
    assert compiled == ["k0", "k1", "k2"]  # the second refresh compiled nothing
    manifest = Manifest.load(path, triton.__version__)
    manifest.rows["key0"]["regs"] = "9/8/0"
    del manifest.rows["key1"]
    manifest.save(path)
    compiled.clear()
    rows, mismatches = aot_check.manifest_check(path, ["gfx950"], 1, sample=0, day=0)
    assert compiled == ["k1"] and [r.source for r in rows] == ["manifest", "compiled", "manifest"] and not mismatches
    assert [r.kernel for r in aot_check.decode_spills(rows)] == ["k2"] and rows[0].regs == "9/8/0"
    rows, mismatches = aot_check.manifest_check(path, ["gfx950"], 1, sample=2, day=0)
    assert [r.source for r in rows] == ["sample", "compiled", "sample"]
    assert mismatches == ["gfx950 k0 [flash T=1 bf16 case]: regs '9/8/0' -> '8/8/0'"]
    assert aot_check.main(["--target", "gfx950", "--manifest", path, "--sample", "0"]) == 1  # the decode scratch


def test_manifest_of_another_triton_is_refused(monkeypatch, tmp_path):
    import triton

    from sgl_kernel import aot_check
    from sgl_kernel.aot_manifest import Manifest, ManifestError

    _fake_plan(monkeypatch)
    path = str(tmp_path / "manifest.json")
    Manifest("0.0.1").save(path)
    with pytest.raises(ManifestError, match=f"Triton 0.0.1, this is Triton {triton.__version__}"):
        aot_check.manifest_check(path, ["gfx950"], 1, sample=0, day=0)
    assert aot_check.main(["--target", "gfx950", "--manifest", path]) == 2
    with pytest.raises(ManifestError, match="no AOT manifest"):
        Manifest.load(str(tmp_path / "none.json"), triton.__version__)


def test_rotating_sample_covers_every_key():
    from sgl_kernel.aot_manifest import rotating_sample

    keys = [f"{i:03d}" for i in range(100)]
    days = [rotating_sample(keys, 36, day) for day in range(3)]
    assert all(len(d) in (33, 34) for d in days) and sorted(sum(days, [])) == keys
    assert rotating_sample(keys, 0, 1) == [] and rotating_sample(keys, 500, 7) == keys
