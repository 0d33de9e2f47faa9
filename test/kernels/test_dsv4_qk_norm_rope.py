"""dsv4_qk_norm_rope against the engine's torch path (RotaryEmbedding.apply_normed on CPU: rms_normalize or the
weighted RMSNorm, then the RoPE): query heads read from a joined projection's split view, the K=V vector under its
weight, a rope-only head, a pair count below a power of two, YaRN frequencies; fp16 and bf16 equal bit for bit, fp32
within the sum of squares' order. Compiled for sm90 on the CPU: registers, no spills, and the row read in the plain
norm's layout. GPU (skipped without CUDA): Flash's widths in bf16, the dispatch, a CUDA-graph replay."""

from __future__ import annotations

import pytest
import torch

from sgl_kernel.dsv4_qk_norm_rope import dsv4_qk_norm_rope
from sglang.srt.configs.deepseek_v4 import YarnScaling
from sglang.srt.layers import rotary
from sglang.srt.layers.norm import RMSNorm
from sglang.srt.layers.rotary import RotaryEmbedding

needs_cuda = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")
EPS = 1e-6


def _joined(t: int, heads: int, d: int, dtype, g, device="cpu") -> torch.Tensor:
    """[t, heads, d] heads of a joined projection's output split view (rows heads * d + 24 apart)."""
    x = (torch.randn(t, heads * d + 24, generator=g) * 3).to(device=device, dtype=dtype)
    return x[:, :heads * d].view(t, heads, d)


def _norm(d: int, g) -> RMSNorm:
    n = RMSNorm(d, EPS)
    with torch.no_grad():
        n.weight.copy_(torch.randn(d, generator=g))
    return n


def _assert_matches(got, ref, dtype):
    assert got.dtype == dtype and got.shape == ref.shape and got.is_contiguous()
    if dtype == torch.float32:  # the sum of squares' order only (numpy's against torch's)
        torch.testing.assert_close(got, ref, atol=2e-6, rtol=2e-6)
    else:
        assert torch.equal(got, ref)


@pytest.mark.parametrize("dtype", [torch.float32, torch.float16, torch.bfloat16])
@pytest.mark.parametrize("t,heads,d,rope", [(5, 3, 40, 16), (3, 2, 16, 16), (4, 1, 24, 6)])
def test_query_heads_match_torch(dtype, t, heads, d, rope):
    g = torch.Generator().manual_seed(d + rope)
    rot = RotaryEmbedding(rope, 10000.0, None)
    x = _joined(t, heads, d, dtype, g)
    positions = torch.randint(0, 5000, (t,), generator=g)
    got = dsv4_qk_norm_rope(x, None, EPS, positions, rot.inv_freq)
    _assert_matches(got, rot.apply_normed(x, positions, EPS), dtype)


@pytest.mark.parametrize("dtype", [torch.float32, torch.float16, torch.bfloat16])
def test_kv_vector_matches_torch(dtype):
    """The weighted norm on [T, D] rows split from wq_a + wkv's joined output, with YaRN frequencies."""
    g = torch.Generator().manual_seed(7)
    rot = RotaryEmbedding(16, 160000.0, YarnScaling(factor=16.0, original_max_position_embeddings=4096,
                                                    beta_fast=32.0, beta_slow=1.0))
    kv = (torch.randn(7, 56 + 40, generator=g) * 3).to(dtype)[:, 56:]
    norm = _norm(40, g)
    positions = torch.randint(0, 60000, (7,), generator=g)
    got = dsv4_qk_norm_rope(kv, norm.weight, EPS, positions, rot.inv_freq)
    _assert_matches(got, rot.apply_normed(kv, positions, norm), dtype)


