"""dsv4_compress / dsv4_update_ring against the torch reference (what the engine's torch backend runs) and against
the model's own modules: the channel-wise pool, then the Compressor's RMSNorm and RoPE modules,
hadamard_rotate for index keys (arch 5.5, as the queries are rotated before scoring) and the entry format's store,
run on plans from the engine's build_compress_plan.

Tolerances (kernel vs reference / model modules; reference vs model modules is byte-identical):
* Exact inputs (one-hot gates, +-1 contents, eps = 0, zero RoPE frequencies): every stage is exact in fp32, so the
  rows are byte-identical in all formats, compute dtypes and with Hadamard: the bf16 / fp16 / e4m3 / e2m1 / ue8m0
  encoders and the row layouts match the engine bit for bit.
* Random inputs: the float pipeline (exp, summation orders, sqrt, cos/sin) differs by a few fp32 ulps, so
  dense fp32 rows agree to 1e-5 of the row's max |value|; a value within that distance of a rounding boundary may
  move by one step of the compute dtype or of the quantization grid: at most 2% of the bytes differ, and each
  dequantized value differs by at most one grid step at the row max (bf16 2^-7, fp16 2^-10, e4m3 2^-3 relative to
  the row max; e2m1 2/3 of it, the top grid step being 2 s with s <= amax / 3).
"""

from __future__ import annotations

from types import SimpleNamespace

import pytest
import torch
import triton
import triton.language as tl

from sgl_kernel.dsv4_attention_ref import pool_ref
from sgl_kernel.dsv4_compress import (
    _bf16_bits, _e2m1_code, _e4m3_code, dsv4_compress, dsv4_compress_ref, dsv4_update_ring)
from sgl_kernel.dsv4_formats_ref import e2m1_codes, e4m3_bytes, row_width

CUDA = torch.cuda.is_available()
DEVICE = "cuda" if CUDA else "cpu"
GRID_STEP = {"dense": None, "fp8_kv": 2.0 ** -3, "fp8_index": 2.0 ** -3, "fp4_index": 2.0 / 3.0}
DENSE_STEP = {torch.float32: 1e-5, torch.bfloat16: 2.0 ** -7, torch.float16: 2.0 ** -10}


def assert_close(name: str, actual: torch.Tensor, expected: torch.Tensor, atol: float) -> None:
    """NaN check first, then max-abs error against atol; reports the relative-RMS error with the tensor name."""
    a, e = actual.double(), expected.double()
    assert not torch.isnan(a).any(), f"{name}: NaN in the kernel output"
    diff = (a - e).abs()
    rel_rms = (diff.square().mean() / e.square().mean().clamp_min(1e-30)).sqrt().item()
    err = diff.max().item()
    assert err <= atol, f"{name}: max abs err {err:.3g} > {atol:.3g} (rel-RMS {rel_rms:.3g})"


# ----------------------------------------------------------------------------- encoders


@triton.jit
def _encode_kernel(x_ptr, e4m3_ptr, e2m1_ptr, bf16_ptr, n, BLOCK: tl.constexpr):
    offs = tl.program_id(0) * BLOCK + tl.arange(0, BLOCK)
    x = tl.load(x_ptr + offs, mask=offs < n)
    tl.store(e4m3_ptr + offs, _e4m3_code(x), mask=offs < n)
    tl.store(e2m1_ptr + offs, _e2m1_code(x), mask=offs < n)
    tl.store(bf16_ptr + offs, _bf16_bits(x), mask=offs < n)


def test_bit_encoders_match_torch_casts():
    """e4m3 / e2m1 / bf16 encoders on every e4m3 value, their midpoints (ties), +-1 ulp, subnormals, saturation."""
    grid = torch.arange(256, dtype=torch.uint8).view(torch.float8_e4m3fn).float()
    grid = grid[grid.isfinite() & (grid >= 0)].sort().values.double()
    mids = (grid[1:] + grid[:-1]) / 2
    base = torch.cat((grid, mids, torch.tensor([500.0, 1e6, 2.0 ** -12, 1e-30])), 0).float()
    near = torch.cat((base, torch.nextafter(base, torch.full_like(base, 1e9)),
                      torch.nextafter(base, torch.zeros_like(base))))
    e2m1_ties = torch.tensor([0.25, 0.75, 1.25, 1.75, 2.5, 3.5, 5.0, 6.5, 7.0])
    x = torch.cat((near, -near, e2m1_ties, -e2m1_ties, torch.randn(4096) * 40, torch.tensor([0.0, -0.0])))
    x = x.to(DEVICE)
    outs = [torch.empty(x.numel(), dtype=torch.int32, device=DEVICE) for _ in range(3)]
    _encode_kernel[(triton.cdiv(x.numel(), 1024),)](x, *outs, x.numel(), BLOCK=1024)
    torch.testing.assert_close(outs[0], e4m3_bytes(x).to(torch.int32), rtol=0, atol=0)
    torch.testing.assert_close(outs[1], e2m1_codes(x).to(torch.int32), rtol=0, atol=0)
    torch.testing.assert_close(outs[2], x.to(torch.bfloat16).view(torch.int16).to(torch.int32) & 0xFFFF, rtol=0, atol=0)


