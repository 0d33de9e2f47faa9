"""dsv4_sparse_attention vs its torch reference (docs/dsv4-architecture.md 5.6).

CPU: the Triton interpreter at tiny shapes (D = 96 with rope 32, i.e. one FP8 block, and D = 128; W = 16; extra
lists of up to 40 entries with -1 holes; per-row and per-request lists; rows without keys). GPU: DeepSeek-V4
Flash shapes (H = 64, D = 512, rope 64, W = 128, CSA top-k 512, HCA lists up to 8192, decode and prefill).

Tolerances (max |out - ref| <= atol + rtol * |ref|, plus relative RMS error):
  fp32 q (fp32 dots): atol = rtol = 1e-5            fp16 q (fp16 dots / fp16 output): atol = rtol = 2e-3
  GPU bf16 q (bf16 dots, P rounded to bf16, bf16 output): |err| <= 2e-2 * max|ref| + 1e-3, rel-RMS <= 1e-2
"""

from __future__ import annotations

import pytest
import torch

from sgl_kernel.dsv4_sparse_attention import (dsv4_sparse_attention, dsv4_sparse_attention_ref,
                                              pick_num_splits)
from sgl_kernel.dsv4_formats_ref import quantize_fp8_kv

TOL = {torch.float32: (1e-5, 1e-5), torch.float16: (2e-3, 2e-3)}


def assert_close(name: str, ref: torch.Tensor, out: torch.Tensor, atol: float, rtol: float,
                 max_rel_rms: float = float("inf")) -> None:
    """Elementwise |out - ref| <= atol + rtol |ref|, NaN checked first; the message names the tensor."""
    out, ref = out.float(), ref.float()
    assert not torch.isnan(out).any(), f"{name}: NaN in kernel output"
    err = (out - ref).abs()
    rel_rms = (err.norm() / ref.norm().clamp_min(1e-30)).item()
    bad = err > atol + rtol * ref.abs()
    assert not bad.any() and rel_rms <= max_rel_rms, (
        f"{name}: max abs err {err.max().item():.3e} at {tuple(bad.nonzero()[0].tolist()) if bad.any() else '-'}, "
        f"rel-RMS {rel_rms:.3e} (atol {atol}, rtol {rtol}, max rel-RMS {max_rel_rms})")


def _cache(num_rows: int, d: int, rope: int, dtype, gen, device="cpu") -> torch.Tensor:
    vals = torch.randn(num_rows, d, generator=gen).to(device)
    return quantize_fp8_kv(vals, rope) if rope else vals.to(dtype)


