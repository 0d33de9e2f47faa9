"""AITER's fused MoE for the MXFP4 experts (layers/moe/aiter_moe.py), proven on a CPU against a simulated `aiter`.

The fake `aiter.fused_moe.fused_moe` checks the call against what ROCm/aiter documents for its A8W4 MXFP4 path
(aiter/fused_moe.py; op_tests/test_moe_2stage.py: w1 [E, 2I, D/2] gate rows then up rows, fp4x2, `is_shuffled`;
scales e8m0 [E * rows, groups]; int32 ids, fp32 weights; Silu, per_1x32, swiglu_limit, gate_mode "interleave"),
undoes the pre-shuffle as aiter/ops/shuffle.py writes it (its view / permute, applied here to an index tensor) and
computes the clamped-SwiGLU MoE in fp32 (torch_moe_stage1 / stage2's function, activations unquantized). Our result
through it must equal sgl_kernel's reference on the checkpoint's layout, so a wrong conversion or call fails. Takes
about 2 s.
"""

from __future__ import annotations

import inspect
import sys
import types

import pytest
import torch
import torch.nn.functional as F

from sglang.srt import platform as plat
from sglang.srt.environ import envs
from sglang.srt.layers import aiter_ops
from sglang.srt.layers.moe.experts import log_moe_paths
from sglang.srt.layers.quantization.mxfp4 import Mxfp4RoutedExperts, serve_experts_with_aiter

from sgl_kernel.dsv4_moe_ref import dequant_mxfp4_ref, fused_moe_mxfp4_ref

FP4X2 = getattr(torch, "float4_e2m1fn_x2", torch.uint8)
E8M0 = getattr(torch, "float8_e8m0fnu", torch.uint8)
E, D, I, K, LIMIT = 4, 256, 256, 2, 7.0


