"""Torch references of the DeepSeek-V4 attention ops, with their argument checks (no Triton, no engine imports).

Each `<op>_ref` has the signature and the effect of the kernel `<op>` in dsv4_<op>.py, which shares its checks and
is tested against it. The engine's torch attention backend computes with these functions, so it runs where Triton
does not and differs from the Triton backend only in them. Row layouts come from dsv4_formats_ref.

Ops: store_kv (window KV rows), sparse_attention (window + compressed entries with the sink), compress (pool +
RMSNorm + RoPE [+ Hadamard] + quantize + store) and update_ring, index_logits (lightning indexer), topk_slots.
The formulas are in the kernels' module docstrings.
"""

from __future__ import annotations

from typing import Optional

import torch

from sgl_kernel.dsv4_formats_ref import (
    FLOAT_DTYPES, dequantize_ref, hadamard_ref, layout_error, quantize_fp8_kv, quantize_ref, rms_norm_ref, rope_ref,
    round_to, row_width)

INDEX_DTYPES = (torch.int32, torch.int64)
KEY_FORMATS = ("dense", "fp8_index", "fp4_index")  # indexer key rows


# ----------------------------------------------------------------------------- store_kv


def check_fp8_kv_dims(dim: int, rope_dim: int) -> None:
    """The kernels' fp8_rope_dim > 0 selects the fp8_kv layout, so it needs a rope part."""
    assert rope_dim > 0 and layout_error("fp8_kv", dim, rope_dim) is None, (
        f"FP8 KV layout needs 0 < rope_dim < dim and (dim - rope_dim) % 64 == 0, got dim={dim} rope_dim={rope_dim}")


def check_kv_cache(name: str, cache: torch.Tensor, d: int, rope: int) -> None:
    """A window / compressed KV pool: contiguous [N, D] floats, or uint8 [N, row] FP8 rows when rope > 0."""
    assert cache.dim() == 2 and cache.is_contiguous(), (
        f"{name} must be a contiguous 2-D tensor, got {tuple(cache.shape)}")
    if rope > 0:
        row = row_width("fp8_kv", d, rope)
        assert cache.dtype == torch.uint8 and cache.shape[1] == row, (
            f"{name}: FP8 cache must be uint8 [N, {row}] for D={d} rope={rope}, got {cache.dtype} {tuple(cache.shape)}")
    else:
        assert cache.dtype in FLOAT_DTYPES and cache.shape[1] == d, (
            f"{name}: dense cache must be float32/bfloat16/float16 [N, {d}], got {cache.dtype} {tuple(cache.shape)}")


def check_store_kv_args(cache: torch.Tensor, slots: torch.Tensor, values: torch.Tensor, fp8_rope_dim: int) -> None:
    assert values.dim() == 2 and values.dtype in FLOAT_DTYPES, (
        f"values must be [N, D] float32/bfloat16/float16, got {tuple(values.shape)} {values.dtype}")
    assert values.stride(-1) == 1, "values must be contiguous along D"
    n, d = values.shape
    assert slots.dim() == 1 and slots.shape[0] == n and slots.dtype in INDEX_DTYPES, (
        f"slots must be [N={n}] int32/int64, got {tuple(slots.shape)} {slots.dtype}")
    assert slots.is_contiguous(), "slots must be contiguous"
    assert cache.device == values.device == slots.device, "cache, slots and values must be on one device"
    if fp8_rope_dim > 0:
        check_fp8_kv_dims(d, fp8_rope_dim)
    check_kv_cache("cache", cache, d, fp8_rope_dim)


def dsv4_store_kv_ref(cache: torch.Tensor, slots: torch.Tensor, values: torch.Tensor, fp8_rope_dim: int = 0) -> None:
    """cache[slots[n]] = encode(values[n]) for slots[n] >= 0 (fp8_kv rows when fp8_rope_dim > 0, else a cast)."""
    check_store_kv_args(cache, slots, values, fp8_rope_dim)
    keep = slots >= 0
    slots, values = slots[keep].long(), values[keep]
    rows = quantize_fp8_kv(values, fp8_rope_dim) if fp8_rope_dim > 0 else values.to(cache.dtype)
    cache.index_copy_(0, slots, rows)


# ----------------------------------------------------------------------------- sparse attention


