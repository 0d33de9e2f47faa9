"""dsv4_store_kv: byte-identical to the engine's cache formats (kv_formats.py), and readable by the attention.

The comparisons are exact (torch.equal on the raw bytes): e4m3 and bf16 rounding, the ue8m0 exponent and the
pad bytes must all agree with `Fp8KVFormat.store` / `DenseFormat.store`.
"""

from __future__ import annotations

import pytest
import torch

from sglang.srt.mem_cache.kv_formats import DenseFormat, Fp8KVFormat
from sgl_kernel.dsv4_sparse_attention import dsv4_sparse_attention, dsv4_sparse_attention_ref
from sgl_kernel.dsv4_store_kv import dsv4_store_kv, dsv4_store_kv_ref, fp8_kv_row_bytes

needs_gpu = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")


def _bytes(x: torch.Tensor) -> torch.Tensor:
    return x.contiguous().view(torch.uint8)


def assert_same_bytes(name: str, expected: torch.Tensor, got: torch.Tensor) -> None:
    e, g = _bytes(expected), _bytes(got)
    diff = (e != g).nonzero()
    assert diff.numel() == 0, (f"{name}: {diff.shape[0]} differing bytes, first at {tuple(diff[0].tolist())}: "
                               f"expected {e[tuple(diff[0])].item():#04x}, got {g[tuple(diff[0])].item():#04x}")


def _values(n: int, d: int, gen: torch.Generator) -> torch.Tensor:
    """Rows of very different magnitudes plus the corner cases of the quantizer."""
    v = torch.randn(n, d, generator=gen) * torch.logspace(-8, 4, n)[:, None]
    v[0] = 0.0  # all-zero blocks: the 1e-4 amax floor
    v[1] = -0.0
    v[2, :64] = 448.0  # amax exactly 448 (e = 0)
    v[3, :64] = torch.linspace(-449.0, 449.0, 64)  # amax just over 448 (e = 1)
    v[4] = 1e-30  # far below the floor: e4m3 subnormals / zeros
    v[5, -8:] = 1.0 + 2.0 ** -8  # bf16 ties in the rope part (round to even: 1.0)
    v[6, -8:] = 1.0 + 3 * 2.0 ** -8  # (round to even: 1 + 2^-6)
    return v


def _e4m3_tie_block() -> torch.Tensor:
    """One 64-block with amax 448 (scale 1) holding e4m3 midpoints and their fp32 neighbours."""
    grid = torch.arange(0, 127, dtype=torch.int32).to(torch.uint8).view(torch.float8_e4m3fn).float()  # 0 .. 448
    mids = (grid[:-1] + grid[1:]) / 2
    vals = torch.stack([mids, torch.nextafter(mids, torch.zeros_like(mids)), torch.nextafter(mids, mids + 1)], -1)
    vals = torch.cat([vals.flatten(), -vals.flatten()])
    pad = (-vals.numel()) % 63
    vals = torch.cat([vals, torch.zeros(pad)]).view(-1, 63)
    return torch.cat([torch.full((vals.shape[0], 1), 448.0), vals], dim=1)  # [rows, 64]


@pytest.mark.parametrize("dim,rope", [(96, 32), (512, 64)])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.float16])
def test_fp8_store_matches_engine(dim, rope, dtype):
    gen = torch.Generator().manual_seed(dim)
    fmt = Fp8KVFormat(dim, rope)
    assert fp8_kv_row_bytes(dim, rope) == fmt.bytes_per_entry
    values = _values(24, dim, gen).to(dtype)
    slots = torch.randperm(64, generator=gen)[:24]
    expected = fmt.allocate(64)
    fmt.store(expected, slots, values)
    got = torch.full_like(expected, 0xAB)
    got[~torch.isin(torch.arange(64), slots)] = 0  # untouched rows must stay as they were
    dsv4_store_kv(got, slots, values, fp8_rope_dim=rope)
    assert_same_bytes(f"fp8 D={dim} {dtype} kernel", expected, got)
    ref = fmt.allocate(64)
    dsv4_store_kv_ref(ref, slots, values, fp8_rope_dim=rope)
    assert_same_bytes(f"fp8 D={dim} {dtype} ref", expected, ref)


