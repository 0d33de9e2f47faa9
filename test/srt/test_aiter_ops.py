"""AITER's mHC and router ops behind layers/aiter_ops.py, proven on a CPU against a simulated `aiter`.

The fake module checks each call against the signature, dtypes, shapes and contiguity that ROCm/aiter documents
and validates (aiter/ops/mhc.py + csrc/kernels/mhc_kernels.cu, aiter/ops/topk.py + csrc/kernels/
topk_gating_kernels.cu) and returns the function AITER documents, computed in torch as its own references state
it (op_tests/test_mhc.py, op_tests/test_moe_topk_gating.py): not by calling our code. Each engine result is then
compared with our path on the same tensors. Tolerances: mixing weights (post, comb, router weights) fp32
summation order, 1e-5; u and the new streams one bf16 rounding each side, so at most one bf16 ulp apart.
"""

from __future__ import annotations

import os
import sys
import types

import pytest
import torch
import torch.nn.functional as F

from sglang.srt import platform as plat
from sglang.srt.environ import envs
from sglang.srt.layers import aiter_ops, mhc
from sglang.srt.layers.moe.router import FUSED_MAX_ROWS, Gate
from sglang.srt.layers.norm import RMSNorm

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
N, ITERS, HC_EPS, NORM_EPS = 4, 20, 1e-6, 1e-6
BF16_ULP = 2.0 ** -7  # relative spacing of bf16 values


class FakeAiter(types.ModuleType):
    """`aiter` with the documented mhc_pre / mhc_post / topk_gating / rmsnorm2d_fwd; records each call's name."""

    def __init__(self):
        super().__init__("aiter")
        self.calls = []

    def mhc_pre(self, residual, fn, hc_scale, hc_base, rms_eps=1e-6, hc_pre_eps=1e-6, hc_sinkhorn_eps=1e-6,
                hc_post_mult_value=1.0, sinkhorn_repeat=20, norm_weight=None, norm_eps=1e-6, large_m_splitk=False,
                is_fn_pack_bf16=0):
        m, n, d = residual.shape
        head = sinkhorn_repeat == 0
        rows = n if head else 2 * n + n * n
        assert residual.dtype == torch.bfloat16 and residual.is_contiguous() and n == 4  # "hc_mult only supports 4"
        assert d % 256 == 0 and d >= 512  # residual_block divides hidden, two prefetch stages
        assert fn.dtype == torch.float32 and fn.shape == (rows, n * d) and fn.is_contiguous()
        assert hc_scale.dtype == hc_base.dtype == torch.float32 and hc_base.shape == (rows,)
        assert hc_scale.numel() >= 1 if head else hc_scale.shape == (3,)
        if norm_weight is not None:
            assert norm_weight.dtype == torch.bfloat16 and norm_weight.shape == (d,) and d in (7168, 4096, 2560, 1280)
        self.calls.append("mhc_pre" + ("(head)" if head else "") + ("+norm" if norm_weight is not None else ""))
        flat = residual.flatten(1).float()
        mixes = (flat @ fn.t()) * torch.rsqrt(flat.square().sum(-1, keepdim=True) / (n * d) + rms_eps)
        pre = torch.sigmoid(mixes[:, :n] * hc_scale[0] + hc_base[:n]) + hc_pre_eps
        post = comb = torch.empty(0)
        if not head:
            post = (torch.sigmoid(mixes[:, n:2 * n] * hc_scale[1] + hc_base[n:2 * n]) * hc_post_mult_value)
            c = (mixes[:, 2 * n:] * hc_scale[2] + hc_base[2 * n:]).view(m, n, n).softmax(-1) + hc_sinkhorn_eps
            c = c / (c.sum(-2, keepdim=True) + hc_sinkhorn_eps)
            for _ in range(sinkhorn_repeat - 1):
                c = c / (c.sum(-1, keepdim=True) + hc_sinkhorn_eps)
                c = c / (c.sum(-2, keepdim=True) + hc_sinkhorn_eps)
            post, comb = post.unsqueeze(-1), c
        layer_input = (residual.float() * pre.unsqueeze(-1)).sum(1).bfloat16()
        if norm_weight is not None:  # the kernel keeps u in bf16 (shared memory in the input type), then normalises
            u = layer_input.float()
            layer_input = (u * torch.rsqrt(u.square().mean(-1, keepdim=True) + norm_eps) * norm_weight.float())
            layer_input = layer_input.bfloat16()
        return post, comb, layer_input

    def mhc_post(self, out, x, residual, post_layer_mix, comb_res_mix, store_nt=-1):
        m, n, d = residual.shape
        assert residual.dtype == x.dtype == out.dtype == torch.bfloat16 and n == 4 and d % 256 == 0
        assert out.shape == residual.shape and out.is_contiguous() and residual.is_contiguous()
        assert x.shape == (m, d) and x.stride(-1) == 1
        assert post_layer_mix.dtype == comb_res_mix.dtype == torch.float32
        assert post_layer_mix.shape == (m, n) and post_layer_mix.is_contiguous()
        assert comb_res_mix.shape == (m, n, n) and comb_res_mix.is_contiguous()
        self.calls.append("mhc_post")
        mixed = torch.einsum("mjk,mjd->mkd", comb_res_mix, residual.float())
        out.copy_((post_layer_mix.unsqueeze(-1) * x.float().unsqueeze(1) + mixed).to(out.dtype))

    def topk_gating(self, topk_weights, topk_indices, gating_output, correction_bias=None, need_renorm=True,
                    routed_scaling_factor=1.0, score_func="sqrtsoftplus"):
        t, k = topk_indices.shape
        assert score_func in ("sqrtsoftplus", "sigmoid", "softmax")
        assert topk_weights.dtype == torch.float32 and topk_indices.dtype == torch.int32
        assert topk_weights.shape == (t, k) and topk_weights.is_contiguous() and topk_indices.is_contiguous()
        assert gating_output.dim() == 2 and gating_output.shape[0] == t and gating_output.is_contiguous()
        assert gating_output.dtype in (torch.float32, torch.float16, torch.bfloat16)
        assert correction_bias is None or (correction_bias.dtype in (torch.float32, torch.bfloat16)
                                           and correction_bias.shape == (gating_output.shape[1],))
        assert k <= 64 and k <= gating_output.shape[1]
        self.calls.append("topk_gating:" + score_func)
        scores = F.softplus(gating_output.float()).sqrt()
        ids = torch.topk(scores + (0 if correction_bias is None else correction_bias.float()), k, dim=-1).indices
        picked = scores.gather(1, ids)
        scale = routed_scaling_factor / picked.sum(-1, keepdim=True).clamp(min=1e-20) if need_renorm else \
            routed_scaling_factor
        topk_weights.copy_(picked * scale)
        topk_indices.copy_(ids.int())

    def rmsnorm2d_fwd(self, input, weight, epsilon, use_model_sensitive_rmsnorm=0):
        assert weight.dtype == input.dtype and input.dim() == 2
        self.calls.append("rmsnorm2d_fwd")
        xf = input.float()
        return (xf * torch.rsqrt(xf.square().mean(-1, keepdim=True) + epsilon) * weight.float()).to(input.dtype)


