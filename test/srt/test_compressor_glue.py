"""The compressor's torch glue around its projection: the position bias `ape` of each row's window slot, added in place,
with the window offsets (positions % ratio) from the step's metadata (once per step and ratio) and x.float() shared
by a CSA layer's two compressors. Same values as the plain formula, fewer launches."""

from __future__ import annotations

import collections
from types import SimpleNamespace

import pytest
import torch
from torch.utils._python_dispatch import TorchDispatchMode, _disable_current_modes

from sglang.srt.configs.deepseek_v4 import DeepseekV4Config
from sglang.srt.layers.attention.dsv4.metadata import RatioMetadata
from sglang.srt.model_loader.tiny_checkpoint import TINY_CONFIG
from sglang.srt.models.deepseek_v4 import Compressor
from sglang.srt.layers.rotary import RotaryEmbedding


class _Ops(TorchDispatchMode):
    def __init__(self):
        super().__init__()
        self.ops = collections.Counter()

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        self.ops[func.overloadpacket.__name__] += 1
        return func(*args, **(kwargs or {}))


class _Backend:
    def forward_compressor(self, compressor, fresh, forward_batch, compute_dtype):
        self.fresh, self.compute_dtype = fresh.clone(), compute_dtype


def _compressor(ratio: int, joined: bool) -> Compressor:
    torch.manual_seed(ratio)
    config = DeepseekV4Config.from_dict(dict(TINY_CONFIG))
    c = Compressor(config, 1, ratio, 16, RotaryEmbedding(8, 10000.0, None), is_indexer=False)
    with torch.no_grad():
        for p in c.parameters():
            p.copy_(torch.randn_like(p))
    if joined:
        assert c.join_projections()
    return c


@pytest.mark.parametrize("ratio", [4, 8])
@pytest.mark.parametrize("joined", [True, False])
@pytest.mark.parametrize("with_offset", [True, False])
def test_compressor_adds_the_window_slot_bias(ratio, joined, with_offset):
    c = _compressor(ratio, joined)
    positions = torch.tensor([0, 5, 6, 7, 13, 31, 2])
    x = torch.randn(positions.shape[0], c.wkv_gate.weight.shape[1] if joined else c.wkv.weight.shape[1],
                    dtype=torch.bfloat16)
    w_kv, w_gate = (c.wkv_gate.weight.view(2, c.width, -1) if joined else (c.wkv.weight, c.wgate.weight))
    want = torch.stack((x.float() @ w_kv.float().T, x.float() @ w_gate.float().T + c.ape[positions % ratio]), 1)
    offset = torch.remainder(positions, ratio) if with_offset else None
    fb = SimpleNamespace(attn_backend=_Backend(), attn_metadata=SimpleNamespace(
        ratios={ratio: RatioMetadata(ratio, None, None, None, window_offset=offset)}))
    with torch.no_grad():
        c(x, positions, fb)
    assert fb.attn_backend.compute_dtype == torch.bfloat16
    assert torch.equal(fb.attn_backend.fresh, want)


def test_compressor_glue_launches():
    """With the step's window offsets and a shared fp32 input: the projection, the bias gather and one in-place add;
    no `positions % ratio`, no write-back copy of the gate half, no cast of x."""
    c = _compressor(4, joined=True)
    positions = torch.arange(3)
    x = torch.randn(3, c.wkv_gate.weight.shape[1], dtype=torch.bfloat16)
    fb = SimpleNamespace(attn_backend=_Backend(), attn_metadata=SimpleNamespace(
        ratios={4: RatioMetadata(4, None, None, None, window_offset=positions % 4)}))
    with torch.no_grad(), _Ops() as counter:
        c(x, positions, fb, xf=x.float())
    launched = {k: v for k, v in counter.ops.items() if k not in ("view", "select", "t", "clone", "_to_copy")}
    assert launched == {"mm": 1, "index": 1, "add_": 1}, counter.ops
    assert counter.ops["_to_copy"] == 1  # the caller's x.float() only


# ---------------------------------------------------------------------------------------- the GPU path's one launch


def _csa_attention(dtype: torch.dtype, weight_dtype: torch.dtype = torch.float32):
    """What Attention.compressor_inputs reads of a CSA attention: its compressor, its indexer (joined wkv_gate,
    compressor weights in `weight_dtype`: fp32, or bf16 as a bf16 engine keeps them; weights_proj in the model
    dtype), dyadic values so any summation order is exact."""
    from sglang.srt.models.deepseek_v4 import Indexer

    config = DeepseekV4Config.from_dict(dict(TINY_CONFIG))
    rotary = RotaryEmbedding(8, 10000.0, None)
    g = torch.Generator().manual_seed(3)
    attn = SimpleNamespace(ratio=4, compressor=Compressor(config, 1, 4, 32, rotary, is_indexer=False),
                           indexer=Indexer(config, 1, rotary))
    with torch.no_grad():
        for module in (attn.compressor, attn.indexer):
            for p in module.parameters():
                p.copy_(torch.randint(-8, 9, p.shape, generator=g).float() / 8)
    attn.indexer.weights_proj.to(dtype)
    for c in (attn.compressor, attn.indexer.compressor):
        c.wkv.to(weight_dtype)
        c.wgate.to(weight_dtype)
        assert c.join_projections()
    return attn


@pytest.mark.parametrize("dtype,weight_dtype", [(torch.bfloat16, torch.float32), (torch.float32, torch.float32),
                                                (torch.bfloat16, torch.bfloat16)], ids=str)
