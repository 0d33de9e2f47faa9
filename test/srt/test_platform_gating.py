"""ROCm / MI355X gating, proven on a CPU by simulating the platform (DESIGN section 6, docs/platforms.md).

ROCm is simulated with `platform.simulate_platform("hip", gfx=..., aiter=...)` or by monkeypatching the probes;
AITER by a stub `aiter` module in sys.modules whose functions record their calls.
"""

from __future__ import annotations

import ast
import logging
import os
import subprocess
import sys
import textwrap
import types

import pytest
import torch

from oracle import checkpoint, engine, greedy_run, max_abs_diff, random_ids
from sglang.srt import platform as plat
from sglang.srt.arg_groups.deepseek_v4_hook import resolve_server_args
from sglang.srt.environ import envs
from sglang.srt.layers import aiter_ops
from sglang.srt.layers.norm import RMSNorm, rms_normalize
from sglang.srt.server_args import ServerArgs

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
GFX = ("gfx950", "gfx942")  # MI355X, MI300X


@pytest.fixture(autouse=True)
def fresh_aiter_state():
    aiter_ops.reset()
    yield
    aiter_ops.reset()


def resolve(**kwargs) -> ServerArgs:
    return resolve_server_args(ServerArgs(model_path=checkpoint("tiny"), page_size=16, **kwargs))


def aiter_warnings(caplog) -> list:
    return [r for r in caplog.records if r.name == aiter_ops.__name__ and r.levelno == logging.WARNING]


class StubAiter(types.ModuleType):
    """`aiter` with a recording rmsnorm2d_fwd that returns the true norm + 1 (so a test sees its result used)."""

    def __init__(self):
        super().__init__("aiter")
        self.calls = []

    def rmsnorm2d_fwd(self, input, weight, epsilon, use_model_sensitive_rmsnorm=0):
        self.calls.append((input, weight, epsilon))
        xf = input.float()
        y = xf * torch.rsqrt(xf.square().mean(-1, keepdim=True) + epsilon) * weight.float()
        return (y + self.offset).to(input.dtype)

    offset = 1.0


@pytest.fixture
def stub_aiter(monkeypatch):
    stub = StubAiter()
    monkeypatch.setitem(sys.modules, "aiter", stub)
    return stub


# ---- probes -------------------------------------------------------------------------------------------------
def test_probes_off_rocm_and_simulated():
    assert plat.gfx_arch() is None and not plat.is_hip()
    assert plat.aiter_available() is False and "aiter" not in sys.modules  # not installed on this machine
    for gfx in GFX:
        with plat.simulate_platform("hip", gfx=gfx):
            assert plat.is_hip() and not plat.is_cuda() and not plat.is_cpu()
            assert plat.gfx_arch() == gfx and plat.platform_name() == "rocm" and not plat.aiter_available()
    with plat.simulate_platform("cuda"):
        assert plat.is_cuda() and plat.gfx_arch() is None
    assert plat.simulated() is None


def test_gfx_arch_reads_gcn_arch_name(monkeypatch):
    """The real probe (not the simulation): ROCm torch, a device reporting 'gfx942:sramecc+:xnack-'."""
    monkeypatch.setattr(torch.version, "hip", "6.4.0", raising=False)
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    monkeypatch.setattr(torch.cuda, "is_initialized", lambda: True)
    monkeypatch.setattr(torch.cuda, "get_device_properties",
                        lambda i: types.SimpleNamespace(gcnArchName="gfx942:sramecc+:xnack-"))
    plat._probe_gfx.cache_clear()
    try:
        assert plat.is_hip() and plat.gfx_arch() == "gfx942"
    finally:
        plat._probe_gfx.cache_clear()


def test_gfx_from_kfd_topology(tmp_path):
    """Before the process has a GPU context, the architecture comes from the driver's topology (CPU node 0)."""
    for node, version in (("0", 0), ("1", 90500), ("2", 90500)):
        (tmp_path / node).mkdir()
        (tmp_path / node / "properties").write_text(f"cpu_cores_count 8\ngfx_target_version {version}\n")
    assert plat.gfx_from_kfd(str(tmp_path)) == "gfx950"
    (tmp_path / "1" / "properties").write_text("gfx_target_version 90402\n")
    assert plat.gfx_from_kfd(str(tmp_path)) == "gfx942"
    (tmp_path / "1" / "properties").write_text("gfx_target_version 90010\n")
    assert plat.gfx_from_kfd(str(tmp_path)) == "gfx90a"
    assert plat.gfx_from_kfd(str(tmp_path / "missing")) is None