def _check_index(name: str, x: torch.Tensor, ndim: int, rows=None) -> None:
    assert x.dtype in INDEX_DTYPES and x.is_contiguous(), f"{name} must be contiguous int32/int64, got {x.dtype}"
    assert x.dim() == ndim and (rows is None or x.shape[0] == rows), (
        f"{name}: expected {ndim}-D with {rows} rows, got shape {tuple(x.shape)}")


def check_sparse_attention_args(q, window_cache, window_slots, extra_cache, extra_slots, extra_row_map, extra_len,
                                sink, softmax_scale, fp8_rope_dim, out) -> None:
    assert q.dim() == 3 and q.dtype in FLOAT_DTYPES and q.stride(-1) == 1, (
        f"q must be [T, H, D] float32/bfloat16/float16 with unit stride on D, got {tuple(q.shape)} {q.dtype}")
    t, h, d = q.shape
    if fp8_rope_dim > 0:
        check_fp8_kv_dims(d, fp8_rope_dim)
    check_kv_cache("window_cache", window_cache, d, fp8_rope_dim)
    _check_index("window_slots", window_slots, 2, t)
    assert (extra_cache is None) == (extra_slots is None), "pass extra_cache and extra_slots together"
    if extra_cache is not None:
        check_kv_cache("extra_cache", extra_cache, d, fp8_rope_dim)
        assert extra_cache.dtype == window_cache.dtype, "window and extra caches must share one format"
        _check_index("extra_slots", extra_slots, 2)
        if extra_row_map is None:
            assert extra_slots.shape[0] == t, f"without extra_row_map, extra_slots needs one list per row (R == T={t})"
        else:
            _check_index("extra_row_map", extra_row_map, 1, t)
        if extra_len is not None:
            _check_index("extra_len", extra_len, 1, t)
    else:
        assert extra_row_map is None and extra_len is None, "extra_row_map / extra_len need extra_slots"
    assert sink is not None and softmax_scale is not None, "sink and softmax_scale are required"
    assert sink.shape == (h,) and sink.is_floating_point() and sink.is_contiguous(), f"sink must be [H={h}] float"
    if out is not None:
        assert out.shape == q.shape and out.dtype == q.dtype and out.stride(-1) == 1, (
            f"out must be {tuple(q.shape)} {q.dtype} with unit stride on D")
    devices = {x.device for x in (q, window_cache, window_slots, extra_cache, extra_slots, extra_row_map, extra_len,
                                  sink, out) if x is not None}
    assert len(devices) == 1, f"all tensors must be on one device, got {devices}"


def _gather_kv(cache: torch.Tensor, slots: torch.Tensor, d: int, rope: int) -> torch.Tensor:
    rows = cache[slots.clamp(min=0).long()]
    return dequantize_ref(rows, "fp8_kv", d, rope) if rope > 0 else rows.to(torch.float32)


def dsv4_sparse_attention_ref(q, window_cache, window_slots, extra_cache=None, extra_slots=None,
                              extra_row_map=None, extra_len=None, sink=None, softmax_scale=None, fp8_rope_dim=0,
                              out=None, num_splits=None, row_block: int = 256) -> torch.Tensor:
    """Gathers the keys of `row_block` rows at a time and computes in fp32 (num_splits is ignored)."""
    check_sparse_attention_args(q, window_cache, window_slots, extra_cache, extra_slots, extra_row_map, extra_len,
                                sink, softmax_scale, fp8_rope_dim, out)
    t, h, d = q.shape
    rope = max(fp8_rope_dim, 0)
    out = torch.empty_like(q) if out is None else out
    for lo in range(0, t, row_block):
        hi = min(lo + row_block, t)
        win = window_slots[lo:hi]
        keys, valid = [_gather_kv(window_cache, win, d, rope)], [win >= 0]
        if extra_slots is not None:
            lists = extra_slots[extra_row_map[lo:hi].long()] if extra_row_map is not None else extra_slots[lo:hi]
            ok = lists >= 0
            if extra_len is not None:
                ok &= torch.arange(lists.shape[1], device=q.device)[None, :] < extra_len[lo:hi, None]
            keys.append(_gather_kv(extra_cache, lists, d, rope))
            valid.append(ok)
        keys, valid = torch.cat(keys, dim=1), torch.cat(valid, dim=1)  # [t, J, D], [t, J]
        scores = torch.einsum("thd,tjd->thj", q[lo:hi].float(), keys) * softmax_scale
        scores = scores.masked_fill(~valid[:, None, :], float("-inf"))
        sinks = sink.float()[None, :, None].expand(hi - lo, h, 1)
        lse = torch.logsumexp(torch.cat((scores, sinks), dim=-1), dim=-1, keepdim=True)
        out[lo:hi] = torch.einsum("thj,tjd->thd", torch.exp(scores - lse), keys).to(q.dtype)
    return out


