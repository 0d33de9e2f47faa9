"""concat_linears (layers/fused_linear.py): linears reading one input joined into one compute their parts' outputs
side by side, for plain and FP8 block-scaled weights (the dequantize path and, under the Triton interpreter, the GPU's
few-row kernel); parts that cannot be joined (other types, a bias, FP8 groups, an FP8 part but the last not filling
whole 128-row scale blocks) give None. The engine joins each attention's wq_a and wkv, each CSA attention's wq_b and
its indexer's wq_b, and each compressor's wkv and wgate after loading (its agreement with HF's model:
test_oracle_hf.py)."""

from __future__ import annotations

import pytest
import torch
from torch import nn

from oracle import engine
from sglang.srt.layers.fused_linear import concat_linears
from sglang.srt.layers.quantization.fp8 import Fp8BlockLinear


def _fp8(in_features: int, out_features: int, seed: int, groups: int = 1) -> Fp8BlockLinear:
    g = torch.Generator().manual_seed(seed)
    m = Fp8BlockLinear(in_features, out_features, groups)
    m.weight.copy_(torch.randn(out_features, in_features, generator=g).to(torch.float8_e4m3fn))
    m.weight_scale_inv.copy_(2.0 ** torch.randint(-8, -2, m.weight_scale_inv.shape, generator=g).float())
    return m


def test_plain_linears_joined():
    torch.manual_seed(0)
    a, b = nn.Linear(64, 48, bias=False), nn.Linear(64, 20, bias=False)
    fused = concat_linears([a, b])
    x = torch.randn(5, 64)
    assert fused.weight.shape == (68, 64)
    torch.testing.assert_close(fused(x), torch.cat([a(x), b(x)], -1), rtol=0, atol=1e-6)


@pytest.mark.parametrize("rows", [3, 70])  # the W8A16 kernel (interpreted) and dequantize + matmul
def test_fp8_linears_joined(rows, monkeypatch):
    monkeypatch.setenv("TRITON_INTERPRET", "1")
    a, b = _fp8(256, 128, seed=1), _fp8(256, 96, seed=2)
    fused = concat_linears([a, b])
    assert isinstance(fused, Fp8BlockLinear) and fused.weight.dtype == torch.float8_e4m3fn
    assert fused.weight.shape == (224, 256) and fused.weight_scale_inv.shape == (2, 2)
    x = torch.randn(rows, 256, generator=torch.Generator().manual_seed(3))
    torch.testing.assert_close(fused(x), torch.cat([a(x), b(x)], -1), rtol=1e-5, atol=1e-5)


def test_parts_that_cannot_be_joined():
    assert concat_linears([_fp8(256, 96, 1), _fp8(256, 128, 2)]) is None  # 96 rows: a scale block shared
    assert concat_linears([_fp8(256, 128, 1, groups=2), _fp8(256, 128, 2)]) is None
    assert concat_linears([_fp8(256, 128, 1), nn.Linear(256, 64, bias=False)]) is None
    assert concat_linears([nn.Linear(64, 8), nn.Linear(64, 8)]) is None  # biases
    assert concat_linears([nn.Linear(64, 8, bias=False), nn.Linear(32, 8, bias=False)]) is None
    assert concat_linears([nn.Linear(64, 8, bias=False), nn.Linear(64, 8, bias=False).double()]) is None


def test_engine_joins_projections():
    from sglang.srt.models.deepseek_v4 import Attention, Compressor

    modules = list(engine("tiny", disable_cuda_graph=True).model_runner.model.modules())
    attns = [m for m in modules if isinstance(m, Attention)]
    compressors = [m for m in modules if isinstance(m, Compressor)]
    assert attns and all(a.wq_kv_a is not None and a.wq_a is None and a.wkv is None for a in attns)
    csa = [a for a in attns if a.indexer is not None]
    assert csa and all(a.wq_b_indexer is not None and a.wq_b is None and a.indexer.wq_b is None for a in csa)
    assert all(a.wq_b_indexer is None and a.wq_b is not None for a in attns if a.indexer is None)
    assert compressors and all(c.wkv_gate is not None and c.wkv is None and c.wgate is None for c in compressors)
    assert all(c.wkv_gate.weight.dtype == torch.float32 for c in compressors)  # the reference's fp32 projections
