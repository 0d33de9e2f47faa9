"""Cache entry formats (mem_cache/kv_formats.py: each names its row layout, encoded by sgl_kernel's one definition in
dsv4_formats_ref) and the indexer Hadamard rotation.

Error bounds used below (x = one value, amax = its block's max |x|, s = the block scale):
* FP8 e4m3 (3 mantissa bits): round-to-nearest error <= 2^-4 |x| for normals; with
  amax/s in (224, 448] (ue8m0) or == 448 (fp32 scale) every block error is <= 2^-4 amax.
* FP4 e2m1 with s = 2^ceil(log2(amax/6)) so amax/s in (3, 6]: grid spacing is 0.5 on
  [0, 2), 1 on [2, 4), 2 on [4, 6], hence |err| <= s/4 on [0, 2) and <= |x|/4 above, i.e.
  |err| <= max(|x|, s)/4 <= amax/4 per 32-block (s/4 < amax/12).
"""

from __future__ import annotations

import math
from fractions import Fraction

import pytest
import torch

from sgl_kernel.dsv4_formats_ref import ROW_FORMATS, row_width
from sglang.srt.layers.attention.dsv4.hadamard import hadamard_rotate
from sglang.srt.mem_cache.kv_formats import (
    DenseFormat,
    EntryFormat,
    Fp4IndexKeyFormat,
    Fp8IndexKeyFormat,
    Fp8KVFormat,
    make_index_key_format,
    make_kv_format,
)
from sglang.srt.server_args import KV_CACHE_DTYPES

E2M1_GRID = torch.tensor([0.0, 0.5, 1.0, 1.5, 2.0, 3.0, 4.0, 6.0])


def _gen(seed: int = 0) -> torch.Generator:
    return torch.Generator().manual_seed(seed)


def _sylvester(d: int) -> torch.Tensor:
    h = torch.ones(1, 1, dtype=torch.float64)
    while h.shape[0] < d:
        h = torch.cat([torch.cat([h, h], 1), torch.cat([h, -h], 1)], 0)
    return h / math.sqrt(d)


def _blocks(x: torch.Tensor, b: int) -> torch.Tensor:
    return x.reshape(*x.shape[:-1], -1, b)


# ----------------------------------------------------------------------------- hadamard


@pytest.mark.parametrize("d", [1, 2, 8, 64, 128, 512])
def test_hadamard_matches_sylvester_and_is_orthonormal(d):
    eye = torch.eye(d)
    h = hadamard_rotate(eye)  # rows of I -> rows of H^T == H (symmetric)
    torch.testing.assert_close(h.double(), _sylvester(d), atol=1e-6, rtol=0)
    torch.testing.assert_close(h @ h.T, eye, atol=1e-5, rtol=0)
    torch.testing.assert_close(hadamard_rotate(h), eye, atol=1e-5, rtol=0)  # self-inverse


def test_hadamard_preserves_norms_and_dot_products_any_leading_shape():
    g = _gen()
    q, k = torch.randn(3, 5, 128, generator=g), torch.randn(3, 5, 128, generator=g)
    hq, hk = hadamard_rotate(q), hadamard_rotate(k)
    assert hq.shape == q.shape
    torch.testing.assert_close(hq.norm(dim=-1), q.norm(dim=-1), rtol=1e-5, atol=1e-5)
    torch.testing.assert_close((hq * hk).sum(-1), (q * k).sum(-1), rtol=1e-4, atol=1e-4)
    hb = hadamard_rotate(q.bfloat16())
    assert hb.dtype == torch.bfloat16
    torch.testing.assert_close(hb.float(), hadamard_rotate(q.bfloat16().float()).bfloat16().float())


def test_hadamard_rejects_non_power_of_two():
    with pytest.raises(ValueError, match="96"):
        hadamard_rotate(torch.zeros(2, 96))


# ----------------------------------------------------------------------------- sizes