@pytest.fixture
def fake(monkeypatch):
    aiter_ops.reset()
    module = FakeAiter()
    monkeypatch.setitem(sys.modules, "aiter", module)
    yield module
    aiter_ops.reset()


def mhc_inputs(tokens: int, width: int, seed: int = 0) -> tuple:
    g = torch.Generator().manual_seed(seed)
    streams = torch.randn(tokens, N, width, generator=g).bfloat16()
    fn = torch.randn(2 * N + N * N, N * width, generator=g) * 0.02
    scale, base = torch.rand(3, generator=g) + 0.5, torch.randn(2 * N + N * N, generator=g) * 0.1
    return streams, fn, scale, base


def close_bf16(a: torch.Tensor, b: torch.Tensor) -> bool:
    """Within one bf16 rounding of each other (relative to the larger magnitude, or an absolute floor)."""
    a, b = a.float(), b.float()
    return bool(((a - b).abs() <= BF16_ULP * torch.maximum(a.abs(), b.abs()) + 1e-3).all())


def test_mhc_pre_post_head_through_aiter(fake):
    """hc_pre / hc_post / hc_head call AITER at V4's widths and give our path's result; our path elsewhere."""
    streams, fn, scale, base = mhc_inputs(3, 2048)
    want_u, want_post, want_comb = mhc.hc_pre_ref(streams, fn, scale, base, ITERS, HC_EPS, NORM_EPS)
    out = torch.randn(3, 2048).bfloat16()
    # our GPU kernel's hc_post (fp32 math, one rounding); the bf16 torch path rounds comb / post first (mhc.py)
    want_new = mhc.hc_post_ref(out.float(), streams.float(), want_post, want_comb).bfloat16()
    head_fn, head_base, head_scale = fn[:N].contiguous(), base[:N].contiguous(), scale[:1].contiguous()
    want_head = mhc.hc_head_ref(streams, head_fn, head_scale, head_base, HC_EPS, NORM_EPS)
    with plat.simulate_platform("hip", gfx="gfx950", aiter=True):
        u, post, comb = mhc.hc_pre(streams, fn, scale, base, ITERS, HC_EPS, NORM_EPS)
        new = mhc.hc_post(out, streams, post, comb)
        head = mhc.hc_head(streams, head_fn, head_scale, head_base, HC_EPS, NORM_EPS)
    assert fake.calls == ["mhc_pre", "mhc_post", "mhc_pre(head)"]
    assert post.shape == want_post.shape and post.dtype == torch.float32
    assert torch.allclose(post, want_post, atol=1e-5) and torch.allclose(comb, want_comb, atol=1e-5)
    assert u.dtype == torch.bfloat16 and close_bf16(u, want_u)
    assert new.shape == streams.shape and close_bf16(new, want_new)
    assert head.shape == (3, 2048) and close_bf16(head, want_head)
    # outside what AITER's kernels take (fp32 streams, a narrow width, hc_mult 2, no rows): ours, AITER not called
    with plat.simulate_platform("hip", gfx="gfx950", aiter=True):
        for s, f in ((streams.float(), fn), (streams[..., :1024].contiguous(), fn[:, :4096]),
                     (streams[:, :2].contiguous(), fn), (streams[:0], fn)):
            assert not aiter_ops.use_aiter_mhc(s, f)
        assert not aiter_ops.use_aiter_mhc(streams, fn.bfloat16())
    assert fake.calls == ["mhc_pre", "mhc_post", "mhc_pre(head)"]