# ----------------------------------------------------------------------------- cases

# (ratio, overlap, head_dim, rope_dim, [(prefix_len, extend_len) per request]) -> N new entries
PLANS = {
    "n0": [(5, 1), (2, 1)],
    "n1": [(7, 1)],
    "n7": [(0, 9), (13, 3), (6, 12), (23, 1)],
}
PLANS_RATIO8 = {"n0": [(5, 1)], "n1": [(31, 1)], "n7": [(0, 17), (5, 11), (31, 1), (40, 16)]}


def _engine_plan(ratio: int, overlap: bool, reqs: list):
    """The engine's CompressPlan for requests (prefix, extend), one ring of `ring_size` rows per request."""
    from sglang.srt.layers.attention.dsv4.metadata import build_compress_plan
    from sglang.srt.mem_cache.deepseek_v4_pool import ring_size

    b = len(reqs)
    forward_batch = SimpleNamespace(extend_prefix_lens_cpu=[p for p, _ in reqs],
                                    extend_seq_lens_cpu=[e for _, e in reqs], req_pool_indices_cpu=list(range(b)),
                                    req_pool_indices=torch.arange(b), positions=torch.zeros(1, dtype=torch.int64),
                                    req_to_token_pool=SimpleNamespace(req_to_token=torch.arange(b * 64).view(b, 64)))
    num_ring_rows = (b + 1) * ring_size(ratio, overlap)
    return build_compress_plan(forward_batch, ratio, overlap, page_size=64, num_draft_tokens=0,
                               num_ring_rows=num_ring_rows), \
        num_ring_rows, sum(e for _, e in reqs)


def _engine_format(out_format: str, d: int, rope: int, dense_dtype: torch.dtype):
    from sglang.srt.mem_cache import kv_formats as kf

    return {"dense": lambda: kf.DenseFormat(d, dense_dtype), "fp8_kv": lambda: kf.Fp8KVFormat(d, rope),
            "fp8_index": lambda: kf.Fp8IndexKeyFormat(d), "fp4_index": lambda: kf.Fp4IndexKeyFormat(d)}[out_format]()


def _engine_store(plan, ring, kv, gate, d, rope, inv_freq, weight, eps, compute_dtype, fmt, hadamard, num_slots):
    """The pooled windows through the model Compressor's norm and rotary (+ hadamard_rotate for index keys) and the
    entry format's store; the ring update by indexing -> (entry rows, ring after)."""
    from sglang.srt.layers.attention.dsv4.hadamard import hadamard_rotate
    from sglang.srt.layers.rotary import RotaryEmbedding
    from sglang.srt.models.deepseek_v4 import Compressor

    comp = Compressor(SimpleNamespace(hidden_size=8, rms_norm_eps=eps), 0, plan.ratio, d,
                      RotaryEmbedding(rope, 10000.0, None), is_indexer=hadamard).to(compute_dtype)
    comp.rotary.inv_freq = inv_freq.clone()  # fp32 table (.to() above would have cast it)
    comp.norm.weight.data.copy_(weight)
    buf = fmt.allocate(num_slots)
    fresh = torch.stack((kv, gate), dim=1)
    if plan.num_new:
        pooled = pool_ref(ring, fresh, plan.source_rows, plan.ratio, plan.overlap, d)
        entries = comp.rotary.apply(comp.norm(pooled.to(compute_dtype)), plan.entry_positions)
        fmt.store(buf, plan.entry_slots, hadamard_rotate(entries) if hadamard else entries)
    ring = ring.clone()
    ring[plan.ring_dst] = fresh[plan.ring_src]
    return buf, ring