# ----------------------------------------------------------------------------- compress


def check_compress_args(ring, fresh, source_rows, ratio, overlap, head_dim, norm_weight, positions, inv_freq,
                        rope_dim, out_cache, out_slots, out_format, hadamard, compute_dtype) -> None:
    c = 2 * head_dim if overlap else head_dim
    s = 2 * ratio if overlap else ratio
    n = source_rows.shape[0]
    assert ring.dim() == 3 and ring.shape[1:] == (2, c) and ring.dtype == torch.float32, \
        f"ring must be fp32 [Rr, 2, {c}], got {ring.dtype} {tuple(ring.shape)}"
    assert fresh.dim() == 3 and fresh.shape[1:] == (2, c) and fresh.dtype == torch.float32, \
        f"fresh must be fp32 [T, 2, {c}], got {fresh.dtype} {tuple(fresh.shape)}"
    assert ring.stride(2) == 1 and fresh.stride(2) == 1, "ring / fresh channels must be contiguous"
    assert source_rows.dim() == 2 and source_rows.shape[1] == s and source_rows.dtype == torch.int64 \
        and source_rows.is_contiguous(), f"source_rows must be contiguous int64 [N, {s}], got {source_rows.dtype} " \
                                         f"{tuple(source_rows.shape)}"
    assert norm_weight.shape == (head_dim,), f"norm_weight must be [{head_dim}], got {tuple(norm_weight.shape)}"
    assert positions.shape == (n,) and out_slots.shape == (n,), \
        f"positions {tuple(positions.shape)} and out_slots {tuple(out_slots.shape)} must be [{n}]"
    assert not positions.is_floating_point() and not out_slots.is_floating_point(), "positions / out_slots: integers"
    assert all(t.is_contiguous() for t in (norm_weight, positions, inv_freq, out_slots)), \
        "norm_weight, positions, inv_freq and out_slots must be contiguous"
    assert len({t.device for t in (ring, fresh, source_rows, norm_weight, positions, inv_freq, out_cache,
                                   out_slots)}) == 1, "all tensors must be on one device"
    assert rope_dim % 2 == 0 and head_dim % 2 == 0 and 0 <= rope_dim <= head_dim, \
        f"rope_dim {rope_dim} and head_dim {head_dim} must be even with rope_dim <= head_dim"
    assert inv_freq.shape == (rope_dim // 2,) and inv_freq.dtype == torch.float32, \
        f"inv_freq must be fp32 [{rope_dim // 2}], got {inv_freq.dtype} {tuple(inv_freq.shape)}"
    assert compute_dtype in FLOAT_DTYPES, f"compute_dtype {compute_dtype} not in {FLOAT_DTYPES}"
    assert (err := layout_error(out_format, head_dim, rope_dim)) is None, f"{out_format}: {err}"
    assert not hadamard or head_dim & (head_dim - 1) == 0, f"hadamard needs a power-of-two head_dim, got {head_dim}"
    dense_dtype = out_cache.dtype if out_format == "dense" else torch.uint8
    assert out_format != "dense" or dense_dtype in FLOAT_DTYPES, f"dense out_cache dtype {dense_dtype} not supported"
    width = row_width(out_format, head_dim, rope_dim, dense_dtype)
    assert out_cache.dim() == 2 and out_cache.shape[1] == width and out_cache.dtype == dense_dtype \
        and out_cache.stride(1) == 1, f"out_cache for {out_format} must be {dense_dtype} [rows, {width}] with " \
                                      f"contiguous rows, got {out_cache.dtype} {tuple(out_cache.shape)}"


def pool_ref(ring: torch.Tensor, fresh: torch.Tensor, source_rows: torch.Tensor, ratio: int, overlap: bool,
             head_dim: int) -> torch.Tensor:
    """[N, head_dim] fp32 channel-wise softmax pool of each entry's source rows of [ring; fresh]."""
    src = torch.cat((ring, fresh), dim=0)
    rows = src[source_rows.clamp(min=0)]  # [N, S, 2, C]
    if overlap:  # slots [0, m): A halves of the previous window; [m, 2m): B halves of this one
        m, d = ratio, head_dim
        content = torch.cat((rows[:, :m, 0, :d], rows[:, m:, 0, d:]), dim=1)
        logits = torch.cat((rows[:, :m, 1, :d], rows[:, m:, 1, d:]), dim=1)
    else:
        content, logits = rows[:, :, 0], rows[:, :, 1]
    empty = (source_rows < 0)[:, :, None]
    logits = logits.masked_fill(empty, float("-inf"))
    content = content.masked_fill(empty, 0.0)
    return (content * logits.softmax(dim=1)).sum(dim=1)


def dsv4_compress_ref(ring: torch.Tensor, fresh: torch.Tensor, source_rows: torch.Tensor, *, ratio: int,
                      overlap: bool, head_dim: int, norm_weight: torch.Tensor, eps: float, positions: torch.Tensor,
                      inv_freq: torch.Tensor, rope_dim: int, out_cache: torch.Tensor, out_slots: torch.Tensor,
                      out_format: str, hadamard: bool = False, compute_dtype: torch.dtype = torch.float32) -> None:
    """Pool, RMSNorm, RoPE [, Hadamard] in compute_dtype steps, quantize, out_cache[out_slots] = rows."""
    check_compress_args(ring, fresh, source_rows, ratio, overlap, head_dim, norm_weight, positions, inv_freq,
                        rope_dim, out_cache, out_slots, out_format, hadamard, compute_dtype)
    if source_rows.shape[0] == 0:
        return
    y = round_to(pool_ref(ring, fresh, source_rows, ratio, overlap, head_dim), compute_dtype)
    y = rms_norm_ref(y, norm_weight, eps, compute_dtype)
    y = rope_ref(y, positions, inv_freq, rope_dim, compute_dtype)
    if hadamard:
        y = hadamard_ref(y, compute_dtype)
    out_cache[out_slots] = quantize_ref(y, out_format, rope_dim, out_cache.dtype)


def dsv4_update_ring_ref(ring: torch.Tensor, ring_dst: torch.Tensor, fresh: torch.Tensor,
                         ring_src: torch.Tensor) -> None:
    ring[ring_dst] = fresh[ring_src]


def dsv4_compress_staged_ref(ring: torch.Tensor, fresh: torch.Tensor, source_rows: torch.Tensor, *,
                             ring_dst: torch.Tensor, ring_src: torch.Tensor, boundary: Optional[torch.Tensor] = None,
                             boundary_dst: Optional[torch.Tensor] = None, boundary_src: Optional[torch.Tensor] = None,
                             **compress_args) -> None:
    """dsv4_compress_ref, then the staging writes ring[ring_dst] = fresh[ring_src] (and boundary[boundary_dst] =
    fresh[boundary_src]): the kernel's one launch, for plans where no ring row written is one the pool reads."""
    dsv4_compress_ref(ring, fresh, source_rows, **compress_args)
    dsv4_update_ring_ref(ring, ring_dst, fresh, ring_src)
    if boundary is not None:
        dsv4_update_ring_ref(boundary, boundary_dst, fresh, boundary_src)


# ----------------------------------------------------------------------------- index logits


def check_index_logits_args(q, weights, key_cache, key_format, cand_slots, row_map, visible, out) -> None:
    assert q.dim() == 3 and q.dtype in FLOAT_DTYPES and q.stride(2) == 1, \
        "q: [T, nI, dI] fp32/bf16/fp16, last dim contiguous"
    T, H, D = q.shape
    assert weights.shape == (T, H) and weights.stride(1) == 1, "weights: [T, nI], last dim contiguous"
    assert key_format in KEY_FORMATS, f"key_format {key_format!r} not in {KEY_FORMATS}"
    assert (err := layout_error(key_format, D)) is None, f"{key_format} keys: {err}"
    assert key_cache.dim() == 2 and key_cache.stride(1) == 1, "key_cache: [N, row width] with contiguous rows"
    if key_format == "dense":
        assert key_cache.is_floating_point() and key_cache.shape[1] == D, "dense keys: [N, dI] floats"
    else:
        width = row_width(key_format, D, 0)
        assert key_cache.dtype == torch.uint8 and key_cache.shape[1] == width, \
            f"{key_format} keys: uint8 rows of {width} bytes for dI={D}, got {key_cache.dtype} {tuple(key_cache.shape)}"
    assert cand_slots.dim() == 2 and not cand_slots.is_floating_point(), "cand_slots: [R, E] integers"
    assert cand_slots.stride(1) == 1 or cand_slots.shape[1] <= 1, "cand_slots: last dim contiguous"
    assert row_map is None or row_map.shape == (T,), "row_map: [T] or None"
    assert row_map is not None or cand_slots.shape[0] >= T, "without row_map, cand_slots needs one row per query"
    assert visible.shape == (T,), "visible: [T]"
    assert out.shape == (T, cand_slots.shape[1]) and out.dtype == torch.float32, "out: [T, E] fp32"
    assert out.stride(1) == 1 or out.shape[1] <= 1, "out: last dim contiguous"


def dsv4_index_logits_ref(q: torch.Tensor, weights: torch.Tensor, key_cache: torch.Tensor, key_format: str,
                          cand_slots: torch.Tensor, row_map: Optional[torch.Tensor], visible: torch.Tensor,
                          out: torch.Tensor, fill_invisible: bool = True) -> torch.Tensor:
    """out[t, e] = sum_h weights[t, h] relu(q[t, h] . key[cand_slots[row_map[t], e]]) for e < visible[t], else -inf
    (fill_invisible=False: only the visible entries written; dsv4_topk_slots_ref(visible=...) reads no others).

    fp32, one row at a time, so a row's logits never depend on which rows share a call (the engine's chunked
    prefill equals one pass elementwise). Each row gathers its own keys: reading row_map on the host to share them
    would synchronise with the device.
    """
    check_index_logits_args(q, weights, key_cache, key_format, cand_slots, row_map, visible, out)
    T, H, D = q.shape
    E = cand_slots.shape[1]
    if T == 0 or E == 0:
        return out
    entry = torch.arange(E, device=q.device)
    for t in range(T):
        slots = cand_slots[t] if row_map is None else cand_slots.index_select(0, row_map[t:t + 1].long())[0]
        keys = dequantize_ref(key_cache[slots.clamp(min=0).long()], key_format, D)  # [E, D] fp32
        scores = torch.einsum("hd,ed->he", q[t].float(), keys).relu()
        logits = torch.einsum("he,h->e", scores, weights[t].float())
        # fill_invisible=False keeps what `out` held there (a select, not a host read of visible)
        out[t] = torch.where(entry < visible[t], logits, float("-inf") if fill_invisible else out[t])
    return out


# ----------------------------------------------------------------------------- top-k


def check_topk_args(logits, cand_slots, row_map, k, visible=None) -> None:
    assert logits.dim() == 2 and logits.dtype == torch.float32, "logits: [T, E] fp32"
    assert logits.stride(1) == 1 or logits.shape[1] <= 1, "logits: last dim contiguous"
    T, E = logits.shape
    assert k >= 1, f"k must be positive, got {k}"
    assert cand_slots.dim() == 2 and cand_slots.shape[1] == E and not cand_slots.is_floating_point(), \
        "cand_slots: [R, E] integers"
    assert cand_slots.stride(1) == 1 or E <= 1, "cand_slots: last dim contiguous"
    assert row_map is None or row_map.shape == (T,), "row_map: [T] or None"
    assert row_map is not None or cand_slots.shape[0] >= T, "without row_map, cand_slots needs one row per query"
    assert visible is None or (visible.shape == (T,) and not visible.is_floating_point()), "visible: [T] integers"


def dsv4_topk_slots_ref(logits: torch.Tensor, cand_slots: torch.Tensor, row_map: Optional[torch.Tensor],
                        k: int, visible: Optional[torch.Tensor] = None) -> torch.Tensor:
    """[T, k] int64: slots of each row's k largest finite logits (torch.topk order), -1 padded; with `visible` [T]
    only of its columns e < visible[t] (the others' logits may hold anything)."""
    check_topk_args(logits, cand_slots, row_map, k, visible)
    T, E = logits.shape
    out = torch.full((T, k), -1, dtype=torch.int64, device=logits.device)
    if T == 0 or E == 0:
        return out
    valid = torch.isfinite(logits)
    if visible is not None:
        valid &= torch.arange(E, device=logits.device)[None, :] < visible.to(logits.device)[:, None]
    top = logits.masked_fill(~valid, float("-inf")).topk(min(k, E), dim=1).indices  # [T, min(k, E)]
    src = row_map if row_map is not None else torch.arange(T, device=logits.device)
    slots = cand_slots[src[:, None], top].long()
    out[:, :top.shape[1]] = torch.where(valid.gather(1, top), slots, torch.full_like(slots, -1))
    return out