@pytest.mark.parametrize("width, calls", [(2560, ["mhc_pre+norm"]), (2048, ["mhc_pre", "rmsnorm2d_fwd"])])
def test_mhc_pre_norm_through_aiter(fake, width, calls):
    """hc_pre_norm folds the RMSNorm into AITER's mhc_pre at the widths its fused kernel is built for, else AITER's
    mhc_pre then the norm; the same result as hc_pre then our norm."""
    streams, fn, scale, base = mhc_inputs(2, width, seed=1)
    norm = RMSNorm(width, 1e-6)
    with torch.no_grad():  # fp32 weights holding bf16 values, as a bf16 checkpoint loads them
        norm.weight.copy_((torch.rand(width) + 0.5).bfloat16().float())
    u, want_post, want_comb = mhc.hc_pre_ref(streams, fn, scale, base, ITERS, HC_EPS, NORM_EPS)
    want = norm(u)  # CPU: our torch norm
    with plat.simulate_platform("hip", gfx="gfx950", aiter=True):
        y, x_in, post, comb = mhc.hc_pre_norm(streams, fn, scale, base, ITERS, HC_EPS, NORM_EPS, norm, None)
    assert fake.calls == calls and x_in is y and y.dtype == torch.bfloat16
    assert torch.allclose(post, want_post, atol=1e-5) and torch.allclose(comb, want_comb, atol=1e-5)
    assert close_bf16(y, want)


def test_mhc_ours_without_aiter_or_switched_off(fake):
    streams, fn, scale, base = mhc_inputs(2, 2048, seed=2)
    want = mhc.hc_pre_ref(streams, fn, scale, base, ITERS, HC_EPS, NORM_EPS)
    with plat.simulate_platform("hip", gfx="gfx950", aiter=False):  # not installed
        got = mhc.hc_pre(streams, fn, scale, base, ITERS, HC_EPS, NORM_EPS)
    with plat.simulate_platform("hip", gfx="gfx950", aiter=True), envs.SGLANG_USE_AITER.override("0"):
        off = mhc.hc_pre(streams, fn, scale, base, ITERS, HC_EPS, NORM_EPS)
    with plat.simulate_platform("cuda", aiter=True):  # AITER is ROCm-only
        cuda = mhc.hc_pre(streams, fn, scale, base, ITERS, HC_EPS, NORM_EPS)
    assert fake.calls == []
    for result in (got, off, cuda):
        assert all(torch.equal(a, b) for a, b in zip(result, want))


def gate(experts: int = 16, top_k: int = 4, seed: int = 3) -> Gate:
    torch.manual_seed(seed)
    g = Gate(64, experts, top_k, vocab_size=32, routed_scaling_factor=1.5, use_hash=False)
    with torch.no_grad():
        g.weight.normal_(0, 0.2)
        g.bias.normal_(0, 0.1)
    return g