def test_zero_rows_and_refusals():
    inv = RotaryEmbedding(16, 10000.0, None).inv_freq
    assert dsv4_qk_norm_rope(torch.randn(0, 3, 40), None, EPS, torch.zeros(0, dtype=torch.long), inv).shape == (0, 3,
                                                                                                              40)
    pos = torch.zeros(3, dtype=torch.long)
    with pytest.raises(ValueError, match="contiguous last dim"):
        dsv4_qk_norm_rope(torch.randn(3, 40, 2)[..., 0], None, EPS, pos, inv)
    with pytest.raises(ValueError, match="D >= 16"):
        dsv4_qk_norm_rope(torch.randn(3, 2, 8), None, EPS, pos, inv)
    with pytest.raises(ValueError, match="positions"):
        dsv4_qk_norm_rope(torch.randn(3, 2, 40), None, EPS, pos[:2], inv)
    with pytest.raises(ValueError, match="weight"):
        dsv4_qk_norm_rope(torch.randn(3, 40), torch.ones(32), EPS, pos, inv)


def test_no_host_reads(monkeypatch):
    """Capturable in a CUDA graph: the launch reads no tensor on the host (shapes and strides only)."""
    import os
    import sys

    sys.path.insert(0, os.path.join(os.path.dirname(__file__), "..", "srt"))
    from host_reads import HostReadGuard

    g = torch.Generator().manual_seed(3)
    x, norm, rot = _joined(3, 2, 40, torch.float32, g), _norm(40, g), RotaryEmbedding(16, 10000.0, None)
    guard = HostReadGuard()
    with monkeypatch.context() as m:
        guard.install(m)
        monkeypatch.setattr(rotary, "_fused_norm_rope", lambda x: dsv4_qk_norm_rope)  # the GPU path, interpreted
        rot.apply_normed(x, torch.arange(3), EPS)
        rot.apply_normed(x[:, 0], torch.arange(3), norm)
    assert guard.violations == []


_COMPILE = r"""
import json, re
import triton
from triton.backends.compiler import GPUTarget
from sgl_kernel.dsv4_qk_norm_rope import _dsv4_qk_norm_rope_kernel as kernel
from sgl_kernel.dsv4_rmsnorm import _dsv4_rms_norm_kernel as plain, norm_warps
from benchmark.kernels.moe_registers import resources

types = {"x_ptr": "*bf16", "w_ptr": "*bf16", "out_ptr": "*bf16", "q_ptr": "*fp8e4nv", "s_ptr": "*fp32",
         "pos_ptr": "*i64", "inv_ptr": "*fp32", "eps": "fp32"}
aligned = ("x_ptr", "w_ptr", "out_ptr", "pos_ptr", "inv_ptr", "stride_xt", "stride_xh", "stride_ot", "stride_oh",
           "stride_x", "stride_o", "q_ptr", "s_ptr")

def build(fn, consts):
    sig = {n: "constexpr" if n in consts else types.get(n, "i32") for n in fn.arg_names}
    attrs = {(i,): [["tt.divisibility", 16]] for i, n in enumerate(fn.arg_names) if n in aligned}
    src = triton.compiler.ASTSource(fn=fn, signature=sig, attrs=attrs,
                                    constexprs={(fn.arg_names.index(n),): v for n, v in consts.items()})
    return triton.compile(src, target=GPUTarget("cuda", 90, 32), options={"num_warps": norm_warps(512)})

def row_layout(c):
    ttgir = c.asm["ttgir"]
    layouts = dict(re.findall(r"(#blocked\d*) = #ttg.blocked<([^>]*)>", ttgir))
    return layouts[re.search(r"tt\.load [^:]*: tensor<512x!tt\.ptr<bf16>, (#blocked\d*)>", ttgir).group(1)]

out = {}
for weight in (False, True):
    c = build(kernel, {"HAS_WEIGHT": weight, "NOPE": 448, "HALF_R": 32, "BLOCK_D": 512, "BLOCK_R": 32,
                       "BF16_BITS": False})
    out[f"fused {weight}"] = [resources(c), row_layout(c)]
    p = build(plain, {"HAS_WEIGHT": weight, "BLOCK_D": 512, "QUANT": False, "FP8_MAX": 448.0,
                      "ROUND_IN_FP32": False})
    out[f"plain {weight}"] = [resources(p), row_layout(p)]
print(json.dumps(out))
"""