def _inputs(ratio, overlap, d, rope, reqs, exact: bool, seed: int = 0):
    g = torch.Generator().manual_seed(seed)
    plan, num_ring_rows, t = _engine_plan(ratio, overlap, reqs)
    c = 2 * d if overlap else d
    ring, fresh = torch.randn(num_ring_rows, 2, c, generator=g), torch.randn(t, 2, c, generator=g)
    spread = 6 if exact else 2  # exact: wide range (e4m3 subnormals); random: keep most values above the fp4 grid
    weight = torch.randn(d, generator=g) * 2.0 ** torch.randint(-spread, spread, (d,), generator=g)
    inv_freq = 1.0 / 10000.0 ** (torch.arange(0, rope, 2, dtype=torch.float32) / rope)
    if exact:  # contents +-1, gates one-hot (0 / -1e30) per channel: the pool and the norm are exact
        for buf in (ring, fresh):
            buf[:, 0] = buf[:, 0].sign()
            buf[:, 1] = torch.where(torch.rand(buf[:, 1].shape, generator=g) < 0.5, 0.0, -1e30)
        inv_freq.zero_()
        # every entry needs exactly one slot with gate 0 per channel: keep the first valid one, mask the rest
        src = torch.cat((ring, fresh))
        for n in range(plan.num_new):
            seen = torch.zeros(d, dtype=torch.bool)
            for s, r in enumerate(plan.source_rows[n].tolist()):
                if r < 0:
                    continue
                half = d if overlap and s >= ratio else 0
                z = src[r, 1, half:half + d]
                pick = (z == 0) & ~seen
                if s == plan.source_rows.shape[1] - 1:
                    pick = ~seen
                z.copy_(torch.where(pick, 0.0, -1e30))
                seen |= pick
        ring, fresh = src[:num_ring_rows].clone(), src[num_ring_rows:].clone()
    return plan, ring, fresh, weight, inv_freq


def _cases():
    out = []
    for name, reqs in PLANS.items():
        out += [(4, True, 64, 32, reqs, name), (4, True, 96, 32, reqs, name)]
    for name, reqs in PLANS_RATIO8.items():
        out.append((8, False, 96, 32, reqs, name))
    return out


FORMATS = [("dense", False, torch.float32), ("dense", False, torch.bfloat16), ("fp8_kv", False, None),
           ("fp8_index", False, None), ("fp8_index", True, None), ("fp4_index", False, None),
           ("fp4_index", True, None)]


def _valid(out_format: str, d: int, rope: int, hadamard: bool) -> bool:
    if out_format == "fp8_kv" and (d - rope) % 64:
        return False
    if out_format == "fp4_index" and d % 32:
        return False
    return not hadamard or d & (d - 1) == 0


def _run_all(case, out_format, hadamard, dense_dtype, compute_dtype, exact):
    ratio, overlap, d, rope, reqs, _ = case
    plan, ring, fresh, weight, inv_freq = _inputs(ratio, overlap, d, rope, reqs, exact)
    weight = weight.to(compute_dtype).float()
    eps = 0.0 if exact else 1e-6
    dense_dtype = dense_dtype or torch.float32
    fmt = _engine_format(out_format, d, rope, dense_dtype)
    num_slots = 80
    eng_rows, eng_ring = _engine_store(plan, ring, fresh[:, 0], fresh[:, 1], d, rope, inv_freq, weight, eps,
                                       compute_dtype, fmt, hadamard, num_slots)
    rows = {}
    # the kernel runs on the GPU when there is one; the reference stays on the CPU, like the engine path above
    for fn, device in ((dsv4_compress, DEVICE), (dsv4_compress_ref, "cpu")):
        out = fmt.allocate(num_slots, device)
        dev = [x.to(device) for x in (ring, fresh, plan.source_rows, weight, plan.entry_positions, inv_freq,
                                      plan.entry_slots)]
        fn(dev[0], dev[1], dev[2], ratio=ratio, overlap=overlap, head_dim=d, norm_weight=dev[3], eps=eps,
           positions=dev[4], inv_freq=dev[5], rope_dim=rope, out_cache=out, out_slots=dev[6], out_format=out_format,
           hadamard=hadamard, compute_dtype=compute_dtype)
        rows[fn.__name__] = out.cpu()
        if fn is dsv4_compress:
            new_ring = dev[0].clone()
            dsv4_update_ring(new_ring, plan.ring_dst.to(device), dev[1], plan.ring_src.to(device))
            torch.testing.assert_close(new_ring.cpu(), eng_ring, rtol=0, atol=0)
    return fmt, eng_rows, rows["dsv4_compress"], rows["dsv4_compress_ref"]


