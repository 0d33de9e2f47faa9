"""The launches the engine makes, as calls of the kernels' public wrappers with DeepSeek-V4-Flash / -Pro shapes
(docs/dsv4-configs.md) at the row counts the engine runs: CUDA-graph decode batches, speculative verify (4 tokens a
request), prefill chunks. aot_check runs them with launches recorded instead of run; tensors are empty CPU tensors
(only shapes, dtypes, strides and alignment reach the compiler).

KERNEL_EXCLUSIONS names the @triton.jit kernels with a launcher that no case here launches, with the reason.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from sgl_kernel.aot_targets import AotTarget
from sgl_kernel.dsv4_compress import dsv4_compress, dsv4_compress_staged, dsv4_update_ring
from sgl_kernel.dsv4_compressor_proj import dsv4_compressor_proj
from sgl_kernel.dsv4_decode_metadata import DecodeRatioSpec, dsv4_decode_metadata, dsv4_write_slots
from sgl_kernel.dsv4_formats_ref import fp8_kv_row_bytes, row_width
from sgl_kernel.dsv4_fp8_gemm import dsv4_fp8_act_quant, dsv4_fp8_block_gemm, dsv4_fp8_dequant, dsv4_fp8_scaled_gemm
from sgl_kernel.dsv4_index_logits import dsv4_index_logits
from sgl_kernel.dsv4_mhc import (dsv4_hc_head, dsv4_hc_post, dsv4_hc_post_mixes, dsv4_hc_pre, dsv4_hc_pre_norm,
                                 dsv4_hc_pre_norm_fp8)
from sgl_kernel.dsv4_moe import as_rows, chunked_empty, dsv4_moe_dense, dsv4_moe_fp8, dsv4_moe_mxfp4
from sgl_kernel.dsv4_qk_norm_rope import dsv4_qk_norm_rope
from sgl_kernel.dsv4_rmsnorm import dsv4_rms_norm, dsv4_rms_norm_fp8
from sgl_kernel.dsv4_rope import dsv4_rope, dsv4_rope_fp8
from sgl_kernel.dsv4_router import dsv4_router
from sgl_kernel.dsv4_sparse_attention import dsv4_sparse_attention
from sgl_kernel.dsv4_store_kv import dsv4_store_kv
from sgl_kernel.dsv4_swiglu import dsv4_clamped_swiglu, dsv4_clamped_swiglu_fp8
from sgl_kernel.dsv4_topk import dsv4_topk_slots


@dataclass(frozen=True)
class ModelShapes:
    name: str
    hidden: int
    heads: int
    q_lora: int
    o_groups: int
    index_topk: int
    experts: int
    inter: int
    o_lora: int = 1024
    head_dim: int = 512
    rope_dim: int = 64
    index_heads: int = 64
    index_dim: int = 128
    top_k: int = 6
    hc: int = 4
    window: int = 128
    vocab: int = 129280


MODELS = (ModelShapes("flash", 4096, 64, 1024, 8, 512, 256, 2048),
          ModelShapes("pro", 7168, 128, 1536, 16, 1024, 384, 3072))
DECODE_ROWS = (1, 2, 4, 8, 32, 128, 256)  # the CUDA-graph batch sizes
VERIFY_ROWS = (4, 32, 512)  # speculative verify: 4 tokens a request, 1 / 8 / 128 requests
PREFILL_ROWS = (8192, 1000)  # a full prefill chunk and a partial one
ROWS = DECODE_ROWS + VERIFY_ROWS + PREFILL_ROWS
DTYPES = (torch.bfloat16, torch.float32)  # serving, and the fp32 oracle path
CONTEXT = 8192  # tokens of context behind each row: entry counts of the compressed caches
POST_MIXES_ROWS = 16  # rows up to which hc_post carries the next mixes (models/deepseek_v4)
SKINNY_ROWS = 64  # rows up to which FP8 linears run the fused GEMM (layers/quantization/fp8.py), else dequant + GEMM

# @triton.jit kernels with a launcher that no case launches, and why.
KERNEL_EXCLUSIONS: dict = {
    "_dsv4_hc_mix_kernel": "dsv4_hc_mix is not called by the engine (dsv4_hc_pre's two launches replaced it); the mHC "
                           "benchmark's unfused row only",
}


def _e(*shape, dtype=torch.bfloat16):
    return torch.empty(*shape, dtype=dtype, device="meta")


def _ids(rows: int, cols: int, high: int) -> torch.Tensor:
    return torch.randint(0, high, (rows, cols), dtype=torch.int64, device="meta")


def norm_cases(m: ModelShapes, t: int, dtype, target: AotTarget):
    d = m.hidden
    yield "rms_norm hidden", lambda: dsv4_rms_norm(_e(t, d, dtype=dtype), _e(d, dtype=dtype), 1e-6)
    yield "rms_norm q_lora", lambda: dsv4_rms_norm(_e(t, m.q_lora, dtype=dtype), _e(m.q_lora, dtype=dtype), 1e-6)
    yield "rms_norm kv", lambda: dsv4_rms_norm(_e(t, m.head_dim, dtype=dtype), _e(m.head_dim, dtype=dtype), 1e-6)
    yield "rms_norm_fp8 q_lora", lambda: dsv4_rms_norm_fp8(_e(t, m.q_lora, dtype=dtype), _e(m.q_lora, dtype=dtype),
                                                             1e-6)
    pos, inv = torch.zeros(t, dtype=torch.int64, device="meta"), _e(m.rope_dim // 2, dtype=torch.float32)
    yield "qk_norm_rope q", lambda: dsv4_qk_norm_rope(_e(t, m.heads, m.head_dim, dtype=dtype), None, 1e-6, pos, inv)
    yield "qk_norm_rope kv", lambda: dsv4_qk_norm_rope(_e(t, m.head_dim, dtype=dtype), _e(m.head_dim, dtype=dtype),
                                                        1e-6, pos, inv)
    yield "rope inverse", lambda: dsv4_rope(_e(t, m.heads, m.head_dim, dtype=dtype), pos, inv, inverse=True)
    yield "rope_fp8 inverse", lambda: dsv4_rope_fp8(_e(t, m.heads, m.head_dim, dtype=dtype), pos, inv, inverse=True)


def linear_cases(m: ModelShapes, t: int, dtype, target: AotTarget):
    fp8 = target.fp8_dtype
    per_group = m.heads * m.head_dim // m.o_groups
    linears = {"wq_a": (m.q_lora, m.hidden, 1), "wq_b": (m.heads * m.head_dim, m.q_lora, 1),
               "wkv": (m.head_dim, m.hidden, 1), "wo_a": (m.o_groups * m.o_lora, m.heads * m.head_dim, m.o_groups),
               "wo_b": (m.hidden, m.o_groups * m.o_lora, 1), "index wq_b": (m.index_heads * m.index_dim, m.q_lora, 1),
               "shared w13": (2 * m.inter, m.hidden, 1), "shared w2": (m.hidden, m.inter, 1)}
    for name, (n, k, g) in linears.items():
        w, s = _e(n, k // g if g > 1 else k, dtype=fp8), _e(-(-n // 128), -(-(k // g) // 128), dtype=torch.float32)
        if g > 1:
            w = _e(n, per_group, dtype=fp8)
        if t > SKINNY_ROWS:
            yield f"fp8 dequant {name}", lambda w=w, s=s: dsv4_fp8_dequant(w, s, dtype)
            continue
        for act in (True, False):
            yield (f"fp8 gemm {name} {'w8a8' if act else 'w8a16'}",
                   lambda w=w, s=s, k=k, g=g, act=act: dsv4_fp8_block_gemm(_e(t, k, dtype=dtype), w, s, g,
                                                                            out_dtype=dtype, quantize_act=act))
    yield "fp8 act_quant", lambda: dsv4_fp8_act_quant(_e(t, m.hidden, dtype=dtype))
    w, s = _e(m.hidden, m.inter, dtype=fp8), _e(m.hidden // 128, m.inter // 128, dtype=torch.float32)
    a, a_s = _e(t, m.inter, dtype=fp8), _e(t, m.inter // 128, dtype=torch.float32)
    yield "fp8 scaled_gemm shared w2", lambda: dsv4_fp8_scaled_gemm(a, a_s, w, s, out_dtype=dtype)


def mhc_cases(m: ModelShapes, t: int, dtype, target: AotTarget):
    n, d = m.hc, m.hidden
    mix = (2 + n) * n
    streams = _e(t, n, d, dtype=dtype)
    fn, scale, base = _e(mix, n * d, dtype=torch.float32), _e(3, dtype=torch.float32), _e(mix, dtype=torch.float32)
    w = _e(d, dtype=dtype)
    yield "hc_pre", lambda: dsv4_hc_pre(streams, fn, scale, base, 20, 1e-6, 1e-6)
    yield "hc_pre_norm", lambda: dsv4_hc_pre_norm(streams, fn, scale, base, 20, 1e-6, 1e-6, w, 1e-6)
    yield "hc_pre_norm_fp8", lambda: dsv4_hc_pre_norm_fp8(streams, fn, scale, base, 20, 1e-6, 1e-6, w, 1e-6)
    post, comb = _e(t, n, dtype=torch.float32), _e(t, n, n, dtype=torch.float32)
    yield "hc_post", lambda: dsv4_hc_post(_e(t, d, dtype=dtype), streams, post, comb)
    if t <= POST_MIXES_ROWS:  # the next sub-layer's mixes (or the head's) carried by hc_post
        for rows in (mix, n):
            yield f"hc_post_mixes {rows}", lambda rows=rows: dsv4_hc_post_mixes(
                _e(t, d, dtype=dtype), streams, post, comb, _e(rows, n * d, dtype=torch.float32))
    yield "hc_head", lambda: dsv4_hc_head(streams, _e(n, n * d, dtype=torch.float32), _e(1, dtype=torch.float32),
                                          _e(n, dtype=torch.float32), 1e-6, 1e-6)


def moe_cases(m: ModelShapes, t: int, dtype, target: AotTarget):
    d, i, e, k = m.hidden, m.inter, m.experts, m.top_k
    x = _e(t, d, dtype=dtype)
    wts = _e(t, k, dtype=torch.float32)
    yield "router score", lambda: dsv4_router(x, _e(e, d, dtype=torch.float32), _e(e, dtype=torch.float32), None,
                                              None, k, 1.5)
    yield "router hash", lambda: dsv4_router(x, _e(e, d, dtype=torch.float32), None, _ids(m.vocab, k, e),
                                             torch.zeros(t, dtype=torch.int64, device="meta"), k, 1.5)
    ids = _ids(t, k, e)
    u8 = torch.uint8
    # MXFP4 experts keep their scale bytes chunked (layers/quantization/mxfp4.py); real checkpoints' fit the planes
    s13, s2 = as_rows(chunked_empty(e, 2 * i, d // 32, "meta")), as_rows(chunked_empty(e, d, i // 32, "meta"))
    for gemv in (True, False):
        yield f"moe mxfp4 gemv={gemv}", lambda gemv=gemv: dsv4_moe_mxfp4(
            x, ids, wts, _e(e, 2 * i, d // 2, dtype=u8), s13, _e(e, d, i // 2, dtype=u8), s2, 10.0,
            scales_fit_planes=True, gemv=gemv, add=_e(t, d, dtype=dtype))
    fp8 = target.fp8_dtype
    yield "moe fp8", lambda: dsv4_moe_fp8(x, ids, wts, _e(e, 2 * i, d, dtype=fp8),
                                          _e(e, 2, i // 128, d // 128, dtype=torch.float32), _e(e, d, i, dtype=fp8),
                                          _e(e, 1, d // 128, i // 128, dtype=torch.float32), 10.0)
    w13 = _e(e, 2 * i, d, dtype=dtype)
    yield "moe dense", lambda: dsv4_moe_dense(x, ids, wts, w13[:, :i], w13[:, i:], _e(e, d, i, dtype=dtype), 10.0)
    gate, up = _e(t, i, dtype=dtype), _e(t, i, dtype=dtype)
    yield "shared swiglu", lambda: dsv4_clamped_swiglu(gate, up, 10.0)
    yield "shared swiglu_fp8", lambda: dsv4_clamped_swiglu_fp8(gate, up, 10.0)


def row_phase(t: int) -> str:
    """What the plan's row count `t` stands for: a decode batch, a verify batch or a prefill chunk."""
    return "decode" if t in DECODE_ROWS else "verify" if t in VERIFY_ROWS else "prefill"