def test_compiles_for_sm90():
    """Flash's head (D 512, 64 rope dims) in bf16, with and without the weight: no spills, and the row read in the
    layout the plain norm kernel reads it in (so the sum of squares runs in its order on a GPU)."""
    import os

    from sm90_compile import compiled_facts

    root = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
    found = compiled_facts(f"import sys; sys.path.insert(0, {root!r})\n" + _COMPILE, timeout=600)
    print(found)
    for weight in (False, True):
        res, layout = found[f"fused {weight}"]
        assert "STACK:0" in res, res
        assert layout == found[f"plain {weight}"][1]


@pytest.mark.gpu
@needs_cuda
@pytest.mark.parametrize("t", [1, 8, 32, 128])
def test_gpu_flash_widths(t):
    """Flash's query [T, 64, 512] (split from the joined wq_b + indexer output) and K=V vector [T, 512], rope 64,
    bf16: the torch path within bf16 rounding, the two kernels it replaces within one bf16 step, the dispatch
    from apply_normed, and a CUDA-graph replay with new inputs equal to a plain launch."""
    import os
    import sys

    from sgl_kernel.dsv4_rmsnorm import dsv4_rms_norm
    from sgl_kernel.dsv4_rope import dsv4_rope

    sys.path.insert(0, os.path.dirname(__file__))
    from graph_replays import assert_replays_equal

    g = torch.Generator().manual_seed(t)
    rot = RotaryEmbedding(64, 160000.0, YarnScaling(factor=16.0, original_max_position_embeddings=65536,
                                                    beta_fast=32.0, beta_slow=1.0)).cuda()
    q = _joined(t, 64, 512, torch.bfloat16, g, "cuda")
    kv = (torch.randn(t, 1024 + 512, generator=g) * 3).cuda().bfloat16()[:, 1024:]
    norm = _norm(512, g).cuda()
    pos = torch.randint(0, 1 << 20, (t,), generator=g).cuda()
    assert rotary._fused_norm_rope(q) is dsv4_qk_norm_rope and rotary._fused_norm_rope(kv) is dsv4_qk_norm_rope
    for x, w in ((q, None), (kv, norm)):
        got = rot.apply_normed(x, pos, EPS if w is None else w)
        assert torch.equal(got, dsv4_qk_norm_rope(x, None if w is None else w.weight, EPS, pos, rot.inv_freq))
        xf = x.float()
        ref = xf * torch.rsqrt(xf.square().mean(-1, keepdim=True) + EPS)
        ref = ref if w is None else ref * w.weight
        ref = rotary.apply_rotary(ref.to(x.dtype), *rot.cos_sin(pos))
        torch.testing.assert_close(got.float(), ref.float(), atol=3e-2, rtol=2e-2)
        two = dsv4_rope(dsv4_rms_norm(x, None if w is None else w.weight, EPS), pos, rot.inv_freq)
        step = two.float().abs().clamp_min(1e-30) * 2.0 ** -7  # one bf16 step (8 significant bits)
        assert ((got.float() - two.float()).abs() <= step).all()

    def inputs(seed):
        gs = torch.Generator().manual_seed(1000 + seed)
        return (torch.randn(q.shape, generator=gs).cuda().bfloat16(),
                torch.randn(kv.shape, generator=gs).cuda().bfloat16(),
                torch.randint(0, 1 << 20, (t,), generator=gs).cuda())

    def run():
        return torch.cat((rot.apply_normed(q, pos, EPS).flatten(1), rot.apply_normed(kv, pos, norm)), dim=1)

    assert_replays_equal(run, run, (q, kv, pos), inputs, range(3))