def _as_bytes(rows: torch.Tensor) -> torch.Tensor:
    return rows.contiguous().view(torch.uint8)


@pytest.mark.parametrize("compute_dtype", [torch.float32, torch.bfloat16, torch.float16], ids=str)
@pytest.mark.parametrize("out_format,hadamard,dense_dtype", FORMATS, ids=lambda v: str(v))
@pytest.mark.parametrize("case", [c for c in _cases() if c[5] == "n7"] + [(4, True, 128, 64, PLANS["n7"], "n7")],
                         ids=lambda c: f"r{c[0]}-d{c[2]}")
def test_exact_inputs_store_the_engines_bytes(case, out_format, hadamard, dense_dtype, compute_dtype):
    if not _valid(out_format, case[2], case[3], hadamard):
        pytest.skip("format needs other dims")
    if compute_dtype == torch.float16 and case[2] != 128:
        pytest.skip("fp16 rounding: the d128 case suffices")
    _, engine, kernel, ref = _run_all(case, out_format, hadamard, dense_dtype, compute_dtype, exact=True)
    assert torch.equal(_as_bytes(ref), _as_bytes(engine)), "reference differs from the engine"
    assert torch.equal(_as_bytes(kernel), _as_bytes(engine)), \
        f"kernel differs from the engine in {(_as_bytes(kernel) != _as_bytes(engine)).sum().item()} bytes"


@pytest.mark.parametrize("compute_dtype", [torch.float32, torch.bfloat16], ids=str)
@pytest.mark.parametrize("out_format,hadamard,dense_dtype", FORMATS, ids=lambda v: str(v))
@pytest.mark.parametrize("case", _cases(), ids=lambda c: f"r{c[0]}-d{c[2]}-{c[5]}")
def test_random_inputs_match_engine_and_reference(case, out_format, hadamard, dense_dtype, compute_dtype):
    ratio, overlap, d, rope, _, name = case
    if not _valid(out_format, d, rope, hadamard):
        pytest.skip("format needs other dims")
    if name == "n0" and (out_format, dense_dtype, compute_dtype) != ("dense", torch.float32, torch.float32):
        pytest.skip("N = 0 writes nothing in any format: one combination suffices")
    fmt, engine, kernel, ref = _run_all(case, out_format, hadamard, dense_dtype, compute_dtype, exact=False)
    assert torch.equal(_as_bytes(ref), _as_bytes(engine)), "reference differs from the engine"
    slots = _engine_plan(ratio, overlap, case[4])[0].entry_slots
    _check_tolerance(f"{out_format} d{d} {compute_dtype}", fmt, kernel, engine, slots, out_format, compute_dtype,
                     dense_dtype)


def _check_tolerance(name, fmt, kernel, expected, slots, out_format, compute_dtype, dense_dtype):
    """Byte mismatches over the written rows (not for fp32 rows, where an ulp flips a byte), then values."""
    if slots.numel() == 0:  # N = 0: nothing may be written
        assert not _as_bytes(kernel).any() and not _as_bytes(expected).any(), f"{name}: rows written for N = 0"
        return
    kernel, expected = kernel[slots], expected[slots]
    if not (out_format == "dense" and compute_dtype == dense_dtype == torch.float32):
        kb, eb = _as_bytes(kernel), _as_bytes(expected)
        frac = (kb != eb).float().mean().item()
        assert frac <= 0.02, f"{name}: {(kb != eb).sum().item()} of {kb.numel()} bytes differ"
    kv, ev = fmt.dequantize(kernel), fmt.dequantize(expected)
    step = GRID_STEP[out_format] or max(DENSE_STEP[compute_dtype], DENSE_STEP[dense_dtype or torch.float32])
    assert_close(name, kv, ev, atol=step * ev.abs().max().item())

# ----------------------------------------------------------------------------- wrapper checks