def test_probes_are_read_at_use_time():
    """No module evaluates a platform probe at import, and none binds one by name (monkeypatching
    `platform.is_hip` must reach every caller)."""
    probes = {"is_hip", "is_cuda", "is_cpu", "gfx_arch", "aiter_available", "platform_name", "has_library"}
    offenders = []
    for dirpath, _, files in os.walk(os.path.join(ROOT, "python", "sglang")):
        for name in files:
            if not name.endswith(".py") or name == "platform.py":
                continue
            path = os.path.join(dirpath, name)
            tree = ast.parse(open(path, encoding="utf-8").read())
            for node in ast.walk(tree):
                if isinstance(node, ast.ImportFrom) and node.module == "sglang.srt.platform":
                    offenders += [f"{name}: imports {a.name}" for a in node.names if a.name in probes]
            for stmt in tree.body:  # module level (function bodies run at use time)
                if isinstance(stmt, (ast.FunctionDef, ast.AsyncFunctionDef)):
                    continue
                for node in ast.walk(stmt):
                    if isinstance(node, ast.Call):
                        fn = node.func
                        called = fn.attr if isinstance(fn, ast.Attribute) else getattr(fn, "id", None)
                        if called in probes and not isinstance(stmt, ast.ClassDef):
                            offenders.append(f"{name}: calls {called} at import")
    assert not offenders, offenders


def test_importing_every_module_under_simulated_hip():
    script = textwrap.dedent("""
        import importlib, pkgutil, sys
        import torch
        torch.set_num_threads(1)
        from sglang.srt import platform
        with platform.simulate_platform("hip", gfx="gfx950", aiter=False):
            import sglang, sgl_kernel
            names = [m.name for pkg in (sglang, sgl_kernel)
                     for m in pkgutil.walk_packages(pkg.__path__, pkg.__name__ + ".")]
            for name in names:
                importlib.import_module(name)
        cuda_only = [m for m in sys.modules if any(s in m for s in ("flash_mla", "deep_gemm", "flashinfer"))]
        assert not cuda_only, cuda_only
        assert "aiter" not in sys.modules and not any(m.startswith("aiter.") for m in sys.modules)
        print("imported", len(names))
    """)
    env = {**os.environ, "TRITON_INTERPRET": "1"}
    out = subprocess.run([sys.executable, "-c", script], capture_output=True, text=True, timeout=240, env=env)
    assert out.returncode == 0, out.stderr[-3000:]
    assert int(out.stdout.split()[-1]) > 80


# ---- platform defaults --------------------------------------------------------------------------------------
@pytest.mark.parametrize("gfx", GFX)
def test_rocm_defaults(gfx, monkeypatch):
    with plat.simulate_platform("hip", gfx=gfx):
        args = resolve(device="cuda")
        d = args.platform_decisions
        assert (d.platform, d.gfx, d.attention_backend) == ("rocm", gfx, "triton") == \
            ("rocm", gfx, args.attention_backend)
        assert d.shared_experts_fusion is True and d.aiter == "missing"
        assert f"platform=rocm {gfx}, aiter missing" in args.applied_defaults
        # Triton missing: the torch reference, never a CUDA-only kernel.
        monkeypatch.setattr(plat, "has_library", lambda name: name != "triton")
        assert resolve(device="cuda").attention_backend == "torch"
        assert resolve(device="cuda", attention_backend="dsv4").attention_backend == "torch"


def test_cuda_and_cpu_defaults():
    with plat.simulate_platform("cuda"):
        d = resolve(device="cuda").platform_decisions
        assert (d.platform, d.attention_backend, d.shared_experts_fusion, d.aiter) == \
            ("cuda", "triton", False, "n/a")
    d = resolve(device="cpu").platform_decisions
    assert (d.platform, d.attention_backend, d.shared_experts_fusion) == ("cpu", "torch", False)


def test_torch_backend_on_a_gpu_runs_without_graphs(monkeypatch):
    """The torch reference backend syncs with the host (boolean-mask indexing), so capturing it fails: on a GPU it
    turns the CUDA graphs off, chosen explicitly or where Triton is missing; on CPU nothing is captured anyway."""
    note = "disable_cuda_graph=True (the torch attention backend is not capturable)"
    with plat.simulate_platform("cuda"):
        args = resolve(device="cuda")
        assert args.attention_backend == "triton" and not args.disable_cuda_graph and args.cuda_graph_bs
        args = resolve(device="cuda", attention_backend="torch")
        assert args.disable_cuda_graph and args.cuda_graph_bs is None and note in args.applied_defaults
        monkeypatch.setattr(plat, "has_library", lambda name: name != "triton")
        args = resolve(device="cuda")
        assert args.attention_backend == "torch" and args.disable_cuda_graph and note in args.applied_defaults
    assert note not in resolve(device="cpu").applied_defaults


