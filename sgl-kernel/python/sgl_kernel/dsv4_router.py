"""The DeepSeek-V4 MoE router in one launch (docs/dsv4-architecture.md section 6): logits, sqrtsoftplus scores, the
selection, the weights, and the MoE's id remapping and shared-expert column.

    logits = x . W^T (fp32 sums; W [E, D] fp32 or 16-bit, read as stored)   scores = sqrt(softplus(logits))
    score layers: ids = the top-k of (scores + bias) by (value descending, expert ascending), in that order
    hash layers:  ids = tid2eid[input_ids]
    weights = scores[ids] / (sum of them + 1e-20) * routed_scaling_factor      (the unbiased scores)
    then, for the MoE: ids outside this rank's experts [start, start + count) -> -1 at weight 0, the others made
    local (id - start); optionally one more column per token, the fused shared expert's id at weight 1.

Ties: torch.topk leaves the choice among equal values to its implementation (on the CPU it returns arbitrary
members of a tied run), so the rule here is explicit and the reference (`dsv4_router_ref`, and the engine's torch
path) follows it through a stable descending sort: the lower expert id wins a tie, and the ids come out sorted.

Letters: T tokens, D hidden, E experts, k picks. Grid (expert blocks x D splits, token blocks). Each program sums
its [BLOCK_T, BLOCK_E] logits over its D split: a broadcast multiply-sum for a few tokens (the decode GEMV), tl.dot
for 16 or more rows. Each writes its partial sums to a workspace and counts itself in on the token block's counter
(an atomic: only the count depends on arrival order); the last to arrive sets the counter back to 0, adds the
partials in split order (the same bits whatever the order of arrival) and routes the rows, 16 at a time at E 256.
The counters are a per-device buffer that stays zero between launches, so a launch needs no memset: one kernel per
call. Launches on one device must not run concurrently (the engine runs one stream).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Optional

import torch
import triton
import triton.language as tl

from sgl_kernel.dsv4_pdl import interpreting

SOFTPLUS_THRESHOLD = tl.constexpr(20.0)  # torch.nn.functional.softplus's default: above it softplus(x) = x


@dataclass(frozen=True)
class RouterLaunch:
    """Token rows and experts per program, hidden values per step, D splits (programs per expert block), warps."""
    block_t: int
    block_e: int
    block_d: int
    split_d: int = 1
    num_warps: int = 4


def router_launch(tokens: int, num_experts: int, hidden: int) -> RouterLaunch:
    """A launch filling the GPU: decode (<= 8 tokens) GEMVs of 4 experts x 1024 / T values (4 warps hold
    BLOCK_T x BLOCK_E x BLOCK_D = 4096 products), the weight read once, split over ~128 programs; more tokens 16-row
    dots over 32 experts, D split until ~128 programs; prefill 64-row dots over 64 experts, no split."""
    e_pad = triton.next_power_of_2(num_experts)
    if tokens <= 8:
        block_t, block_e = triton.next_power_of_2(max(tokens, 1)), min(4, e_pad)
        block_d = 4096 // (block_t * block_e)
    elif tokens <= 256:
        block_t, block_e, block_d = 16, min(32, e_pad), 64
    else:
        block_t, block_e, block_d = 64, min(64, e_pad), 32
    programs = triton.cdiv(num_experts, block_e) * triton.cdiv(tokens, block_t)
    max_split = max(1, triton.cdiv(hidden, block_d))
    split_d = min(max_split, triton.next_power_of_2(triton.cdiv(128, programs)))
    return RouterLaunch(block_t, block_e, block_d, split_d, 4)


_counters: dict = {}  # device -> int32 zeros, one per token block; each launch leaves them zero


def _token_block_counters(device: torch.device, n: int) -> torch.Tensor:
    have = _counters.get(device)
    if have is None or have.numel() < n:
        if device.type == "cuda" and torch.cuda.is_current_stream_capturing():
            raise RuntimeError("dsv4_router: the first launch of this size must run before CUDA-graph capture "
                               "(it allocates the launch counters)")
        have = _counters[device] = torch.zeros(max(n, 1024), dtype=torch.int32, device=device)
    return have


@triton.jit
def _partial_logits(x_ptr, w_ptr, rows, cols, d_lo, d_hi, T, E, stride_x, stride_w, BLOCK_T: tl.constexpr,
                    BLOCK_E: tl.constexpr, BLOCK_D: tl.constexpr, USE_DOT: tl.constexpr, NATIVE: tl.constexpr):
    """[BLOCK_T, BLOCK_E] fp32 sums of x[rows, d] * W[cols, d] over d in [d_lo, d_hi) (zeros past T / E)."""
    acc = tl.zeros([BLOCK_T, BLOCK_E], dtype=tl.float32)
    row_ok = rows < T
    col_ok = cols < E
    x_rows = x_ptr + rows.to(tl.int64)[:, None] * stride_x
    w_rows = w_ptr + cols.to(tl.int64)[:, None] * stride_w
    for d0 in range(d_lo, d_hi, BLOCK_D):
        d = d0 + tl.arange(0, BLOCK_D)
        d_ok = d < d_hi
        xt = tl.load(x_rows + d[None, :], mask=row_ok[:, None] & d_ok[None, :], other=0.0)
        wt = tl.load(w_rows + d[None, :], mask=col_ok[:, None] & d_ok[None, :], other=0.0)
        if USE_DOT:
            if NATIVE:  # 16-bit x and W: exact products, fp32 sums
                acc = tl.dot(xt, tl.trans(wt), acc)
            else:
                acc = tl.dot(xt.to(tl.float32), tl.trans(wt.to(tl.float32)), acc, input_precision="ieee")
        else:
            acc += tl.sum(xt.to(tl.float32)[:, None, :] * wt.to(tl.float32)[None, :, :], axis=2)
    return acc


@triton.jit
def _sqrt_softplus(z):
    """sqrt(softplus(z)) as torch computes it: z above the threshold, else log1p(exp(z)); log1p(u - 1) by
    log(u) * (e / (u - 1)) with u = 1 + e (exact to a few ulp where a plain log(1 + e) loses e's digits)."""
    e = tl.exp(tl.minimum(z, SOFTPLUS_THRESHOLD))
    u = 1.0 + e
    small = u == 1.0
    log1p = tl.where(small, e, tl.log(u) * (e / tl.where(small, 1.0, u - 1.0)))
    return tl.sqrt_rn(tl.where(z > SOFTPLUS_THRESHOLD, z, log1p))


@triton.jit
def _route_rows(logits, rows, T, E, bias_ptr, tid_ptr, ids_in_ptr, stride_tid, out_w_ptr, out_id_ptr, stride_ow,
                stride_oid, local_start, num_local, shared_id, scale, BLOCK_T: tl.constexpr, E_PAD: tl.constexpr,
                TOPK: tl.constexpr, K_PAD: tl.constexpr, HASH: tl.constexpr, SHARED: tl.constexpr):
    """From the rows' logits [BLOCK_T, E_PAD] (columns past E ignored): pick, weigh, remap and write the rows."""
    cols = tl.arange(0, E_PAD)
    col_ok = cols < E
    kcols = tl.arange(0, K_PAD)
    row_ok = rows < T
    scores = _sqrt_softplus(logits)
    if HASH:
        tok = tl.load(ids_in_ptr + rows, mask=row_ok, other=0).to(tl.int64)
        table = tl.load(tid_ptr + tok[:, None] * stride_tid + kcols[None, :],
                        mask=row_ok[:, None] & (kcols < TOPK)[None, :], other=0).to(tl.int32)
        biased = scores  # unused
    else:
        bias = tl.load(bias_ptr + cols, mask=col_ok, other=0.0).to(tl.float32)
        biased = tl.where(col_ok[None, :], scores + bias[None, :], float("-inf"))
        table = tl.zeros([BLOCK_T, K_PAD], dtype=tl.int32)  # unused
    picked_w = tl.zeros([BLOCK_T, K_PAD], dtype=tl.float32)
    picked_id = tl.zeros([BLOCK_T, K_PAD], dtype=tl.int32)
    for j in tl.static_range(TOPK):
        if HASH:
            idx = tl.sum(tl.where(kcols[None, :] == j, table, 0), axis=1)
        else:
            top = tl.max(biased, axis=1)
            idx = tl.min(tl.where(biased == top[:, None], cols[None, :], E_PAD), axis=1)
            idx = tl.minimum(idx, E - 1)  # in range even for a NaN row
        hit = cols[None, :] == idx[:, None]
        w = tl.sum(tl.where(hit, scores, 0.0), axis=1)
        if not HASH:
            biased = tl.where(hit, float("-inf"), biased)
        picked_w = tl.where(kcols[None, :] == j, w[:, None], picked_w)
        picked_id = tl.where(kcols[None, :] == j, idx[:, None], picked_id)
    total = tl.sum(picked_w, axis=1)  # columns past TOPK hold 0
    picked_w = picked_w / (total[:, None] + 1e-20) * scale
    local = picked_id - local_start
    mine = (local >= 0) & (local < num_local)
    out_id = tl.where(mine, local, -1)
    out_w = tl.where(mine, picked_w, 0.0)
    if SHARED:  # the fused shared expert: every token's column TOPK, weight 1
        out_id = tl.where(kcols[None, :] == TOPK, shared_id, out_id)
        out_w = tl.where(kcols[None, :] == TOPK, 1.0, out_w)
    width = TOPK + SHARED
    mask = row_ok[:, None] & (kcols < width)[None, :]
    r64 = rows.to(tl.int64)[:, None]
    tl.store(out_w_ptr + r64 * stride_ow + kcols[None, :], out_w, mask=mask)
    tl.store(out_id_ptr + r64 * stride_oid + kcols[None, :], out_id.to(tl.int64), mask=mask)


@triton.jit
def _router_kernel(x_ptr, w_ptr, bias_ptr, tid_ptr, ids_in_ptr, ws_ptr, cnt_ptr, out_w_ptr, out_id_ptr,
                   T, D, E, d_per_split, split_d, stride_x, stride_w, stride_tid, stride_ow, stride_oid,
                   local_start, num_local, shared_id, scale,
                   BLOCK_T: tl.constexpr, BLOCK_E: tl.constexpr, BLOCK_D: tl.constexpr, E_PAD: tl.constexpr,
                   ROUTE_T: tl.constexpr, TOPK: tl.constexpr, K_PAD: tl.constexpr, HASH: tl.constexpr,
                   SHARED: tl.constexpr, USE_DOT: tl.constexpr, NATIVE: tl.constexpr):
    """program_id(1): a block of BLOCK_T tokens; program_id(0) = split * expert blocks + expert block. The partial
    logits go through the workspace ws [split_d, T, E_PAD]; the token block's last program to arrive sums them and
    routes the block ROUTE_T rows at a time (a [ROUTE_T, E_PAD] tile fits the registers)."""
    tb = tl.program_id(1)
    num_eb = tl.cdiv(E, BLOCK_E)
    eb = tl.program_id(0) % num_eb
    split = tl.program_id(0) // num_eb
    rows = tb * BLOCK_T + tl.arange(0, BLOCK_T)
    cols = eb * BLOCK_E + tl.arange(0, BLOCK_E)
    d_lo = split * d_per_split
    d_hi = tl.minimum(d_lo + d_per_split, D)
    acc = _partial_logits(x_ptr, w_ptr, rows, cols, d_lo, d_hi, T, E, stride_x, stride_w, BLOCK_T, BLOCK_E,
                          BLOCK_D, USE_DOT, NATIVE)
    tl.store(ws_ptr + (split * T + rows.to(tl.int64)[:, None]) * E_PAD + cols[None, :], acc,
             mask=(rows < T)[:, None])
    tl.debug_barrier()  # every thread's partials stored before the count releases them
    arrived = tl.atomic_add(cnt_ptr + tb, 1, sem="acq_rel")
    if arrived == tl.num_programs(0) - 1:  # the others' partials are visible (acquire): read them from L2
        tl.store(cnt_ptr + tb, 0)  # zero for the next launch
        all_cols = tl.arange(0, E_PAD)
        for r0 in tl.static_range(0, BLOCK_T, ROUTE_T):
            sub = tb * BLOCK_T + r0 + tl.arange(0, ROUTE_T)
            part = ws_ptr + sub.to(tl.int64)[:, None] * E_PAD + all_cols[None, :]
            ok = (sub < T)[:, None] & (all_cols < E)[None, :]  # columns past E were never written
            logits = tl.load(part, mask=ok, other=0.0, cache_modifier=".cg")
            for s in range(1, split_d):  # in split order: the same sums whatever the order of arrival
                logits += tl.load(part + s * T * E_PAD, mask=ok, other=0.0, cache_modifier=".cg")
            _route_rows(logits, sub, T, E, bias_ptr, tid_ptr, ids_in_ptr, stride_tid, out_w_ptr, out_id_ptr,
                        stride_ow, stride_oid, local_start, num_local, shared_id, scale, ROUTE_T, E_PAD, TOPK,
                        K_PAD, HASH, SHARED)


def dsv4_router(x: torch.Tensor, weight: torch.Tensor, bias: Optional[torch.Tensor], tid2eid: Optional[torch.Tensor],
                input_ids: Optional[torch.Tensor], top_k: int, routed_scaling_factor: float,
                local_experts: Optional[range] = None, shared_expert_id: Optional[int] = None,
                launch: Optional[RouterLaunch] = None) -> tuple:
    """x [T, D], weight [E, D] -> (weights [T, k'] fp32, ids [T, k'] int64), k' = top_k (+1 with a shared expert).

    Score layers pass `bias` [E] (tid2eid and input_ids None); hash layers `tid2eid` [V, top_k] and `input_ids` [T]
    (bias None). `local_experts`: this rank's global expert ids (expert parallelism): the others become -1 at weight
    0, these id - start. `shared_expert_id`: appended to every row at weight 1. `launch`: overrides router_launch.
    Reads nothing back (graph-capturable once a call of the same size has run outside capture)."""
    tokens, hidden = x.shape
    num_experts = weight.shape[0]
    use_hash = tid2eid is not None
    if weight.shape[1] != hidden or not 0 < top_k <= num_experts or use_hash == (bias is not None):
        raise ValueError(f"dsv4_router takes x [T, D], weight [E, D], 0 < top_k <= E and either a bias or a hash "
                         f"table; got x {tuple(x.shape)}, weight {tuple(weight.shape)}, top_k {top_k}, "
                         f"bias {bias is not None}, tid2eid {use_hash}")
    if use_hash and (input_ids is None or tid2eid.shape[1] != top_k or input_ids.shape != (tokens,)):
        raise ValueError("dsv4_router: a hash layer needs tid2eid [V, top_k] and input_ids [T]")
    shared = shared_expert_id is not None
    width = top_k + shared
    out_w = torch.empty(tokens, width, dtype=torch.float32, device=x.device)
    out_id = torch.empty(tokens, width, dtype=torch.int64, device=x.device)
    if tokens == 0:
        return out_w, out_id
    x = x if x.stride(-1) == 1 else x.contiguous()
    weight = weight if weight.stride(-1) == 1 else weight.contiguous()
    if use_hash and tid2eid.stride(-1) != 1:
        tid2eid = tid2eid.contiguous()
    if bias is not None and bias.stride(0) != 1:
        bias = bias.contiguous()
    cfg = launch or router_launch(tokens, num_experts, hidden)
    e_pad = triton.next_power_of_2(num_experts)
    block_e = min(cfg.block_e, e_pad)
    num_eb, num_tb = triton.cdiv(num_experts, block_e), triton.cdiv(tokens, cfg.block_t)
    d_per_split = triton.cdiv(triton.cdiv(hidden, cfg.split_d), cfg.block_d) * cfg.block_d
    split_d = triton.cdiv(hidden, d_per_split)
    ws = torch.empty(split_d, tokens, e_pad, dtype=torch.float32, device=x.device)
    counters = _token_block_counters(x.device, num_tb)
    use_dot = cfg.block_t >= 16 and block_e >= 16 and cfg.block_d >= 16
    native = use_dot and x.dtype == weight.dtype and x.dtype in (torch.bfloat16, torch.float16) and not interpreting()
    local = local_experts if local_experts is not None else range(0, num_experts)
    # rows routed at a time: 32 logits a thread per [ROUTE_T, E_PAD] tile (the routing holds ~3 such tiles)
    route_t = min(cfg.block_t, max(1, 32 * 32 * cfg.num_warps // e_pad))
    _router_kernel[(num_eb * split_d, num_tb)](
        x, weight, bias if bias is not None else weight, tid2eid if use_hash else out_id,
        input_ids if use_hash else out_id, ws, counters, out_w, out_id,
        tokens, hidden, num_experts, d_per_split, split_d, x.stride(0), weight.stride(0),
        tid2eid.stride(0) if use_hash else 0, out_w.stride(0), out_id.stride(0),
        local.start, len(local), shared_expert_id if shared else 0, float(routed_scaling_factor),
        BLOCK_T=cfg.block_t, BLOCK_E=block_e, BLOCK_D=cfg.block_d, E_PAD=e_pad, ROUTE_T=route_t, TOPK=top_k,
        K_PAD=triton.next_power_of_2(width), HASH=use_hash, SHARED=shared, USE_DOT=use_dot, NATIVE=native,
        num_warps=cfg.num_warps)
    return out_w, out_id


def select_top_k(biased: torch.Tensor, top_k: int) -> torch.Tensor:
    """[T, E] -> [T, top_k] int64: each row's top_k columns by (value descending, column ascending), in that order."""
    return torch.sort(biased, dim=-1, descending=True, stable=True).indices[:, :top_k]


def dsv4_router_ref(x: torch.Tensor, weight: torch.Tensor, bias: Optional[torch.Tensor],
                    tid2eid: Optional[torch.Tensor], input_ids: Optional[torch.Tensor], top_k: int,
                    routed_scaling_factor: float, local_experts: Optional[range] = None,
                    shared_expert_id: Optional[int] = None, launch: Optional[RouterLaunch] = None) -> tuple:
    """dsv4_router in torch (fp32; `launch` ignored): the engine's torch path (layers/moe/router.py) op for op."""
    scores = torch.nn.functional.softplus(torch.nn.functional.linear(x.float(), weight.float())).sqrt()
    ids = tid2eid[input_ids] if tid2eid is not None else select_top_k(scores + bias.float(), top_k)
    weights = scores.gather(1, ids)
    weights = weights / (weights.sum(dim=-1, keepdim=True) + 1e-20) * routed_scaling_factor
    if local_experts is not None:
        local = ids - local_experts.start
        mine = (local >= 0) & (local < len(local_experts))
        ids, weights = torch.where(mine, local, -1), torch.where(mine, weights, 0.0)
    if shared_expert_id is not None:
        ids = torch.cat((ids, ids.new_full((ids.shape[0], 1), shared_expert_id)), dim=1)
        weights = torch.cat((weights, weights.new_ones(weights.shape[0], 1)), dim=1)
    return weights, ids


__all__ = ["RouterLaunch", "dsv4_router", "dsv4_router_ref", "router_launch", "select_top_k"]