def test_wrapper_rejects_bad_shapes():
    ring, fresh = torch.zeros(8, 2, 128), torch.zeros(4, 2, 128)
    rows = torch.zeros(1, 8, dtype=torch.int64)
    kw = dict(ratio=4, overlap=True, head_dim=64, norm_weight=torch.ones(64), eps=1e-6,
              positions=torch.zeros(1, dtype=torch.int64), inv_freq=torch.ones(16), rope_dim=32,
              out_slots=torch.zeros(1, dtype=torch.int64))
    with pytest.raises(AssertionError, match="fp8_kv"):
        dsv4_compress(ring, fresh, rows, out_cache=torch.zeros(4, 96, dtype=torch.uint8), out_format="fp8_kv", **kw)
    with pytest.raises(AssertionError, match=r"\[rows, 34\]"):
        dsv4_compress(ring, fresh, rows, out_cache=torch.zeros(4, 41, dtype=torch.uint8), out_format="fp4_index",
                      **kw)
    with pytest.raises(AssertionError, match="source_rows"):
        dsv4_compress(ring, fresh, rows[:, :4], out_cache=torch.zeros(4, 64), out_format="dense", **kw)


# ----------------------------------------------------------------------------- GPU, Flash shapes


def _flash_inputs(ratio, overlap, d, n, device):
    """n entries of an 8K-token prefill chunk after a 1K-token prefix (first windows pull ring rows)."""
    g = torch.Generator(device=device).manual_seed(0)
    c, s = (2 * d, 2 * ratio) if overlap else (d, ratio)
    ring = torch.randn(2 * s, 2, c, device=device, generator=g)
    fresh = torch.randn(n * ratio, 2, c, device=device, generator=g)
    fresh[:, 1] *= 3.0
    w = torch.arange(n, device=device)[:, None] * ratio + torch.arange(s, device=device)[None, :] - (s - ratio)
    rows = torch.where(w < 0, w + ring.shape[0], ring.shape[0] + w)  # negative positions come from the ring
    return ring, fresh, rows, (w[:, -1] + 1 - ratio) + 1024


@pytest.mark.gpu
@pytest.mark.skipif(not CUDA, reason="needs a CUDA GPU")
@pytest.mark.parametrize("n", [1, 128, 2048])
@pytest.mark.parametrize("kind", ["csa-fp8_kv", "csa-dense", "indexer-fp4", "indexer-fp8", "hca-fp8_kv",
                                  "hca-dense"])
def test_gpu_flash_shapes(kind, n):
    layer, out_format = kind.split("-")
    ratio, overlap, d, rope, hadamard = {"csa": (4, True, 512, 64, False), "indexer": (4, True, 128, 64, True),
                                         "hca": (128, False, 512, 64, False)}[layer]
    out_format = {"fp4": "fp4_index", "fp8": "fp8_index"}.get(out_format, out_format)
    if layer == "hca":
        n = min(n, 64)
    ring, fresh, rows, positions = _flash_inputs(ratio, overlap, d, n, "cuda")
    weight = (torch.rand(d, device="cuda") + 0.5).bfloat16().float()
    inv_freq = 1.0 / 160000.0 ** (torch.arange(0, rope, 2, dtype=torch.float32, device="cuda") / rope)
    slots = torch.randperm(4 * n, device="cuda")[:n]
    fmt = _engine_format(out_format, d, rope, torch.bfloat16)
    outs = []
    for fn in (dsv4_compress, dsv4_compress_ref):
        out = fmt.allocate(4 * n, "cuda")
        fn(ring, fresh, rows, ratio=ratio, overlap=overlap, head_dim=d, norm_weight=weight, eps=1e-6,
           positions=positions, inv_freq=inv_freq, rope_dim=rope, out_cache=out, out_slots=slots,
           out_format=out_format, hadamard=hadamard, compute_dtype=torch.bfloat16)
        outs.append(out)
    _check_tolerance(kind, fmt, outs[0], outs[1], slots, out_format, torch.bfloat16, torch.bfloat16)


def test_row_widths_match_engine_formats():
    for out_format, d, rope in [("fp8_kv", 512, 64), ("fp8_index", 128, 0), ("fp4_index", 128, 0),
                                ("fp8_index", 96, 0), ("dense", 512, 64)]:
        fmt = _engine_format(out_format, d, rope, torch.bfloat16)
        assert fmt.kernel_format == out_format and row_width(out_format, d, rope, torch.bfloat16) == fmt.row_width