def _inputs(t, h, d, w, k, *, rope=0, q_dtype=torch.float32, cache_dtype=torch.float32, per_request=False,
            seed=0, device="cpu", num_rows=256, q_scale=1.0):
    """Random q/caches/slots with -1 holes; row 1 has no extra keys, row 2 (if any) no keys at all."""
    gen = torch.Generator().manual_seed(seed)
    q = (torch.randn(t, h, d, generator=gen) * q_scale).to(q_dtype).to(device)
    win_cache = _cache(num_rows, d, rope, cache_dtype, gen, device)
    ext_cache = _cache(num_rows, d, rope, cache_dtype, gen, device)
    win = torch.randint(0, num_rows, (t, w), generator=gen)
    win[0, : w // 3] = -1  # a row near the start of its sequence
    ext_kw = {}
    if per_request:  # HCA style: one list per request, row r sees its first extra_len[r] entries
        num_req = max(1, t // 3)
        lists = torch.randint(0, num_rows, (num_req, k), generator=gen)
        lists[0, (k * 3) // 4:] = -1  # a request holding fewer entries than the widest one
        ext_kw["extra_row_map"] = (torch.arange(t) * num_req // t).to(device)
        lens = torch.randint(0, k + 1, (t,), generator=gen)
        lens[1:3] = 0
        ext_kw["extra_len"] = lens.to(torch.int32).to(device)
    else:  # CSA style: one top-k list per row
        lists = torch.randint(0, num_rows, (t, k), generator=gen)
        lists[torch.rand(t, k, generator=gen) < 0.25] = -1
        lists[1:3] = -1
    win[2:3] = -1
    sink = torch.randn(h, generator=gen).to(device)
    return dict(q=q, window_cache=win_cache, window_slots=win.to(device), extra_cache=ext_cache,
                extra_slots=lists.to(device), sink=sink, softmax_scale=d ** -0.5, fp8_rope_dim=rope, **ext_kw)


def _check(name, args, num_splits=None, launch_config=None, **tol):
    out = dsv4_sparse_attention(**args, num_splits=num_splits, launch_config=launch_config)
    ref = dsv4_sparse_attention_ref(**args)
    atol, rtol = TOL.get(args["q"].dtype, (None, None))
    assert_close(name, ref, out, **({"atol": atol, "rtol": rtol} | tol))
    return out, ref


# ----------------------------------------------------------------------------- CPU (interpreter)


@pytest.mark.parametrize("num_splits", [None, 3])
def test_dense_fp32_per_row_lists(num_splits):
    args = _inputs(t=5, h=16, d=128, w=16, k=40, seed=1)
    out, ref = _check(f"dense fp32 splits={num_splits}", args, num_splits)
    assert out[2].abs().max() == 0 and ref[2].abs().max() == 0  # a row with no valid key gives 0


def test_dense_fp16_per_request_lists():
    args = _inputs(t=6, h=4, d=96, w=16, k=40, q_dtype=torch.float16, cache_dtype=torch.float16,
                   per_request=True, seed=2)
    _check("dense fp16 per-request", args, num_splits=2)


@pytest.mark.parametrize("q_dtype,per_request,num_splits", [(torch.float32, False, 1), (torch.float32, True, 4),
                                                            (torch.float16, True, 1)])
def test_fp8_cache(q_dtype, per_request, num_splits):
    args = _inputs(t=5, h=4, d=96, w=16, k=40, rope=32, q_dtype=q_dtype, per_request=per_request, seed=3)
    _check(f"fp8 {q_dtype} per_request={per_request}", args, num_splits)


@pytest.mark.parametrize("t", [1, 63])
def test_odd_row_counts(t):
    args = _inputs(t=t, h=4, d=96, w=16, k=24, rope=32, per_request=True, seed=7)
    _check(f"T={t} fp8 per-request", args)


def test_empty_splits_write_and_read_no_values(monkeypatch):
    """Splits past a row's keys (a decode graph sizes them for the context capacity) write no partial values and the
    combine reads none: with every fresh buffer NaN, the output is the reference's."""
    args = _inputs(5, 4, 96, 16, 200, per_request=True, seed=3)
    args["extra_len"] = torch.tensor([0, 0, 3, 1, 200], dtype=torch.int32)
    real = torch.empty

    def poisoned(*size, **kw):
        t = real(*size, **kw)
        return t.fill_(float("nan")) if t.is_floating_point() else t

    monkeypatch.setattr(torch, "empty", poisoned)
    _check("empty splits", args, num_splits=8)


def test_window_only_and_bf16_cache():
    args = _inputs(t=3, h=4, d=128, w=16, k=8, cache_dtype=torch.bfloat16, seed=4)
    for key in ("extra_cache", "extra_slots"):
        args.pop(key)
    _check("window-only bf16 cache", args)


@pytest.mark.parametrize("fp8,dv_split,loader", [(True, 1, 0), (True, 2, 0), (True, 1, 1), (True, 2, 1), (False, 1, 0)],
                         ids=["fp8", "fp8-dv2", "fp8-blockscale", "fp8-dv2-blockscale", "fp16"])
def test_many_heads_block_of_64(fp8, dv_split, loader):
    """H = 40 > 16: one 64-head block with 24 masked heads, the production (bf16 on GPU) tiling; DV_SPLIT = 2 gives
    each value half its own program (both recompute S and write the same statistics).

    The interpreter cannot run bf16 dots, so the FP8 cases keep fp32 dots but force the BH = 64 launch config;
    fp16 q with an fp16 cache picks it by itself.
    """
    import sgl_kernel.dsv4_sparse_attention as mod

    if fp8:
        cfg = dict(BH=64, BN=32, DV_SPLIT=dv_split, LOADER=loader, num_warps=8, num_stages=2)
        args = _inputs(t=3, h=40, d=96, w=16, k=24, rope=32, seed=5)
        for splits in (1, 2):
            _check(f"H=40 fp8 DV_SPLIT={dv_split} LOADER={loader} splits={splits}", args, num_splits=splits,
                   launch_config=cfg)
    else:
        assert mod._launch_config(40, mod.tl.float16)["BH"] == 64
        args = _inputs(t=3, h=40, d=96, w=16, k=24, q_dtype=torch.float16, cache_dtype=torch.float16, seed=5)
        _check("H=40 fp16", args, num_splits=2)


def test_out_buffer_and_strided_q():
    args = _inputs(t=3, h=8, d=128, w=16, k=16, seed=6)
    big = torch.randn(3, 12, 128)
    big[:, 2:10] = args["q"]
    args["q"] = big[:, 2:10]  # a view: head stride 128, row stride 12 * 128
    out = torch.full((3, 8, 128), float("nan"))
    res = dsv4_sparse_attention(**args, out=out)
    assert res is out
    assert_close("out= strided q", dsv4_sparse_attention_ref(**args), out, 1e-5, 1e-5)


def test_rejects_bad_arguments():
    args = _inputs(t=2, h=4, d=96, w=16, k=8, rope=32)
    with pytest.raises(AssertionError, match="FP8 cache must be uint8"):
        dsv4_sparse_attention(**(args | {"window_cache": torch.zeros(256, 96)}))
    with pytest.raises(AssertionError, match="extra_slots needs one list per row"):
        dsv4_sparse_attention(**(args | {"extra_slots": args["extra_slots"][:1]}))
    with pytest.raises(AssertionError, match="sink"):
        dsv4_sparse_attention(**(args | {"sink": torch.zeros(3)}))


def test_pick_num_splits_fills_the_gpu():
    cpu = torch.device("cpu")  # the CPU stand-in for the SM count is 132
    assert pick_num_splits(1, 64, 128 + 8192, cpu) == 65  # batch-1 HCA at 1M: 65 splits of 128 keys
    assert pick_num_splits(8, 64, 128 + 512, cpu) == 5
    assert pick_num_splits(256, 64, 128 + 8192, cpu) == 1  # enough rows: no combine pass
    assert pick_num_splits(1, 64, 100, cpu) == 1


# ----------------------------------------------------------------------------- GPU (Flash shapes)

needs_gpu = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")


def _bf16_check(name, args, num_splits=None):
    out = dsv4_sparse_attention(**args, num_splits=num_splits)
    ref = dsv4_sparse_attention_ref(**args)
    assert_close(name, ref, out, atol=2e-2 * ref.float().abs().max().item() + 1e-3, rtol=0.0, max_rel_rms=1e-2)


@pytest.mark.parametrize("rope", [0, 64], ids=["bf16", "fp8"])
@pytest.mark.parametrize("t", [1, 8, 64])
@pytest.mark.parametrize("layer", ["csa", "hca"])
@pytest.mark.gpu
@needs_gpu
def test_gpu_decode_flash_shapes(rope, t, layer):
    k = 512 if layer == "csa" else 8192
    args = _inputs(t=t, h=64, d=512, w=128, k=k, rope=rope, q_dtype=torch.bfloat16, cache_dtype=torch.bfloat16,
                   per_request=layer == "hca", seed=10 + t, device="cuda", num_rows=max(4096, 2 * k), q_scale=2.0)
    if layer == "hca" and t == 1:
        args["extra_len"][0] = k  # batch 1 with the full 8192-entry list (the split-K case)
    _bf16_check(f"decode {layer} T={t} rope={rope}", args)


@pytest.mark.parametrize("rope", [0, 64], ids=["bf16", "fp8"])
@pytest.mark.parametrize("layer", ["csa", "hca"])
@pytest.mark.gpu
@needs_gpu
def test_gpu_prefill_1024_rows(rope, layer):
    k = 512 if layer == "csa" else 2048
    args = _inputs(t=1024, h=64, d=512, w=128, k=k, rope=rope, q_dtype=torch.bfloat16,
                   cache_dtype=torch.bfloat16, per_request=layer == "hca", seed=20, device="cuda", num_rows=8192,
                   q_scale=2.0)
    _bf16_check(f"prefill {layer} rope={rope}", args)


@pytest.mark.gpu
@needs_gpu
def test_gpu_splits_agree():
    args = _inputs(t=2, h=64, d=512, w=128, k=4096, rope=64, q_dtype=torch.bfloat16, per_request=True, seed=30,
                   device="cuda", num_rows=8192, q_scale=2.0)
    for s in (1, 7, 40):
        _bf16_check(f"splits={s}", args, num_splits=s)