def test_env_overrides_win():
    with plat.simulate_platform("hip", gfx="gfx950"):
        with envs.SGLANG_HACK_FLASHMLA_BACKEND.override("torch"):
            assert resolve(device="cuda").attention_backend == "torch"
            assert resolve(device="cuda", attention_backend="triton").attention_backend == "triton"  # flag wins
        with envs.SGLANG_HACK_FLASHMLA_BACKEND.override("unified_kv_triton"):  # the AMD recipes' value
            assert resolve(device="cuda").attention_backend == "triton"
        with envs.SGLANG_HACK_FLASHMLA_BACKEND.override("kernel"), pytest.raises(ValueError, match="auto"):
            resolve(device="cuda")


def test_upstream_sparse_prefill_switch_changes_nothing_and_says_so(caplog):
    """Upstream's SGLANG_OPT_FLASHMLA_SPARSE_PREFILL picks a FlashMLA kernel this engine does not have (prefill and
    decode run one sparse kernel): set, it is logged at start as changing nothing, and the resolved arguments and
    start-up summary are those without it; a value that is not a boolean is an error naming it."""
    caplog.set_level(logging.WARNING, logger="sglang.srt.server_args")
    for where, device in (("cuda", "cuda"), ("hip", "cuda"), ("cuda", "cpu")):
        with plat.simulate_platform(where):
            want = resolve(device=device)
            assert "SGLANG_OPT_FLASHMLA_SPARSE_PREFILL" not in caplog.text
            assert not any("sparse" in line for line in want.applied_defaults)
            for value in ("1", "0"):
                with envs.SGLANG_OPT_FLASHMLA_SPARSE_PREFILL.override(value):
                    got = resolve(device=device)
                assert (got.platform_decisions, got.applied_defaults) == (want.platform_decisions,
                                                                           want.applied_defaults)
                assert "SGLANG_OPT_FLASHMLA_SPARSE_PREFILL: accepted from upstream's recipes; change nothing" \
                    in caplog.text
                caplog.clear()
    with envs.SGLANG_OPT_FLASHMLA_SPARSE_PREFILL.override("sometimes"), pytest.raises(
            ValueError, match="SGLANG_OPT_FLASHMLA_SPARSE_PREFILL"):
        resolve(device="cpu")


def test_shared_experts_fusion_flags():
    with pytest.raises(ValueError, match="mutually exclusive"):
        resolve(device="cpu", enforce_shared_experts_fusion=True, disable_shared_experts_fusion=True)
    from sglang.launch_server import main

    with pytest.raises(SystemExit):  # argparse's error exit, before any server starts
        main(["--model-path", checkpoint("tiny"), "--enforce-shared-experts-fusion",
              "--disable-shared-experts-fusion"])
    assert resolve(device="cpu", enforce_shared_experts_fusion=True).platform_decisions.shared_experts_fusion
    with plat.simulate_platform("hip", gfx="gfx942"):  # the MI300X recipe disables it
        d = resolve(device="cuda", disable_shared_experts_fusion=True).platform_decisions
        assert d.shared_experts_fusion is False


def test_fp4_indexer_logits_budget():
    with plat.simulate_platform("hip", gfx="gfx950"), envs.SGLANG_DSV4_FP4_LOGITS_BUDGET_MB.override(64):
        d = resolve(device="cuda", enable_deepseek_v4_fp4_indexer=True).platform_decisions
        assert (d.index_logits_budget_mb, d.index_logits_budget_var) == (64, "SGLANG_DSV4_FP4_LOGITS_BUDGET_MB")
        d = resolve(device="cuda", kv_cache_dtype="fp8_e4m3").platform_decisions
        assert (d.index_logits_budget_mb, d.index_logits_budget_var) == (512, "SGLANG_DSV4_INDEXER_LOGITS_BUDGET_MB")
    with envs.SGLANG_DSV4_FP4_LOGITS_BUDGET_MB.override(64):  # the engine's workspace uses the same budget
        eng = engine("tiny", enable_deepseek_v4_fp4_indexer=True, max_total_tokens=1024)
        try:
            assert eng.model_runner.attn_backend.logits_workspace.budget_bytes == 64 << 20
        finally:
            eng.shutdown()


# ---- AITER dispatch -----------------------------------------------------------------------------------------
def reference_norms(x, weight, eps=1e-6):
    norm = RMSNorm(x.shape[-1], eps)
    with torch.no_grad():
        norm.weight.copy_(weight)
    return norm(x), rms_normalize(x, eps)