def attention_cases(m: ModelShapes, t: int, dtype, target: AotTarget, phase: str = ""):
    """One request per row at decode and verify (4 rows a request there), one request per prefill chunk. phase:
    row_phase(t) unless given (a prefill chunk of any row count: engine/prefill warm-up plans)."""
    phase = phase or row_phase(t)
    reqs = t if phase == "decode" else max(1, t // 4) if phase == "verify" else 1
    slots, i64, f32 = CONTEXT * max(reqs, 1), torch.int64, torch.float32
    fp8_cache = dtype != torch.float32  # FP8 KV rows serving; the fp32 oracle keeps dense rows
    rope = m.rope_dim if fp8_cache else 0
    width = fp8_kv_row_bytes(m.head_dim, rope) if fp8_cache else m.head_dim
    cache = _e(slots, width, dtype=torch.uint8 if fp8_cache else dtype)
    row_slots = torch.zeros(t, dtype=i64, device="meta")
    yield "store_kv", lambda: dsv4_store_kv(cache, row_slots, _e(t, m.head_dim, dtype=dtype), fp8_rope_dim=rope)
    q = _e(t, m.heads, m.head_dim, dtype=dtype)
    window = _ids(t, m.window, slots)
    sink = _e(m.heads, dtype=f32)
    yield "attention swa", lambda: dsv4_sparse_attention(q, cache, window, sink=sink, softmax_scale=0.04,
                                                         fp8_rope_dim=rope)
    yield "attention csa", lambda: dsv4_sparse_attention(q, cache, window, cache, _ids(t, m.index_topk, slots),
                                                         sink=sink, softmax_scale=0.04, fp8_rope_dim=rope)
    row_req = torch.zeros(t, dtype=i64, device="meta")
    hca = _ids(reqs, CONTEXT // 128, slots)
    yield "attention hca", lambda: dsv4_sparse_attention(q, cache, window, cache, hca, row_req, row_req, sink=sink,
                                                         softmax_scale=0.04, fp8_rope_dim=rope)
    yield from _compressor_cases(m, t, reqs, dtype, fp8_cache, phase)
    yield from _indexer_cases(m, t, reqs, dtype, fp8_cache)
    if phase != "prefill":
        yield from _metadata_cases(m, t, reqs)


def _compressor_cases(m: ModelShapes, t: int, reqs: int, dtype, fp8_cache: bool, phase: str):
    f32, i64 = torch.float32, torch.int64
    kinds = (("csa", 4, True, m.head_dim, "fp8_kv" if fp8_cache else "dense", False),
             ("hca", 128, False, m.head_dim, "fp8_kv" if fp8_cache else "dense", False),
             ("index", 4, True, m.index_dim, "fp4_index" if fp8_cache else "dense", fp8_cache))
    for name, ratio, overlap, d, fmt, hadamard in kinds:
        c = 2 * d if overlap else d
        ring_rows = reqs * (2 * ratio if overlap else ratio)
        ring, fresh = _e(ring_rows, 2, c, dtype=f32), _e(t, 2, c, dtype=f32)
        n = max(1, t // ratio) if phase != "decode" else t
        rope = m.rope_dim if fmt == "fp8_kv" else 0
        out = _e(CONTEXT * reqs // ratio, row_width(fmt, d, rope, dtype),
                 dtype=torch.uint8 if fmt != "dense" else dtype)
        args = dict(ratio=ratio, overlap=overlap, head_dim=d, norm_weight=_e(d, dtype=dtype), eps=1e-6,
                    positions=torch.zeros(n, dtype=i64, device="meta"), inv_freq=_e(m.rope_dim // 2, dtype=f32),
                    rope_dim=m.rope_dim, out_cache=out, out_slots=torch.zeros(n, dtype=i64, device="meta"),
                    out_format=fmt, hadamard=hadamard, compute_dtype=dtype)
        src = _ids(n, 2 * ratio if overlap else ratio, ring_rows + t)
        dst = torch.zeros(t, dtype=i64, device="meta")
        yield f"compress {name}", lambda ring=ring, fresh=fresh, src=src, args=args: dsv4_compress(ring, fresh, src,
                                                                                                     **args)
        yield f"update_ring {name}", lambda ring=ring, fresh=fresh: dsv4_update_ring(ring, dst, fresh, dst)
        if phase != "prefill":
            boundary = _e(reqs, 2, c, dtype=f32) if overlap else None
            yield f"compress_staged {name}", lambda ring=ring, fresh=fresh, src=src, args=args, b=boundary: \
                dsv4_compress_staged(ring, fresh, src, ring_dst=dst, ring_src=dst, boundary=b,
                                     boundary_dst=dst if b is not None else None,
                                     boundary_src=dst if b is not None else None, **args)
    if t <= 2:  # models/deepseek_v4.FUSED_PROJ_MAX_ROWS
        x = _e(t, m.hidden, dtype=dtype)
        off = torch.zeros(t, dtype=i64, device="meta")
        csa = [_e(4 * m.head_dim, m.hidden, dtype=f32), _e(4 * m.index_dim, m.hidden, dtype=f32)]
        apes = [_e(4, 2 * m.head_dim, dtype=f32), _e(4, 2 * m.index_dim, dtype=f32)]
        yield "compressor_proj csa", lambda: dsv4_compressor_proj(x, off, csa, apes, _e(m.index_heads, m.hidden,
                                                                                          dtype=dtype), 0.01)
        yield "compressor_proj hca", lambda: dsv4_compressor_proj(x, off, [_e(2 * m.head_dim, m.hidden, dtype=f32)],
                                                                  [_e(128, m.head_dim, dtype=f32)])


def _indexer_cases(m: ModelShapes, t: int, reqs: int, dtype, fp8_cache: bool):
    entries = CONTEXT // 4
    fmts = ("fp4_index", "fp8_index") if fp8_cache else ("dense",)
    for fmt in fmts:
        cache = _e(CONTEXT * reqs // 4, row_width(fmt, m.index_dim, 0, dtype),
                   dtype=torch.uint8 if fmt != "dense" else dtype)
        cand = _ids(reqs, entries, cache.shape[0])
        row_req = torch.zeros(t, dtype=torch.int64, device="meta")
        yield f"index_logits {fmt}", lambda cache=cache, cand=cand, fmt=fmt: dsv4_index_logits(
            _e(t, m.index_heads, m.index_dim, dtype=dtype), _e(t, m.index_heads, dtype=torch.float32), cache, fmt,
            cand, row_req, row_req, _e(t, entries, dtype=torch.float32), fill_invisible=False)
    # as the engine calls them (attention/dsv4/backend_base.py): logits of the visible entries, top-k of those
    yield "topk_slots", lambda: dsv4_topk_slots(_e(t, entries, dtype=torch.float32), cand, row_req, m.index_topk,
                                                visible=row_req)


def _metadata_cases(m: ModelShapes, t: int, reqs: int):
    i64 = torch.int64
    pos = torch.zeros(t, dtype=i64, device="meta")
    r2t, f2s = _ids(reqs, CONTEXT, CONTEXT * reqs).int(), _ids(1, CONTEXT * reqs, CONTEXT * reqs).view(-1)
    specs = [DecodeRatioSpec(4, True, 8, 8 * reqs, True), DecodeRatioSpec(128, False, 128, 128 * reqs)]
    yield "decode_metadata", lambda: dsv4_decode_metadata(pos, pos, pos, r2t, f2s, m.window, 256, specs)
    yield "write_slots", lambda: dsv4_write_slots(r2t, f2s, pos, pos, pos, pos)


GROUPS = (norm_cases, linear_cases, mhc_cases, moe_cases, attention_cases)


def plan_cases(target: AotTarget, models: tuple = ()):
    """(label, thunk) for every launch case on `target` (of `models` by name, all if empty): each thunk calls one
    wrapper as the engine does."""
    for m in [m for m in MODELS if not models or m.name in models]:
        for t in ROWS:
            for dtype in DTYPES:
                for group in GROUPS:
                    for label, case in group(m, t, dtype, target):
                        yield f"{m.name} T={t} {str(dtype).removeprefix('torch.')} {label}", case


def prefill_cases(m: ModelShapes, t: int, dtype, target: AotTarget):
    """(label, thunk) for the launches of one prefill chunk of `t` rows (one request) at `m`'s shapes in `dtype`,
    whatever `t` is (plan_cases reads decode and verify batches into some row counts)."""
    for group in GROUPS:
        extra = {"phase": "prefill"} if group is attention_cases else {}
        for label, case in group(m, t, dtype, target, **extra):
            yield f"{m.name} T={t} prefill {label}", case