def test_gpu_path_projects_everything_in_one_launch(monkeypatch, dtype, weight_dtype):
    """Where x is a GPU tensor (here: the op run on CPU tensors in the Triton interpreter), the compressors' and the
    indexer's projections of x come from ONE dsv4_compressor_proj launch, equal to the torch path: no cast of x, no
    fp32 GEMMs, no bias gather / add, no weights_proj linear / cast / scale."""
    pytest.importorskip("triton")
    import triton
    import triton.runtime.interpreter  # noqa: F401  (the attribute below)

    from sgl_kernel.dsv4_compressor_proj import dsv4_compressor_proj
    from sglang.srt.models import deepseek_v4
    from sglang.srt.models.deepseek_v4 import Attention

    attn = _csa_attention(dtype, weight_dtype)
    positions = torch.tensor([0, 5, 6, 7, 13, 31, 2])
    x = (torch.randint(-8, 9, (positions.shape[0], TINY_CONFIG["hidden_size"])).float() / 4).to(dtype)
    fb = SimpleNamespace(attn_metadata=SimpleNamespace(
        ratios={4: RatioMetadata(4, None, None, None, window_offset=positions % 4)}))
    torch_path = Attention.compressor_inputs(attn, x, positions, fb)  # a CPU tensor: x.float() only
    assert torch_path.kv_gate is None and torch.equal(torch_path.xf, x.float())
    launches = []
    for cls in (triton.runtime.jit.JITFunction, getattr(triton.runtime.interpreter, "InterpretedFunction", None)):
        if cls is not None and "run" in vars(cls):
            def run(self, *args, _real=vars(cls)["run"], **kwargs):
                launches.append(getattr(self, "__name__", None) or self.fn.__name__)
                with _disable_current_modes():  # the interpreter's own tensor copies are not launches
                    return _real(self, *args, **kwargs)
            monkeypatch.setattr(cls, "run", run)
    monkeypatch.setattr(deepseek_v4, "_compressor_proj_op", lambda x: dsv4_compressor_proj)
    with torch.no_grad(), _Ops() as counter:
        fused = Attention.compressor_inputs(attn, x, positions, fb)
    assert launches == ["_dsv4_compressor_proj_kernel"]
    assert {k for k in counter.ops if k not in ("empty", "view")} == set(), counter.ops
    with torch.no_grad():
        want_kv = attn.compressor.project(x, positions, fb)
        want_idx = attn.indexer.compressor.project(x, positions, fb)
        want_w = attn.indexer.weights_proj(x).float() * attn.indexer.weight_scale
    assert fused.xf is None
    assert torch.equal(fused.kv_gate, want_kv) and torch.equal(fused.index_kv_gate, want_idx)
    assert torch.equal(fused.index_weights, want_w)


def test_prefill_sized_batches_keep_the_torch_gemms(monkeypatch):
    """Above FUSED_PROJ_MAX_ROWS rows (batches from 3 rows, prefill chunks) the projections stay cuBLAS's fp32 GEMMs,
    even on a GPU."""
    from sglang.srt.models import deepseek_v4
    from sglang.srt.platform import simulate_platform

    x = torch.zeros(deepseek_v4.FUSED_PROJ_MAX_ROWS + 1, 8)
    monkeypatch.setattr(torch.Tensor, "is_cuda", property(lambda self: True))
    with simulate_platform("cuda"):
        assert deepseek_v4._compressor_proj_op(x) is None
        assert deepseek_v4._compressor_proj_op(x[:-1]) is not None


def test_bf16_kept_weights_take_the_bf16_gemm_above_the_fused_rows(monkeypatch):
    """Above FUSED_PROJ_MAX_ROWS on a CUDA GPU (stood for here) with bf16 x and bf16-kept weights: no x.float() for
    the compressors, each projection one bf16 GEMM with fp32 output (aten::mm.dtype), the same values."""
    from sglang.srt.layers import fp32_linear
    from sglang.srt.models.deepseek_v4 import Attention

    attn = _csa_attention(torch.bfloat16, torch.bfloat16)
    positions = torch.tensor([0, 5, 6, 7, 13, 31, 2])
    x = (torch.randint(-8, 9, (positions.shape[0], TINY_CONFIG["hidden_size"])).float() / 4).bfloat16()
    fb = SimpleNamespace(attn_metadata=SimpleNamespace(
        ratios={4: RatioMetadata(4, None, None, None, window_offset=positions % 4)}))
    with torch.no_grad():
        want = [c.project(x, positions, fb) for c in (attn.compressor, attn.indexer.compressor)]
    calls = []

    def mm(a, b, out_dtype=None):
        calls.append((a.dtype, b.dtype, out_dtype))
        return torch.nn.functional.linear(a.float(), b.t().float())

    monkeypatch.setattr(fp32_linear, "_on_cuda", lambda t: True)
    monkeypatch.setattr(fp32_linear, "mm_out_dtype_available", lambda: True)
    monkeypatch.setattr(torch, "mm", mm)
    with torch.no_grad():
        inputs = Attention.compressor_inputs(attn, x, positions, fb)
        assert inputs.xf is None and inputs.kv_gate is None  # no fp32 copy of x: the GEMMs read it as it is
        got = [c.project(x, positions, fb, inputs.xf) for c in (attn.compressor, attn.indexer.compressor)]
    assert calls == [(torch.bfloat16, torch.bfloat16, torch.float32)] * 2
    assert all(torch.equal(g, w) for g, w in zip(got, want))
