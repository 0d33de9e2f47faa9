"""The fp32-computed projections (compressors' wkv / wgate, the router's gate): their weights are kept bf16 where
every loaded value is a bf16 value (decided per weight from the checkpoint's headers and the engine dtype, checked
again as the values are copied), and one front door (layers/fp32_linear.py) computes x . W^T in fp32: a bf16 GEMM
with fp32 output for bf16 x and a bf16 weight on a CUDA GPU, else the fp32 GEMM of x.float() and W.float()."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

from sglang.srt import platform as plat
from sglang.srt.configs.deepseek_v4 import DeepseekV4Config
from sglang.srt.layers import fp32_linear
from sglang.srt.layers.fp32_linear import linear_fp32_out, uses_tensor_cores
from sglang.srt.layers.moe.router import Gate
from sglang.srt.model_loader.loader import iter_checkpoint, plan_checkpoint
from sglang.srt.model_loader.model_builder import (
    bf16_projection_names, build_meta_model, materialize, parameter_bytes)
from sglang.srt.model_loader.tiny_checkpoint import TINY_CONFIG, make_tiny_checkpoint
from sglang.srt.models.deepseek_v4 import DeepseekV4ForCausalLM
from sglang.srt.models.weight_loading import BF16_PROJECTION, load_native_weights

CFG = DeepseekV4Config.from_dict(TINY_CONFIG)
CPU = torch.device("cpu")


@pytest.fixture(scope="module")
def ckpts(tmp_path_factory):
    root = tmp_path_factory.mktemp("proj")
    return {dtype: make_tiny_checkpoint(str(root / dtype), TINY_CONFIG, seed=0, dtype=dtype)
            for dtype in ("bfloat16", "float32")}


def _projection_params(model) -> dict:
    return {n: p for n, p in model.named_parameters() if BF16_PROJECTION.search(n)}


def test_the_projection_names():
    for name in ("layers.1.attn.compressor.wkv.weight", "layers.1.attn.indexer.compressor.wgate.weight",
                 "layers.0.ffn.gate.weight", "mtp.0.ffn.gate.weight"):
        assert BF16_PROJECTION.search(name), name
    for name in ("layers.1.attn.wkv.weight", "layers.0.ffn.gate.bias", "layers.1.attn.compressor.ape",
                 "layers.0.ffn.shared_experts.w1.weight", "layers.0.hc_ffn_fn"):
        assert not BF16_PROJECTION.search(name), name


@pytest.mark.parametrize("stored", ["bfloat16", "float32"])
def test_bf16_kept_where_every_loaded_value_is_one(ckpts, stored):
    """bf16 engine: the loader yields these weights in bf16, so all are kept bf16; fp32 engine: only those stored
    BF16 (a checkpoint storing them F32 may hold true fp32 values: those stay fp32); fp16 engine: none."""
    plans = plan_checkpoint(ckpts[stored], CFG, "main")
    projections = {p.name for p in plans if BF16_PROJECTION.search(p.name)}
    assert any("compressor.wkv" in n for n in projections) and any("ffn.gate" in n for n in projections)
    assert bf16_projection_names(plans, torch.bfloat16, CPU) == projections
    assert bf16_projection_names(plans, torch.float32, CPU) == (projections if stored == "bfloat16" else frozenset())
    assert bf16_projection_names(plans, torch.float16, CPU) == frozenset()


def test_nvidia_and_cpu_keep_them_bf16_rocm_fp32(ckpts):
    """The choice is the device's, not the machine's: the capacity planner counts on any host what the server
    builds on its GPUs."""
    plans = plan_checkpoint(ckpts["bfloat16"], CFG, "main")
    cuda = torch.device("cuda")
    with plat.simulate_platform("cuda"):
        assert bf16_projection_names(plans, torch.bfloat16, cuda) == bf16_projection_names(plans, torch.bfloat16, CPU)
    with plat.simulate_platform("hip", gfx="gfx950"):
        assert bf16_projection_names(plans, torch.bfloat16, cuda) == frozenset()
    assert bf16_projection_names(plans, torch.bfloat16, torch.device("meta")) == frozenset()


def test_the_meta_model_and_its_bytes(ckpts):
    plans = plan_checkpoint(ckpts["bfloat16"], CFG, "main")
    names = bf16_projection_names(plans, torch.bfloat16, CPU)
    kept = build_meta_model(DeepseekV4ForCausalLM, CFG, torch.bfloat16, bf16_weights=names)
    wide = build_meta_model(DeepseekV4ForCausalLM, CFG, torch.bfloat16)
    got = _projection_params(kept)
    assert set(got) == names and all(p.dtype == torch.bfloat16 for p in got.values())
    assert all(p.dtype == torch.float32 for p in _projection_params(wide).values())
    half = sum(p.numel() * 2 for p in got.values())
    assert parameter_bytes(wide) - parameter_bytes(kept) == half  # the capacity planner counts 2 bytes each
    fp32_kept = dict(kept.named_parameters())
    assert fp32_kept["layers.2.ffn.gate.bias"].dtype == torch.float32  # the rest as before
    assert fp32_kept["layers.1.attn.compressor.ape"].dtype == torch.float32


def _loaded(path, dtype):
    plans = plan_checkpoint(path, CFG, "main")
    model = materialize(build_meta_model(DeepseekV4ForCausalLM, CFG, dtype,
                                         bf16_weights=bf16_projection_names(plans, dtype, CPU)), "cpu")
    model.load_weights(iter_checkpoint(path, CFG, dtype=dtype, plans=plans))
    return model


def test_fp32_engine_loads_true_fp32_values_in_fp32(ckpts):
    """A checkpoint storing the projections F32 with values no bf16 holds: the fp32 engine keeps them fp32 and
    loads them unrounded; stored BF16: kept bf16, the same values."""
    stored = dict(iter_checkpoint(ckpts["float32"], CFG, dtype=torch.float32))
    name = "layers.1.attn.compressor.wkv.weight"
    assert not torch.equal(stored[name].bfloat16().float(), stored[name])  # true fp32 values
    wide = _loaded(ckpts["float32"], torch.float32)
    params = _projection_params(wide)
    assert all(p.dtype == torch.float32 for p in params.values())
    assert torch.equal(wide.layers[1].ffn.gate.weight, stored["layers.1.ffn.gate.weight"])
    narrow = _loaded(ckpts["bfloat16"], torch.float32)
    assert all(p.dtype == torch.bfloat16 for p in _projection_params(narrow).values())
    want = dict(iter_checkpoint(ckpts["bfloat16"], CFG, dtype=torch.float32))
    assert torch.equal(narrow.layers[1].ffn.gate.weight.float(), want["layers.1.ffn.gate.weight"])


def test_a_bf16_kept_weight_refuses_values_it_would_round(ckpts):
    """A weight update into a bf16-kept projection: fp32 tensors of bf16 values load, a true fp32 value raises
    (a joined compressor's rows too) rather than being rounded."""
    model = _loaded(ckpts["bfloat16"], torch.float32)
    model.layers[1].attn.compressor.join_projections()
    updates = dict(iter_checkpoint(ckpts["bfloat16"], CFG, dtype=torch.float32))
    load_native_weights(model, updates.items())  # bf16 values stored fp32: exact
    for name in ("layers.1.ffn.gate.weight", "layers.1.attn.compressor.wgate.weight"):
        bad = dict(updates)
        bad[name] = updates[name].clone()
        bad[name][0, 0] += 2.0 ** -20 * bad[name][0, 0].abs().clamp_min(1.0)
        with pytest.raises(ValueError, match="not bf16 values"):
            load_native_weights(model, bad.items())


def test_front_door_on_the_cpu_is_the_fp32_gemm():
    g = torch.Generator().manual_seed(1)
    x, w = torch.randn(5, 24, generator=g).bfloat16(), torch.randn(7, 24, generator=g).bfloat16()
    assert not uses_tensor_cores(x, w)  # no mm out_dtype on the CPU
    got = linear_fp32_out(x, w)
    assert got.dtype == torch.float32 and torch.equal(got, F.linear(x.float(), w.float()))
    xf = x.float()
    assert torch.equal(linear_fp32_out(xf, w.float()), F.linear(xf, w.float()))  # the fp32 engine: unchanged
    assert torch.equal(linear_fp32_out(x.view(1, 5, 24), w), got.view(1, 5, 7))


def test_front_door_takes_the_bf16_gemm_with_fp32_output(monkeypatch):
    """Where x and the weight are bf16 on a CUDA GPU (stood for here): torch.mm(x, W^T, out_dtype=fp32), no fp32
    copy of x or W; fp32 x or an fp32 weight keeps the fp32 GEMM."""
    calls = []

    def mm(a, b, out_dtype=None):
        calls.append((a.dtype, b.dtype, out_dtype))
        return F.linear(a.float(), b.t().float())

    monkeypatch.setattr(fp32_linear, "_on_cuda", lambda t: True)
    monkeypatch.setattr(fp32_linear, "mm_out_dtype_available", lambda: True)
    monkeypatch.setattr(torch, "mm", mm)
    g = torch.Generator().manual_seed(2)
    x, w = torch.randn(2, 3, 16, generator=g).bfloat16(), torch.randn(9, 16, generator=g).bfloat16()
    got = linear_fp32_out(x, w)
    assert calls == [(torch.bfloat16, torch.bfloat16, torch.float32)]
    assert got.shape == (2, 3, 9) and torch.equal(got, F.linear(x.float(), w.float()))
    linear_fp32_out(x.float(), w)
    linear_fp32_out(x, w.float())
    assert len(calls) == 1
    monkeypatch.setattr(fp32_linear, "mm_out_dtype_available", lambda: False)  # an older torch: the fp32 GEMM
    assert not uses_tensor_cores(x, w)


def test_mm_out_dtype_probe():
    """A dispatcher lookup: a bool, False where torch has no CUDA kernel for mm.dtype (a CPU-only build)."""
    available = fp32_linear.mm_out_dtype_available()
    assert isinstance(available, bool)
    if torch.version.cuda is None:
        assert not available


def test_router_with_a_bf16_kept_weight_routes_the_same():
    """The same bf16 values stored bf16 or fp32: the same logits, ids and weights on the torch path."""
    g = torch.Generator().manual_seed(3)
    gate = Gate(48, 10, 3, 97, 1.5, False)
    with torch.no_grad():
        gate.weight.copy_(torch.randn(10, 48, generator=g).bfloat16().float())
        gate.bias.copy_(torch.randn(10, generator=g) * 0.1)
    x = torch.randn(6, 48, generator=g).bfloat16()
    wide = gate(x, None)
    gate.weight.data = gate.weight.data.bfloat16()
    narrow = gate(x, None)
    assert torch.equal(wide[0], narrow[0]) and torch.equal(wide[1], narrow[1])


# ----------------------------------------------------------------------------- GPU


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")
@pytest.mark.parametrize("rows", [1, 2, 8, 32, 128, 8192])
@pytest.mark.parametrize("n", [256, 512, 2048])
def test_gpu_bf16_gemm_with_fp32_output(rows, n):
    """Flash widths: the bf16 GEMM with fp32 output is the fp32 GEMM of the same values to fp32 summation order, and
    a CUDA-graph replay equals the eager call bit for bit (the same path, the same cuBLAS algorithm)."""
    g = torch.Generator("cuda").manual_seed(rows + n)
    x = torch.randn(rows, 4096, generator=g, device="cuda").bfloat16()
    w = (torch.randn(n, 4096, generator=g, device="cuda") * 4096 ** -0.5).bfloat16()
    assert fp32_linear.mm_out_dtype_available() == (torch.version.hip is None) and uses_tensor_cores(x, w)
    got = linear_fp32_out(x, w)
    assert got.dtype == torch.float32 and got.shape == (rows, n)
    # both against the float64 product, within fp32 summation's bound: K * 2^-24 * sum |x_k w_k| (the fp32 GEMM's
    # own error is of that order, so a fixed tolerance fails at 8K rows on a few near-cancelling sums)
    exact = x.double() @ w.double().t()
    bound = 4096 * 2.0 ** -24 * (x.double().abs() @ w.double().abs().t())
    assert ((got.double() - exact).abs() <= bound).all()
    assert ((F.linear(x.float(), w.float()).double() - exact).abs() <= bound).all()
    live = x.clone()
    linear_fp32_out(live, w)  # cuBLAS's workspace before capture
    torch.cuda.synchronize()
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        out = linear_fp32_out(live, w)
    for seed in range(3):
        live.copy_(torch.randn(rows, 4096, generator=g, device="cuda").bfloat16())
        graph.replay()
        assert torch.equal(out, linear_fp32_out(live, w)), seed


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")
@pytest.mark.parametrize("rows", [1, 8, 33, 256])
def test_gpu_router_with_a_bf16_weight(rows):
    """Gate.route on a GPU with the weight kept bf16 (the fused kernel up to FUSED_MAX_ROWS, the bf16 GEMM above):
    the same experts as the fp32 torch path of the same values, weights to fp32 rounding."""
    g = torch.Generator().manual_seed(rows)
    gate = Gate(4096, 256, 6, 1000, 1.5, False)
    with torch.no_grad():
        gate.weight.copy_(torch.randn(256, 4096, generator=g) * 4096 ** -0.5 * 2)
        gate.bias.copy_(torch.randn(256, generator=g) * 0.1)
    gate = gate.cuda()
    gate.weight.data = gate.weight.data.bfloat16()
    x = torch.randn(rows, 4096, generator=g).bfloat16().cuda()
    weights, ids = gate(x, None)
    logits = F.linear(x.float(), gate.weight.float())
    biased = F.softplus(logits).sqrt() + gate.bias
    top = biased.topk(7, dim=-1).values
    clear = (top[:, 5] - top[:, 6]) > 1e-4  # rows whose 6th and 7th choices are not within fp32 rounding
    want = biased.sort(dim=-1, descending=True, stable=True).indices[:, :6]
    assert torch.equal(ids[clear], want[clear])
    ref = F.softplus(logits).sqrt().gather(1, ids)
    torch.testing.assert_close(weights, ref / ref.sum(-1, keepdim=True) * 1.5, rtol=1e-4, atol=1e-5)