def test_router_selection_through_aiter(fake):
    """Score layers above the one-launch router's rows select through topk_gating (sqrtsoftplus): the same experts
    (random logits: no near-ties) and weights as ours; expert-parallel remapping applies to its ids."""
    g, x = gate(), torch.randn(FUSED_MAX_ROWS + 8, 64)
    ids_in = torch.zeros(x.shape[0], dtype=torch.long)
    want_w, want_ids = g.route(x, ids_in, local_experts=range(4, 12), shared_expert_id=8)  # CPU: ours
    with plat.simulate_platform("hip", gfx="gfx950", aiter=True):
        got_w, got_ids = g.route(x, ids_in, local_experts=range(4, 12), shared_expert_id=8)
    assert fake.calls == ["topk_gating:sqrtsoftplus"]
    assert got_ids.dtype == torch.int64 and torch.equal(got_ids, want_ids)
    assert torch.allclose(got_w, want_w, rtol=1e-5, atol=1e-6)
    with plat.simulate_platform("hip", gfx="gfx950", aiter=True), envs.SGLANG_USE_AITER.override("0"):
        assert all(torch.equal(a, b) for a, b in zip(g.route(x, ids_in, range(4, 12), 8), (want_w, want_ids)))
    with plat.simulate_platform("hip", gfx="gfx950", aiter=True):
        assert not aiter_ops.use_aiter_router(x, 16, 65) and not aiter_ops.use_aiter_router(x, 3, 4)
    assert fake.calls == ["topk_gating:sqrtsoftplus"]


def test_older_aiter_without_the_op_runs_ours(monkeypatch):
    """An AITER release without mhc_pre / topk_gating (only rmsnorm2d_fwd): ours, and the start-up line says so."""
    aiter_ops.reset()
    old = types.ModuleType("aiter")
    old.rmsnorm2d_fwd = FakeAiter().rmsnorm2d_fwd
    monkeypatch.setitem(sys.modules, "aiter", old)
    streams, fn, _, _ = mhc_inputs(1, 2048)
    try:
        with plat.simulate_platform("hip", gfx="gfx950", aiter=True):
            assert not aiter_ops.use_aiter_mhc(streams, fn) and not aiter_ops.use_aiter_router(streams, 16, 4)
            assert aiter_ops.startup_line().startswith("aiter_ops=AITER: rms_norm; ours: mhc_pre, mhc_post")
    finally:
        aiter_ops.reset()


def test_startup_line_lists_the_choices(fake):
    from sglang.srt.arg_groups.deepseek_v4_hook import resolve_server_args
    from sglang.srt.server_args import ServerArgs

    from oracle import checkpoint

    def applied(**platform) -> list:
        with plat.simulate_platform("hip", gfx="gfx950", **platform):
            return resolve_server_args(ServerArgs(model_path=checkpoint("tiny"), page_size=16,
                                                  device="cuda")).applied_defaults

    on = [op.name for op in aiter_ops.AITER_OPS if op.used]
    assert on == ["rms_norm", "mhc_pre", "mhc_post", "mhc_head", "router_topk", "moe_experts"]
    # this fake has no aiter.fused_moe (test_aiter_moe.py's has): the MoE stays ours
    ours = [op.name for op in aiter_ops.AITER_OPS if op.name not in on[:-1]]
    line = f"aiter_ops=AITER: {', '.join(on[:-1])}; ours: {', '.join(ours)}"
    assert line in applied(aiter=True)
    aiter_ops.reset()
    assert "aiter_ops=none (ours for every op)" in applied(aiter=False)
    with plat.simulate_platform("cuda"):
        args = resolve_server_args(ServerArgs(model_path=checkpoint("tiny"), page_size=16, device="cuda"))
    assert not any(line.startswith("aiter_ops=") for line in args.applied_defaults)


def test_docs_table_mirrors_aiter_ops():
    """docs/platforms.md's AITER table has one row per AITER_OPS entry, saying used or not as the code does."""
    text = open(os.path.join(ROOT, "docs", "platforms.md"), encoding="utf-8").read()
    rows = {line.split("|")[1].strip().strip("`"): line for line in text.splitlines()
            if line.startswith("| `") and line.count("|") >= 5}
    for op in aiter_ops.AITER_OPS:
        assert op.name in rows, op.name
        assert ("| yes |" in rows[op.name]) == op.used, rows[op.name]