@pytest.mark.parametrize(
    "fmt, nbytes",
    [
        (Fp8KVFormat(512, 64), 584),  # 448 + 128 + 7 + 1 pad
        (Fp8KVFormat(96, 32), 136),  # 64 + 64 + 1 -> 129 -> pad to 136
        (Fp8IndexKeyFormat(128), 132),
        (Fp8IndexKeyFormat(64), 68),  # 64 + one fp32 scale
        (Fp4IndexKeyFormat(128), 68),
        (Fp4IndexKeyFormat(64), 34),  # 32 + 2
        (DenseFormat(512, torch.bfloat16), 1024),
        (DenseFormat(128, torch.bfloat16), 256),
        (DenseFormat(128, torch.float32), 512),
    ],
)
def test_bytes_per_entry_and_allocate(fmt, nbytes):
    assert fmt.bytes_per_entry == nbytes
    buf = fmt.allocate(7, "cpu")
    assert buf.shape[0] == 7 and buf.numel() * buf.element_size() == 7 * nbytes
    assert not buf.any()
    assert fmt.dequantize(buf).shape == (7, fmt.dim) and not fmt.dequantize(buf).any()


def test_bad_dims_raise_naming_value():
    with pytest.raises(ValueError, match="100"):
        Fp8KVFormat(164, 64)  # nope 100
    with pytest.raises(ValueError, match="48"):
        Fp4IndexKeyFormat(48)


# ----------------------------------------------------------------------------- dense


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.float16])
def test_dense_is_exact_in_its_dtype(dtype):
    x = torch.randn(9, 40, generator=_gen())
    fmt = DenseFormat(40, dtype)
    buf = fmt.allocate(12)
    assert buf.dtype == dtype
    fmt.store(buf, torch.arange(9) + 3, x)
    out = fmt.load(buf, torch.arange(9) + 3)
    assert out.dtype == torch.float32
    assert torch.equal(out, x.to(dtype).float())


# ----------------------------------------------------------------------------- fp8 main KV


def _reference_fp8_sim(x: torch.Tensor, nope: int) -> torch.Tensor:
    """Arch 5.2 QAT simulation, written independently: per-64 ue8m0 e4m3 nope, bf16 rope."""
    b = _blocks(x[..., :nope].double(), 64)
    amax = b.abs().amax(-1, keepdim=True).clamp_min(1e-4)
    s = torch.exp2(torch.ceil(torch.log2(amax / 448)))
    q = (b / s).clamp(-448, 448).float().to(torch.float8_e4m3fn).double() * s
    return torch.cat([q.reshape(*x.shape[:-1], nope), x[..., nope:].bfloat16().double()], -1).float()