def test_aiter_absent_falls_back_with_one_warning(caplog):
    x, w = torch.randn(5, 64), torch.randn(64)
    want_norm, want_plain = reference_norms(x, w)
    caplog.set_level(logging.WARNING)
    with plat.simulate_platform("hip", gfx="gfx950", aiter=False):
        assert resolve(device="cuda").platform_decisions.aiter == "missing"
        for _ in range(3):
            got_norm, got_plain = reference_norms(x, w)
            assert torch.equal(got_norm, want_norm) and torch.equal(got_plain, want_plain)
    assert len(aiter_warnings(caplog)) == 1
    assert "aiter" not in sys.modules


def test_aiter_import_failure_falls_back(caplog, monkeypatch):
    monkeypatch.setitem(sys.modules, "aiter", None)  # importable per find_spec, but `import aiter` fails
    monkeypatch.setattr(plat, "aiter_available", lambda: True)
    monkeypatch.setattr(plat, "is_hip", lambda: True)
    monkeypatch.setattr(plat, "is_device_tensor", lambda t: True)
    x, w = torch.randn(3, 32), torch.randn(32)
    with caplog.at_level(logging.WARNING):
        assert torch.equal(reference_norms(x, w)[0], reference_norms(x, w)[0])
    assert len(aiter_warnings(caplog)) == 1 and "import aiter failed" in aiter_warnings(caplog)[0].getMessage()


def test_aiter_present_dispatch(stub_aiter):
    torch.manual_seed(0)  # the draws are the test's own, whatever earlier tests left in the global generator
    x32, w = torch.randn(4, 3, 64), torch.randn(64)
    want_norm, want_plain = reference_norms(x32, w)
    with plat.simulate_platform("hip", gfx="gfx950", aiter=True):
        assert resolve(device="cuda").platform_decisions.aiter == "on"
        norm = RMSNorm(64, 1e-6)
        with torch.no_grad():
            norm.weight.copy_(w)
        out = norm(x32)  # fp32 x, fp32 weight: passed through as they are
        x_in, w_in, eps = stub_aiter.calls[-1]
        assert torch.equal(x_in, x32.view(12, 64)) and w_in is norm.weight and eps == 1e-6
        assert torch.allclose(out, want_norm + 1)  # AITER's result is the one returned
        plain = rms_normalize(x32, 1e-6)  # unweighted: a ones weight in x's dtype
        x_in, w_in, _ = stub_aiter.calls[-1]
        assert torch.equal(x_in, x32.view(12, 64)) and w_in.dtype == x32.dtype and torch.equal(w_in, torch.ones(64))
        assert torch.allclose(plain, want_plain + 1)
        xb = x32.bfloat16()  # bf16 x, fp32 weight not exact in bf16: AITER in fp32 (weight not rounded)
        out = norm(xb)
        x_in, w_in, _ = stub_aiter.calls[-1]
        assert x_in.dtype == w_in.dtype == torch.float32 and torch.equal(x_in.view(xb.shape), xb.float())
        assert out.dtype == torch.bfloat16 and out.shape == xb.shape
        exact = RMSNorm(64, 1e-6)  # fp32 weight holding bf16 values (a bf16 checkpoint): passed as bf16
        with torch.no_grad():
            exact.weight.copy_(w.bfloat16().float())
        out = exact(xb)
        x_in, w_in, _ = stub_aiter.calls[-1]
        assert x_in.dtype == w_in.dtype == torch.bfloat16 and torch.equal(w_in.float(), exact.weight)
        assert x_in.shape == (12, 64) and out.shape == xb.shape
        xf = xb.float()  # (computed here: a reference through RMSNorm would itself dispatch to the stub)
        ref = xf * torch.rsqrt(xf.square().mean(-1, keepdim=True) + 1e-6) * exact.weight
        assert torch.allclose(out.float(), ref + 1, rtol=1e-2, atol=2e-2)  # bf16 output: relative rounding
        joined = torch.randn(5, 96)  # a split view of a joined projection's output: rows 96 apart
        out = norm(joined[:, :64])
        x_in, _, _ = stub_aiter.calls[-1]
        assert x_in.is_contiguous() and torch.equal(x_in, joined[:, :64])
        xj = joined[:, :64]
        assert torch.allclose(out, xj * torch.rsqrt(xj.square().mean(-1, keepdim=True) + 1e-6) * w + 1)
        calls = len(stub_aiter.calls)
        with envs.SGLANG_USE_AITER.override("0"):  # the override wins
            assert resolve(device="cuda").platform_decisions.aiter == "off (SGLANG_USE_AITER=0)"
            assert torch.equal(norm(x32), want_norm)
        assert len(stub_aiter.calls) == calls
    with plat.simulate_platform("cuda", aiter=True):  # AITER is ROCm-only
        assert torch.equal(norm(x32), want_norm) and len(stub_aiter.calls) == calls
    assert torch.equal(norm(x32), want_norm) and len(stub_aiter.calls) == calls  # CPU