def test_fp8_e4m3_ties_round_to_even():
    block = _e4m3_tie_block()  # [rows, 64]
    values = torch.cat([block, torch.zeros(block.shape[0], 32)], dim=1)  # D = 96, rope 32
    fmt = Fp8KVFormat(96, 32)
    slots = torch.arange(block.shape[0])
    expected, got = fmt.allocate(block.shape[0]), fmt.allocate(block.shape[0])
    fmt.store(expected, slots, values)
    dsv4_store_kv(got, slots, values, fp8_rope_dim=32)
    assert_same_bytes("e4m3 ties", expected, got)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.float16])
def test_dense_store_matches_engine(dtype):
    gen = torch.Generator().manual_seed(7)
    fmt = DenseFormat(96, dtype)
    values = _values(16, 96, gen).clamp(-6e4, 6e4)  # inside the fp16 range
    slots = torch.randperm(40, generator=gen)[:16].to(torch.int32)
    expected, got = fmt.allocate(40), fmt.allocate(40)
    fmt.store(expected, slots.long(), values)
    dsv4_store_kv(got, slots, values)
    assert_same_bytes(f"dense {dtype}", expected, got)


def test_negative_slots_are_skipped():
    values = torch.randn(4, 96)
    cache = torch.zeros(8, fp8_kv_row_bytes(96, 32), dtype=torch.uint8)
    dsv4_store_kv(cache, torch.tensor([-1, 3, -1, 5]), values, fp8_rope_dim=32)
    expected = torch.zeros_like(cache)
    Fp8KVFormat(96, 32).store(expected, torch.tensor([3, 5]), values[[1, 3]])
    assert_same_bytes("negative slots", expected, cache)


def test_store_then_attend():
    """Keys written by the kernel and read back by dsv4_sparse_attention == the ref on the dequantized cache."""
    gen = torch.Generator().manual_seed(11)
    d, rope, h, t, w, k = 96, 32, 4, 4, 16, 24
    fmt = Fp8KVFormat(d, rope)
    win_cache, ext_cache = fmt.allocate(64), fmt.allocate(64)
    dsv4_store_kv(win_cache, torch.randperm(64, generator=gen), torch.randn(64, d, generator=gen), fp8_rope_dim=rope)
    dsv4_store_kv(ext_cache, torch.randperm(64, generator=gen), torch.randn(64, d, generator=gen), fp8_rope_dim=rope)
    win = torch.randint(0, 64, (t, w), generator=gen)
    lists = torch.randint(0, 64, (t, k), generator=gen)
    lists[:, -5:] = -1
    q, sink = torch.randn(t, h, d, generator=gen), torch.randn(h, generator=gen)
    kw = dict(sink=sink, softmax_scale=d ** -0.5)
    out = dsv4_sparse_attention(q, win_cache, win, ext_cache, lists, fp8_rope_dim=rope, **kw)
    dense_win, dense_ext = fmt.dequantize(win_cache), fmt.dequantize(ext_cache)  # engine's decoder, fp32
    ref = dsv4_sparse_attention_ref(q, dense_win, win, dense_ext, lists, **kw)
    err = (out - ref).abs().max().item()
    assert err <= 1e-5, f"store->attend: max abs err {err:.3e} vs the ref on the dequantized cache"


@pytest.mark.gpu
@needs_gpu
@pytest.mark.parametrize("n", [1, 64, 4096])
@pytest.mark.parametrize("fp8", [True, False], ids=["fp8", "bf16"])
def test_gpu_store_flash_shapes(n, fp8):
    gen = torch.Generator().manual_seed(n)
    fmt = Fp8KVFormat(512, 64) if fp8 else DenseFormat(512, torch.bfloat16)
    values = _values(n, 512, gen).to(torch.bfloat16).cuda() if n >= 8 else torch.randn(n, 512).bfloat16().cuda()
    slots = torch.randperm(2 * n + 7, generator=gen)[:n].cuda()
    expected, got = fmt.allocate(2 * n + 7, "cuda"), fmt.allocate(2 * n + 7, "cuda")
    fmt.store(expected, slots, values)
    dsv4_store_kv(got, slots, values, fp8_rope_dim=64 if fp8 else 0)
    assert_same_bytes(f"gpu store n={n} fp8={fp8}", expected, got)