@pytest.mark.parametrize("dim, rope", [(512, 64), (96, 32), (128, 0)])
def test_fp8_kv_round_trip(dim, rope):
    g = _gen()
    x = torch.randn(33, dim, generator=g) * torch.logspace(-3, 3, 33).unsqueeze(-1)
    x[0] = 0.0  # all-zero entry: amax floor keeps the scale finite
    x[1, :64] = 1e-6  # tiny block under the 1e-4 floor
    fmt = Fp8KVFormat(dim, rope)
    rows = fmt.quantize(x)
    y = fmt.dequantize(rows)
    nope = dim - rope

    assert torch.equal(y, _reference_fp8_sim(x, nope))
    assert torch.equal(y[0], torch.zeros(dim))
    # rope part is exactly bf16(x), stored as raw bf16 bytes right after the nope bytes
    assert torch.equal(y[:, nope:], x[:, nope:].bfloat16().float())
    assert torch.equal(rows[:, nope : nope + 2 * rope].contiguous().view(torch.bfloat16), x[:, nope:].bfloat16())
    # per-64 block error <= 2^-4 of the block amax
    err = _blocks((y[:, :nope] - x[:, :nope]).abs(), 64).amax(-1)
    amax = _blocks(x[:, :nope].abs(), 64).amax(-1)
    assert (err <= amax * 2**-4).all()
    # scale bytes are ue8m0 = 127 + ceil(log2(max(amax, 1e-4) / 448)); pad bytes are zero
    sb = rows[:, fmt.scale_offset : fmt.scale_offset + nope // 64].long()
    want = 127 + torch.ceil(torch.log2(amax.double().clamp_min(1e-4) / 448)).long()
    assert torch.equal(sb, want)
    assert not rows[:, fmt.scale_offset + nope // 64 :].any()


def test_fp8_kv_saturates_instead_of_nan():
    # amax exactly 448 * 2^k: the scaled max is 448; neighbours rounding upward must clamp.
    x = torch.full((1, 128), 447.9)
    x[0, 0] = 448.0
    y = Fp8KVFormat(128, 64).round_trip(x)
    assert torch.isfinite(y).all() and y[0, :64].abs().max() == 448.0


def test_ue8m0_scale_at_power_of_two_boundaries():
    # amax == qmax * 2^k is the last amax that gets scale 2^k; the next float up gets 2^(k+1).
    for fmt, qmax, nblk, off in [(Fp8KVFormat(128, 64), 448.0, 1, 64 + 128), (Fp4IndexKeyFormat(32), 6.0, 1, 16)]:
        for k in (-20, -3, 0, 5):
            amax = torch.tensor([qmax * 2.0**k], dtype=torch.float32)
            for bump, want in ((0, 127 + k), (1, 128 + k)):
                x = torch.zeros(1, fmt.dim)
                x[0, 0] = torch.nextafter(amax, torch.tensor(math.inf)) if bump else amax
                assert fmt.quantize(x)[0, off].item() == want, (fmt.name, k, bump)


# ----------------------------------------------------------------------------- index keys


@pytest.mark.parametrize("dim", [128, 64, 200])
def test_fp8_index_key_round_trip(dim):
    x = torch.randn(20, dim, generator=_gen()) * torch.logspace(-4, 4, 20).unsqueeze(-1)
    x[3] = 0.0
    fmt = Fp8IndexKeyFormat(dim)
    rows = fmt.quantize(x)
    y = fmt.dequantize(rows)
    assert torch.equal(y[3], torch.zeros(dim))
    for b0 in range(0, dim, 128):
        blk = slice(b0, min(b0 + 128, dim))
        amax = x[:, blk].abs().amax(-1)
        assert ((y[:, blk] - x[:, blk]).abs().amax(-1) <= amax * 2**-4).all()
    scales = rows[:, dim:].contiguous().view(torch.float32)[:, 0]
    want = x[:, :128].abs().amax(-1) / 448
    want[3] = 1.0  # zero block: guarded scale
    assert torch.equal(scales, want)


def test_fp4_encoding_is_nearest_code_ties_to_even():
    fmt = Fp4IndexKeyFormat(32)
    # scale 1 (amax 6): every grid value and sign is exact
    x = torch.cat([E2M1_GRID, -E2M1_GRID, E2M1_GRID.flip(0), -E2M1_GRID.flip(0)]).unsqueeze(0)
    assert torch.equal(fmt.round_trip(x), x)
    # brute-force nearest code on random values in [-6, 6] (scale stays 1 via x[0] = 6)
    v = (torch.rand(64, 32, generator=_gen()) * 12 - 6).clamp(-5.99, 5.99)
    v[:, 0] = 6.0
    y = fmt.round_trip(v)
    d_best = (v.abs().unsqueeze(-1) - E2M1_GRID).abs().amin(-1)
    assert torch.equal((y - v).abs(), d_best)
    # midpoints go to the even code (0, 1.0, 1.0, 2.0, 2.0, 4.0, 4.0)
    mids = torch.tensor([0.25, 0.75, 1.25, 1.75, 2.5, 3.5, 5.0])
    row = torch.zeros(1, 32)
    row[0, 0], row[0, 1:8] = 6.0, mids
    assert torch.equal(fmt.round_trip(row)[0, 1:8], torch.tensor([0.0, 1.0, 1.0, 2.0, 2.0, 4.0, 4.0]))


def test_fp4_byte_layout():
    fmt = Fp4IndexKeyFormat(64)
    x = torch.zeros(1, 64)
    x[0, 0], x[0, 1] = 6.0, -0.5  # codes 7 and 8|1 = 9 -> byte 0x97 (low nibble = even index)
    x[0, 32] = 0.75  # second block: amax 0.75 -> s = 2^ceil(log2(0.125)) = 2^-3 -> byte 124
    rows = fmt.quantize(x)
    assert rows[0, 0].item() == 0x97
    assert rows[0, 32].item() == 127 and rows[0, 33].item() == 124
    assert torch.equal(fmt.dequantize(rows), x)


@pytest.mark.parametrize("dim", [128, 64])
def test_fp4_index_key_round_trip_bound(dim):
    x = torch.randn(50, dim, generator=_gen()) * torch.logspace(-3, 3, 50).unsqueeze(-1)
    x[7] = 0.0
    fmt = Fp4IndexKeyFormat(dim)
    y = fmt.round_trip(x)
    assert torch.equal(y[7], torch.zeros(dim))
    xb, eb = _blocks(x, 32), _blocks((y - x).abs(), 32)
    amax = xb.abs().amax(-1, keepdim=True)
    s = torch.exp2(torch.ceil(torch.log2(amax / 6)))
    assert (eb <= torch.maximum(xb.abs(), s) / 4).all()  # per element
    assert (eb.amax(-1, keepdim=True) <= amax / 4).all()  # per block


# ----------------------------------------------------------------------------- store / load

ALL_FORMATS = [
    DenseFormat(64, torch.float32),
    DenseFormat(64, torch.bfloat16),
    Fp8KVFormat(128, 64),
    Fp8KVFormat(96, 32),
    Fp8IndexKeyFormat(64),
    Fp8IndexKeyFormat(128),
    Fp4IndexKeyFormat(64),
    Fp4IndexKeyFormat(128),
]


@pytest.mark.parametrize("fmt", ALL_FORMATS, ids=lambda f: f"{type(f).__name__}-{f.dim}-{f.name}")
def test_store_scattered_then_load_any_shape(fmt: EntryFormat):
    g = _gen()
    n, cap = 10, 40
    x = torch.randn(n, fmt.dim, generator=g)
    slots = torch.randperm(cap, generator=g)[:n]
    buf = fmt.allocate(cap)
    fmt.store(buf, slots, x)
    # arbitrary [T, K] gather with repeats, plus never-written (zero) slots
    where = torch.randint(0, n, (3, 5), generator=g)
    out = fmt.load(buf, slots[where])
    assert out.shape == (3, 5, fmt.dim) and out.dtype == torch.float32
    assert torch.equal(out, fmt.round_trip(x)[where])
    free = torch.tensor(sorted(set(range(cap)) - set(slots.tolist()))[:4])
    assert not fmt.load(buf, free).any()
    assert fmt.load(buf, slots[0]).shape == (fmt.dim,)  # 0-d slot


@pytest.mark.parametrize("fmt", ALL_FORMATS, ids=lambda f: f"{type(f).__name__}-{f.dim}-{f.name}")
def test_each_format_names_its_kernel_row_layout(fmt: EntryFormat):
    assert fmt.kernel_format in ROW_FORMATS
    assert fmt.row_width == row_width(fmt.kernel_format, fmt.dim, fmt.fp8_rope_dim, fmt.storage_dtype)
    assert fmt.fp8_rope_dim == (fmt.rope_dim if isinstance(fmt, Fp8KVFormat) else 0)
    assert (fmt.storage_dtype == torch.uint8) == (fmt.kernel_format != "dense")


# ----------------------------------------------------------------------------- factories


def test_every_kv_cache_dtype_flag_value_has_a_format():
    kernel_formats = {make_kv_format(v, 512, 64, torch.bfloat16).kernel_format for v in KV_CACHE_DTYPES}
    assert kernel_formats == {"dense", "fp8_kv"}


def test_factories():
    assert make_kv_format("auto", 512, 64, torch.bfloat16) == DenseFormat(512, torch.bfloat16)
    assert make_kv_format("float32", 512, 64, torch.bfloat16) == DenseFormat(512, torch.float32)
    assert make_kv_format("bfloat16", 512, 64, torch.float32) == DenseFormat(512, torch.bfloat16)
    assert make_kv_format("fp8_e4m3", 512, 64, torch.bfloat16) == Fp8KVFormat(512, 64)
    for kind in ("auto", "exact"):
        assert make_index_key_format(kind, 128, torch.float32) == DenseFormat(128, torch.float32)
    assert make_index_key_format("fp8", 128, torch.bfloat16) == Fp8IndexKeyFormat(128)
    assert make_index_key_format("fp4", 128, torch.bfloat16) == Fp4IndexKeyFormat(128)
    with pytest.raises(ValueError, match=r"'fp8_e5m2'.*fp8_e4m3"):
        make_kv_format("fp8_e5m2", 512, 64, torch.bfloat16)
    with pytest.raises(ValueError, match=r"'int4'.*fp4"):
        make_index_key_format("int4", 128, torch.bfloat16)


# ----------------------------------------------------------------------------- indexer score


def _index_score(q: torch.Tensor, w: torch.Tensor, k: torch.Tensor) -> torch.Tensor:
    """I(t, j) = sum_h w[t, h] * relu(q[t, h] . k[j])  -> [T, N]."""
    return (torch.einsum("thd,jd->thj", q, k).relu() * w.unsqueeze(-1)).sum(1)


def _quantized_score(kind: str, q, w, k) -> torch.Tensor:
    fmt = make_index_key_format(kind, k.shape[-1], torch.float32)
    if kind == "fp4":  # arch 5.5: rotate both sides, quantize only the key
        q, k = hadamard_rotate(q), hadamard_rotate(k)
    buf = fmt.allocate(k.shape[0])
    fmt.store(buf, torch.arange(k.shape[0]), k)
    return _index_score(q, w, fmt.load(buf, torch.arange(k.shape[0])))


def _topk_overlap(a: torch.Tensor, b: torch.Tensor, k: int = 8) -> float:
    ia, ib = a.topk(k).indices, b.topk(k).indices
    return (ia.unsqueeze(-1) == ib.unsqueeze(-2)).any(-1).float().mean().item()


# Measured max|dI| / max|I| (seed 0, T=32, N=64, Gaussian q/k; max over seeds 0-9 in []),
# and top-8-of-64 overlap with the exact top-8 (seed 0; min over seeds 0-9 in []):
#   nI  dI   fp8              fp4 (Hadamard)
#   16  64   0.025 [.030] .97 [.97]   0.130 [.165] .88 [.87]
#   16  128  0.025 [.033] .98 [.96]   0.109 [.179] .89 [.87]
#   64  64   0.026 [.032] .97 [.95]   0.114 [.157] .89 [.88]
#   64  128  0.030 [.038] .98 [.96]   0.121 [.148] .88 [.87]
# Bounds below: ~1.6x the worst measured value; overlap floors well under the measured.
SCORE_TOL = {"fp8": 0.06, "fp4": 0.28}
OVERLAP_MIN = {"fp8": 0.85, "fp4": 0.7}


@pytest.mark.parametrize("kind", ["fp8", "fp4"])
@pytest.mark.parametrize("n_heads, d_index", [(16, 64), (16, 128), (64, 64), (64, 128)])
def test_indexer_score_with_quantized_keys(kind, n_heads, d_index):
    g = _gen(0)
    T, N = 32, 64
    q = torch.randn(T, n_heads, d_index, generator=g)
    w = torch.randn(T, n_heads, generator=g) * (d_index * n_heads) ** -0.5  # arch 5.5 step 3 scale
    k = torch.randn(N, d_index, generator=g)
    exact = _index_score(q, w, k)
    approx = _quantized_score(kind, q, w, k)
    rel = ((approx - exact).abs().max() / exact.abs().max()).item()
    assert rel <= SCORE_TOL[kind], f"{kind} nI={n_heads} dI={d_index}: rel err {rel:.4f}"
    assert _topk_overlap(approx, exact) >= OVERLAP_MIN[kind]
    # exact path through the dense format reproduces the reference score
    torch.testing.assert_close(_quantized_score("exact", q, w, k), exact)


def test_hadamard_helps_fp4_with_outlier_channels():
    # Real keys have a few large channels; the rotation spreads them over all 32-blocks.
    # Measured relative Frobenius error, seeds 0-3: rotated 0.10-0.13 vs plain 0.15-0.19.
    g = _gen(0)
    q, w, k = torch.randn(32, 16, 128, generator=g), torch.randn(32, 16, generator=g), torch.randn(64, 128, generator=g)
    k[:, :4] *= 10
    exact = _index_score(q, w, k)
    fmt = Fp4IndexKeyFormat(128)
    rotated = _index_score(hadamard_rotate(q), w, fmt.round_trip(hadamard_rotate(k)))
    plain = _index_score(q, w, fmt.round_trip(k))
    e_rot, e_plain = ((s - exact).norm() / exact.norm() for s in (rotated, plain))
    assert e_rot < 0.85 * e_plain


# ----------------------------------------------------------------------------- sizes at 1M


def _growth_per_token(main: EntryFormat, index: EntryFormat, n_csa: int, n_hca: int) -> Fraction:
    """Bytes per context token: CSA adds a main entry + an index key every 4 tokens, HCA a main entry every 128."""
    csa = Fraction(main.bytes_per_entry, 4) + Fraction(index.bytes_per_entry, 4)
    return n_csa * csa + n_hca * Fraction(main.bytes_per_entry, 128)


@pytest.mark.parametrize(
    "n_csa, n_hca, fp8_bytes, bf16_bytes",
    [(21, 20, Fraction(14057, 4), 6880), (30, 31, 5031, 9848)],  # Flash 3,514.25 B; Pro 5,031.4 B
)
def test_per_token_growth_matches_arch_doc(n_csa, n_hca, fp8_bytes, bf16_bytes):
    fp8 = _growth_per_token(make_kv_format("fp8_e4m3", 512, 64, torch.bfloat16),
                            make_index_key_format("fp4", 128, torch.bfloat16), n_csa, n_hca)
    bf16 = _growth_per_token(make_kv_format("auto", 512, 64, torch.bfloat16),
                             make_index_key_format("auto", 128, torch.bfloat16), n_csa, n_hca)
    assert round(fp8) == round(fp8_bytes) and bf16 == bf16_bytes
    if n_csa == 21:
        assert fp8 == Fraction(351425, 100)


def test_bench_kv_cache_dtype_dry_run(tmp_path):
    """benchmark/bench_kv_cache_dtype.py on CPU (the tiny model): every engine against the exact one; the FP8 cache
    moves the logprobs even at fp32 compute (it quantizes), the bf16 cache stays close."""
    import json
    import os
    import subprocess
    import sys

    script = os.path.join(os.path.dirname(__file__), "..", "..", "benchmark", "bench_kv_cache_dtype.py")
    out_json = tmp_path / "kv.json"
    out = subprocess.run([sys.executable, script, "--device", "cpu", "--model-path", "tiny-deepseek-v4", "--tokens",
                          "200", "--out", str(out_json)], capture_output=True, text=True, timeout=600)
    assert out.returncode == 0, out.stderr[-3000:]
    rows = {r["label"]: r for r in json.loads(out_json.read_text())["agreement"]}
    assert len(rows) == 6 and all(r["tokens"] == 200 for r in rows.values()), rows.keys()
    assert rows["fp32, fp8 KV vs exact"]["mean_abs_logprob_diff"] > 1e-3
    assert rows["bf16, bf16 KV vs exact"]["mean_abs_logprob_diff"] < 0.2