def test_aiter_through_the_engine(stub_aiter):
    """Every RMSNorm of the model goes through AITER under simulated ROCm; with an exact stub, same tokens (two: the
    prefill's and one decode step's, each later step the same launches)."""
    ids = random_ids(20, 11)
    eng = engine("tiny", chunked_prefill_size=-1)
    try:
        want = greedy_run(eng, ids, 2)
        stub_aiter.offset = 0.0
        with plat.simulate_platform("hip", gfx="gfx950", aiter=True):
            got = greedy_run(eng, ids, 2)
        assert len(stub_aiter.calls) > 0 and got["output_ids"] == want["output_ids"]
        lps = [lp for lp, _, _ in got["meta_info"]["output_token_logprobs"]]
        assert max_abs_diff(lps, [lp for lp, _, _ in want["meta_info"]["output_token_logprobs"]]) <= 1e-4
    finally:
        eng.shutdown()


def test_aiter_table_and_docs():
    table = open(os.path.join(ROOT, "docs", "platforms.md"), encoding="utf-8").read()
    for op in aiter_ops.AITER_OPS:
        assert op.used or op.reason.startswith("AITER not used"), op
    for var in ("SGLANG_USE_AITER", "SGLANG_HACK_FLASHMLA_BACKEND", "SGLANG_OPT_FLASHMLA_SPARSE_PREFILL",
                "SGLANG_DSV4_FP4_LOGITS_BUDGET_MB", "--enforce-shared-experts-fusion", "gfx950", "gfx942"):
        assert var in table, var
    assert "docs/platforms.md" in open(os.path.join(ROOT, "README.md"), encoding="utf-8").read()


# ---- shared-experts fusion ----------------------------------------------------------------------------------
def test_fused_moe_layer_is_exact():
    from sglang.srt.configs.deepseek_v4 import DeepseekV4Config
    from sglang.srt.models.deepseek_v4 import MoE

    config = DeepseekV4Config.from_pretrained(checkpoint("tiny"))
    for layer_id in (0, 2):  # hash-routed, score-routed
        torch.manual_seed(layer_id)
        moe = MoE(config, layer_id)
        with torch.no_grad():
            for p in moe.parameters():
                p.normal_(0, 0.2)
            if moe.gate.use_hash:
                moe.gate.tid2eid.copy_(torch.randint(0, config.n_routed_experts, moe.gate.tid2eid.shape))
        x, ids = torch.randn(9, config.hidden_size) * 4, torch.randint(0, config.vocab_size, (9,))
        gate_pre = moe.shared_experts.w1(x)
        assert gate_pre.max() > config.swiglu_limit  # the clamp is exercised
        want = moe(x, ids)
        moe.fuse_shared_experts()
        assert moe.shared_experts is None and moe.experts.w1.shape[0] == config.n_routed_experts + 1
        assert torch.equal(moe(x, ids), want)


def test_fused_vs_unfused_engine():
    """The tiny model through the Engine (with the MTP draft, also fused): identical tokens, logprobs within
    1e-6 in fp32."""
    ids, outs = random_ids(40, 12), {}
    for flag in ("disable", "enforce"):
        eng = engine("tiny", chunked_prefill_size=-1, speculative_algorithm="EAGLE",
                     **{f"{flag}_shared_experts_fusion": True})
        try:
            runner = eng.model_runner
            fused = [m.shared_experts is None for model in (runner.model, runner.draft_model)
                     for m in model.modules() if type(m).__name__ == "MoE"]
            assert len(fused) == 5 and all(f == (flag == "enforce") for f in fused)
            outs[flag] = greedy_run(eng, ids, 6)
        finally:
            eng.shutdown()
    a, b = outs["disable"], outs["enforce"]
    assert a["output_ids"] == b["output_ids"]
    for key in ("input_token_logprobs", "output_token_logprobs"):
        la = [lp for lp, _, _ in a["meta_info"][key] if lp is not None]
        lb = [lp for lp, _, _ in b["meta_info"][key] if lp is not None]
        assert max_abs_diff(la, lb) <= 1e-6