def aiter_codes_order(e: int, n: int, kb: int, gate_up: bool) -> torch.Tensor:
    """shuffle_weight(x [e, n, kb], layout=(16, 16), is_guinterleave=True, gate_up) on byte indices."""
    x = torch.arange(e * n * kb).view(e, n, kb)
    n0, k0 = (n // 2 if gate_up else n) // 16, kb // 64
    if gate_up:
        return x.view(e, 2, n0, 16, k0, 4, 16).permute(0, 2, 1, 4, 5, 3, 6).reshape(-1)
    return x.view(e, n0, 16, k0, 4, 16).permute(0, 1, 3, 4, 2, 5).reshape(-1)


def aiter_scale_order(e: int, rows: int, groups: int, gate_up: bool) -> torch.Tensor:
    """shuffle_scale(src [e * rows, groups], experts_cnt=e, is_guinterleave=True, gate_up) on byte indices."""
    x = torch.arange(e * rows * groups)
    k1, n1 = groups // 8, rows // 32
    if gate_up:
        return x.view(e, 2, n1, 16, k1, 2, 4).permute(0, 2, 4, 6, 3, 5, 1).reshape(-1)
    return x.view(e, n1, 2, 16, k1, 2, 4).permute(0, 1, 4, 6, 3, 5, 2).reshape(-1)


def unshuffle(stored: torch.Tensor, order: torch.Tensor, shape: tuple) -> torch.Tensor:
    flat = torch.empty(order.numel(), dtype=torch.uint8)
    flat[order] = stored.reshape(-1).view(torch.uint8)
    return flat.view(shape)


class FakeFusedMoe(types.ModuleType):
    def __init__(self, calls: list, with_clamp: bool = True):
        super().__init__("aiter.fused_moe")
        self.calls = calls
        if with_clamp:
            self.fused_moe = self._fused_moe
        else:  # an older release: no swiglu_limit / gate_mode
            def fused_moe(hidden_states, w1, w2, topk_weight, topk_ids, expert_mask=None, activation=None,
                          quant_type=None, w1_scale=None, w2_scale=None):
                raise AssertionError("called an AITER without the clamp")
            self.fused_moe = fused_moe

    def _fused_moe(self, hidden_states, w1, w2, topk_weight, topk_ids, expert_mask=None, activation="silu",
                   quant_type="no", doweight_stage1=False, w1_scale=None, w2_scale=None, a1_scale=None,
                   a2_scale=None, block_size_M=None, num_local_tokens=None, moe_sorting_dispatch_policy=0,
                   dtype=None, hidden_pad=0, intermediate_pad=0, bias1=None, bias2=None, splitk=0,
                   swiglu_limit=None, beta=None, linear_beta=None, gate_mode="separated"):
        t, d = hidden_states.shape
        e, n, kb = w1.shape
        inter = n // 2
        assert hidden_states.dtype in (torch.bfloat16, torch.float16) and hidden_states.is_contiguous()
        assert w1.dtype == w2.dtype == FP4X2 and w1.is_shuffled and w2.is_shuffled
        assert kb * 2 == d and w2.shape == (e, d, inter // 2)
        assert topk_ids.dtype == torch.int32 and topk_weight.dtype == torch.float32
        assert topk_ids.shape == topk_weight.shape and topk_ids.shape[0] == t and topk_ids.is_contiguous()
        assert activation == "silu" and quant_type == "per_1x32" and not doweight_stage1 and expert_mask is None
        assert gate_mode == "interleave" and isinstance(swiglu_limit, float) and swiglu_limit > 0
        assert w1_scale.dtype == w2_scale.dtype == E8M0
        assert w1_scale.shape == (e * n, d // 32) and w2_scale.shape == (e * d, inter // 32)
        self.calls.append("fused_moe")
        w13 = unshuffle(w1, aiter_codes_order(e, n, kb, True), (e, n, kb))
        s13 = unshuffle(w1_scale, aiter_scale_order(e, n, d // 32, True), (e, n, d // 32))
        w2p = unshuffle(w2, aiter_codes_order(e, d, inter // 2, False), (e, d, inter // 2))
        s2 = unshuffle(w2_scale, aiter_scale_order(e, d, inter // 32, False), (e, d, inter // 32))
        x = hidden_states.float()
        out = torch.zeros(t, d)
        for tok in range(t):
            for j in range(topk_ids.shape[1]):
                ex = int(topk_ids[tok, j])
                gate, up = (x[tok] @ dequant_mxfp4_ref(w13[ex], s13[ex]).t()).split(inter)
                h = F.silu(gate.clamp(max=swiglu_limit)) * up.clamp(-swiglu_limit, swiglu_limit)
                out[tok] += topk_weight[tok, j] * (h @ dequant_mxfp4_ref(w2p[ex], s2[ex]).t())
        return out.to(hidden_states.dtype)


def fake_aiter(calls: list, with_clamp: bool = True) -> types.ModuleType:
    module = types.ModuleType("aiter")
    module.QuantType = types.SimpleNamespace(per_1x32="per_1x32")
    module.ActivationType = types.SimpleNamespace(Silu="silu")
    module.dtypes = types.SimpleNamespace(fp4x2=FP4X2, fp8_e8m0=E8M0)
    module.fused_moe = FakeFusedMoe(calls, with_clamp)
    return module


@pytest.fixture
def calls(monkeypatch):
    aiter_ops.reset()
    found = []
    module = fake_aiter(found)
    monkeypatch.setitem(sys.modules, "aiter", module)
    monkeypatch.setitem(sys.modules, "aiter.fused_moe", module.fused_moe)
    yield found
    aiter_ops.reset()


def experts(seed: int = 0, hidden: int = D, inter: int = I) -> Mxfp4RoutedExperts:
    g = torch.Generator().manual_seed(seed)
    m = Mxfp4RoutedExperts(E, hidden, inter, LIMIT)
    for e in range(E):
        for which, rows, k in (("w1", inter, hidden), ("w3", inter, hidden), ("w2", hidden, inter)):
            m.load_expert(which, e, torch.randint(0, 256, (rows, k // 2), generator=g, dtype=torch.uint8), False)
            m.load_expert(which, e, torch.randint(122, 130, (rows, k // 32), generator=g, dtype=torch.uint8), True)
    return m


def reference(m: Mxfp4RoutedExperts, x, ids, weights) -> torch.Tensor:
    return fused_moe_mxfp4_ref(x.float(), ids, weights, m.w13, m._rows(m.w13_scale), m.w2, m._rows(m.w2_scale),
                               LIMIT)


def inputs(tokens: int = 5, seed: int = 1) -> tuple:
    g = torch.Generator().manual_seed(seed)
    x = (torch.randn(tokens, D, generator=g) * 0.05).bfloat16()
    ids = torch.stack([torch.randperm(E, generator=g)[:K] for _ in range(tokens)])
    return x, ids, torch.rand(tokens, K, generator=g) * 1.5  # router weights, routed scaling included


def close(a: torch.Tensor, b: torch.Tensor) -> bool:  # one bf16 rounding of the result apart
    return torch.allclose(a.float(), b.float(), rtol=2 ** -7, atol=1e-3 * b.abs().max().item())


def test_aiter_serves_mxfp4_experts_in_its_layout(calls):
    """On gfx950 with the A8W4 bound at 0, the layer's tensors go into AITER's layout in place and its fused_moe
    computes our experts' function; a later load_expert writes through the layout; the shared expert is added."""
    m, (x, ids, w) = experts(), inputs()
    want = reference(m, x, ids, w)
    storage = (m.w13.data_ptr(), m.w13_scale.data_ptr(), m.w2.data_ptr(), m.w2_scale.data_ptr())
    with plat.simulate_platform("hip", gfx="gfx950", aiter=True), envs.AITER_BF16_FP8_MOE_BOUND.override("0"):
        assert serve_experts_with_aiter([m], torch.bfloat16, expert_parallel=False) == (1, 1)
        assert "moe_experts" in aiter_ops.startup_line().split(";")[0]
        got = m(x, ids, w)
        assert calls == ["fused_moe"] and got.dtype == torch.bfloat16 and close(got, want)
        assert log_moe_paths([m], torch.bfloat16) == [
            "routed experts: AITER fused_moe (A8W4: MXFP8 activations, MXFP4 weights in its layout) in 1 layer"]
        assert (m.w13.data_ptr(), m.w13_scale.data_ptr(), m.w2.data_ptr(), m.w2_scale.data_ptr()) == storage
        add = torch.randn(x.shape).bfloat16()
        assert close(m(x, ids, w, add=add), want + add.float())
        fresh = experts(seed=5)  # a weight update: expert 2's up rows and down scales from another checkpoint
        fresh_w3 = fresh.w13.data[2, I:].clone()
        fresh_s2 = fresh._rows(fresh.w2_scale)[2].reshape(D, -1).clone()
        m.load_expert("w3", 2, fresh_w3, False)
        m.load_expert("w2", 2, fresh_s2, True)
        plain = experts()
        plain.load_expert("w3", 2, fresh_w3, False)
        plain.load_expert("w2", 2, fresh_s2, True)
        assert close(m(x, ids, w), reference(plain, x, ids, w))


@pytest.mark.parametrize("case", ["not installed", "old aiter", "gfx942", "bound unset", "cuda", "switched off"])
def test_ours_where_aiter_moe_is_missing_or_unfit(monkeypatch, case):
    aiter_ops.reset()
    found = []
    module = fake_aiter(found, with_clamp=case != "old aiter")
    monkeypatch.setitem(sys.modules, "aiter", module)
    monkeypatch.setitem(sys.modules, "aiter.fused_moe", module.fused_moe)
    platform = {"not installed": dict(gfx="gfx950", aiter=False), "gfx942": dict(gfx="gfx942", aiter=True)}.get(
        case, dict(gfx="gfx950", aiter=True))
    bound = "256" if case == "bound unset" else "0"
    m = experts()
    before = m.w13.clone()
    try:
        with plat.simulate_platform("cuda" if case == "cuda" else "hip", **platform), \
                envs.AITER_BF16_FP8_MOE_BOUND.override(bound), envs.SGLANG_USE_AITER.override(
                    "0" if case == "switched off" else "auto"):
            assert aiter_ops.aiter_moe_api() is None
            assert serve_experts_with_aiter([m], torch.bfloat16, False) == (0, 1)
            assert "moe_experts" not in aiter_ops.startup_line().split(";")[0]
    finally:
        aiter_ops.reset()
    assert m.aiter is None and torch.equal(m.w13, before) and found == []


def test_layers_aiter_does_not_take_stay_ours(calls):
    """Widths off its tiles, fp32 activations, expert parallelism: the layer keeps our layout."""
    with plat.simulate_platform("hip", gfx="gfx950", aiter=True), envs.AITER_BF16_FP8_MOE_BOUND.override("0"):
        api = aiter_ops.aiter_moe_api()
        assert api is not None and "swiglu_limit" in inspect.signature(api.fused_moe).parameters
        narrow, m = experts(hidden=D, inter=128), experts()
        before = narrow.w13.clone()
        assert not narrow.use_aiter(api, torch.bfloat16, False) and torch.equal(narrow.w13, before)
        assert not m.use_aiter(api, torch.float32, False) and not m.use_aiter(api, torch.bfloat16, True)
        assert serve_experts_with_aiter([narrow, m], torch.bfloat16, True) == (0, 2)
        assert narrow.aiter is None and m.aiter is None
