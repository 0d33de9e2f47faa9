"""What travels for a DeepSeek-V4 request from the prefill server to the decode server, as byte ranges of pool memory.

There is no per-token KV to send: after a prompt of n tokens the decode side needs exactly (docs/disaggregation.md,
"What travels for a V4 request"):
- window KV, every layer (MTP layers included): the rows of positions [n - (W - 1), n), the only ones a query at
  position n or later can still see (W = sliding_window);
- compressed KV, every compressed layer: entries [0, n // m), one per complete window, page by page;
- indexer keys, every CSA layer: the same entries of the index-key pool, in its pooled format (FP8 / FP4 as stored);
- compressor staging rows, every compressor (attention and indexer): positions [lo, n), lo = the start of the open
  window (HCA) or of the window before it (CSA, overlapping): what the next completed window pools;
- with the prefix cache, the CSA boundary rows of positions [P - m, n) when n lies in the last m of its page (P, the
  page's end): the decode side's cache saves them at P, and part of them was computed here;
- under speculative decoding, the MTP draft state of the request: d_1, its streams S_1 and, for a sampled request,
  its draft distribution q_1 (DraftStateBuffers; the MTP layer's window rows are among the window KV above).
The staging rows go as the pool stores them (fp32 content and gate logits, `ape` added) and every entry in the pool's
own format, so a transfer is a byte copy: nothing is re-encoded and nothing is staged through the host.

Both servers must pool the same way (the same layer kinds, entry formats, ring sizes and prefix-cache setting;
`layout_signature` compares them). Each side describes its own request's bytes as Regions (buffer index in
`transfer_buffers`, byte offset, length), merged where its own slots are contiguous; the two lists cover the same
logical bytes in the same order, and `pair_regions` cuts them at the boundaries of both into one-to-one
(source address, destination address, length) triples for the transfer engine, merging what is contiguous on both.
"""

from __future__ import annotations

import json
from dataclasses import dataclass
from typing import Optional

import torch

from sglang.srt.disaggregation.transfer import RegisteredBuffer, coalesce
from sglang.srt.mem_cache.deepseek_v4_pool import CompressorState, DeepSeekV4TokenToKVPool


@dataclass(frozen=True)
class Region:
    """`nbytes` bytes at byte `offset` of buffer `buffer` (an index into transfer_buffers)."""

    buffer: int
    offset: int
    nbytes: int


@dataclass(frozen=True)
class RequestKV:
    """Where one request's prompt state lies in its side's pools (source on the prefill side, destination on the
    decode side)."""

    req_pool_idx: int
    num_tokens: int  # n: prompt positions computed
    pages: tuple  # page of positions [i * page_size, (i + 1) * page_size), for every page of [0, n)
    window_slots: tuple  # window slot of each position of [n - window_tail(W, n), n), in order
    draft: bool = False  # the MTP draft state travels (speculative decoding)
    draft_probs: bool = False  # ... with the draft distribution (a sampled request)


@dataclass(frozen=True)
class TransferPlan:
    """One batch for TransferBackend.write: copy lengths[i] bytes from src_addrs[i] to dst_addrs[i]."""

    src_addrs: list
    dst_addrs: list
    lengths: list

    @property
    def nbytes(self) -> int:
        return sum(self.lengths)


def window_tail(sliding_window: int, num_tokens: int) -> int:
    """Window positions the decode side needs after a prompt of num_tokens: a query at n sees [n - W + 1, n]."""
    return min(num_tokens, sliding_window - 1)


class DraftStateBuffers:
    """The MTP draft state of a request that finished its prefill, at its request slot, in memory the transfer engine
    reads and writes: d_1 (int64), the streams S_1 [n_hc, D] it came with and, for sampled requests, q_1 [V]. It
    lives on the device beside the pools; a request's row is written by its prefill side right before the transfer
    and read by its decode side once the bytes arrived (the SpecState itself holds device tensors, not pool rows)."""

    def __init__(self, max_num_reqs: int, hc_mult: int, hidden_size: int, vocab_size: int, dtype: torch.dtype,
                 device) -> None:
        rows = max_num_reqs + 1  # slot 0 reserved, as in every pool
        self.token = torch.zeros(rows, dtype=torch.int64, device=device)
        self.streams = torch.zeros(rows, hc_mult, hidden_size, dtype=dtype, device=device)
        self.probs = torch.zeros(rows, vocab_size, dtype=torch.float32, device=device)

    @classmethod
    def for_runner(cls, runner) -> "DraftStateBuffers":
        config = runner.model_config
        return cls(runner.req_to_token_pool.size, config.hc_mult, config.hidden_size, config.vocab_size,
                   runner.model.embed.weight.dtype, runner.device)

    def store(self, req_pool_idx: int, spec) -> None:
        """Write a request's SpecState (speculative/eagle_worker.py) into its row."""
        self.token[req_pool_idx] = spec.draft_token
        self.streams[req_pool_idx] = spec.draft_streams
        if spec.draft_probs is not None:
            self.probs[req_pool_idx] = spec.draft_probs

    def load(self, req_pool_idx: int, sampled: bool) -> tuple:
        """(d_1, S_1, q_1 or None) of a row, as new tensors (the row is reused by the next request in the slot)."""
        probs = self.probs[req_pool_idx].clone() if sampled else None
        return self.token[req_pool_idx].clone(), self.streams[req_pool_idx].clone(), probs

    def tensors(self) -> list:
        return [("draft.token", self.token), ("draft.streams", self.streams), ("draft.probs", self.probs)]


def _buffer_table(pool: DeepSeekV4TokenToKVPool, draft: Optional[DraftStateBuffers]) -> list:
    """(name, tensor) of every buffer that may travel, in the order regions are listed."""
    table = [(f"window_kv.{i}", buf) for i, buf in enumerate(pool.window_kv)]
    table += [(f"compressed_kv.{i}", buf) for i, buf in pool.compressed_kv.items()]
    table += [(f"index_k.{i}", buf) for i, buf in pool.index_k.items()]
    for kind, states in (("attn_state", pool.attn_state), ("index_state", pool.index_state)):
        for i, state in states.items():
            table.append((f"{kind}.{i}.ring", state.buf))
            if state.boundary is not None:
                table.append((f"{kind}.{i}.boundary", state.boundary))
    if draft is not None:
        table += draft.tensors()
    for name, buf in table:
        if not buf.is_contiguous():
            raise ValueError(f"pool buffer {name} is not contiguous: it cannot travel as byte ranges")
    return table


def transfer_buffers(pool: DeepSeekV4TokenToKVPool, draft: Optional[DraftStateBuffers] = None) -> list:
    """Every buffer that may travel (list of RegisteredBuffer): register them once with the transfer engine."""
    return [RegisteredBuffer(name, buf.data_ptr(), buf.numel() * buf.element_size(), buf.device.type)
            for name, buf in _buffer_table(pool, draft)]


def layout_signature(pool: DeepSeekV4TokenToKVPool, draft: Optional[DraftStateBuffers] = None) -> tuple:
    """What both sides must share for their regions to pair: per buffer its name and bytes per row (entry formats,
    staging widths), per compressor its ring size, and the page size."""
    rings = tuple(sorted((f"{kind}.{i}", s.ring) for kind, states in (("attn", pool.attn_state),
                                                                       ("index", pool.index_state))
                         for i, s in states.items()))
    rows = tuple((name, _row_bytes(buf)) for name, buf in _buffer_table(pool, draft))
    return (pool.shape.page_size, rows, rings)


def encode_layout(signature: tuple) -> str:
    """A layout_signature as JSON text, as it travels in a RoomRegistration."""
    return json.dumps(signature, separators=(",", ":"))


def decode_layout(text: str) -> tuple:
    """encode_layout's inverse (lists back to tuples, so it compares equal); ValueError when it is not one."""
    def tuples(v):
        return tuple(tuples(x) for x in v) if isinstance(v, list) else v
    try:
        sig = tuples(json.loads(text))
    except ValueError:
        sig = None
    if not (isinstance(sig, tuple) and len(sig) == 3):
        raise ValueError(f"the peer sent no pool layout ({text[:80]!r}); both servers must run this version")
    return sig


def check_same_layout(local: tuple, remote: tuple) -> None:
    """ValueError naming the first difference between two layout_signature results."""
    if local == remote:
        return
    if local[0] != remote[0]:
        raise ValueError(f"page sizes differ: {local[0]} here, {remote[0]} on the peer (--page-size)")
    mine, theirs = dict(local[1]), dict(remote[1])
    for name in sorted(set(mine) ^ set(theirs)):
        side = "here only" if name in mine else "on the peer only"
        raise ValueError(f"pool buffer {name} exists {side}: both servers need the same model, speculative decoding "
                         f"and prefix-cache settings")
    for name in mine:
        if mine[name] != theirs[name]:
            raise ValueError(f"pool buffer {name} rows are {mine[name]} B here, {theirs[name]} B on the peer: both "
                             f"servers need the same --kv-cache-dtype and indexer key format")
    raise ValueError(f"compressor staging rings differ: {local[2]} here, {remote[2]} on the peer (speculative "
                     f"decoding must be on or off on both)")


def _row_bytes(buf: torch.Tensor) -> int:
    return buf[0].numel() * buf.element_size()


def _rows(index: int, buf: torch.Tensor, rows) -> list:
    """Regions of buffer rows `rows` (in order), consecutive rows merged."""
    out, size = [], _row_bytes(buf)
    for row in rows:
        if out and out[-1].offset + out[-1].nbytes == row * size:
            last = out[-1]
            out[-1] = Region(index, last.offset, last.nbytes + size)
        else:
            out.append(Region(index, row * size, size))
    return out


def _staging_start(state: CompressorState, n: int) -> int:
    """First position whose staging row the next completed window reads (the open window; CSA: and the one before)."""
    m = state.ratio
    return max(0, n // m * m - (m if state.overlap else 0))


def _boundary_positions(state: CompressorState, n: int) -> range:
    """Positions of [0, n) among the last m of the page n lies in (the boundary rows the decode side's prefix cache
    saves at that page's end)."""
    end = (n // state.page_size + 1) * state.page_size
    return range(max(end - state.ratio, 0), n) if end - state.ratio < n else range(0)


def request_regions(pool: DeepSeekV4TokenToKVPool, kv: RequestKV,
                    draft: Optional[DraftStateBuffers] = None) -> list:
    """The Regions of one request's state (see the module docstring), in transfer_buffers order. The same function
    gives the prefill side's source and the decode side's destination: both list the same logical bytes."""
    n, ps = kv.num_tokens, pool.shape.page_size
    tail = window_tail(pool.config.sliding_window, n)
    if len(kv.window_slots) != tail:
        raise ValueError(f"{len(kv.window_slots)} window slots given, the last {tail} positions need one each")
    if len(kv.pages) != -(-n // ps):
        raise ValueError(f"{len(kv.pages)} pages given, {n} positions need {-(-n // ps)}")
    if kv.draft and draft is None:
        raise ValueError("the request's draft state travels but this side has no DraftStateBuffers")
    out = []
    for index, (name, buf) in enumerate(_buffer_table(pool, draft)):
        kind, _, rest = name.partition(".")
        if kind == "window_kv":
            out += _rows(index, buf, kv.window_slots)
        elif kind in ("compressed_kv", "index_k"):
            ratio = pool.config.compress_ratio(int(rest))
            epp, num = ps // ratio, n // ratio
            out += _rows(index, buf, (kv.pages[w // epp] * epp + w % epp for w in range(num)))
        elif kind in ("attn_state", "index_state"):
            layer, part = rest.split(".")
            state = pool.compressor_state(int(layer), kind == "index_state")
            if part == "ring":
                positions = range(_staging_start(state, n), n)
                out += _rows(index, buf, (kv.req_pool_idx * state.ring + p % state.ring for p in positions))
            else:
                m = state.ratio
                out += _rows(index, buf, ((kv.req_pool_idx * 2 + p // ps % 2) * m + p % m
                                          for p in _boundary_positions(state, n)))
        elif kv.draft and (name != "draft.probs" or kv.draft_probs):
            out += _rows(index, buf, [kv.req_pool_idx])
    return out


def source_regions(pool: DeepSeekV4TokenToKVPool, kv: RequestKV, draft: Optional[DraftStateBuffers] = None) -> list:
    """The prefill side's Regions of a request whose prompt is prefilled (read by the transfer)."""
    return request_regions(pool, kv, draft)


def dest_regions(pool: DeepSeekV4TokenToKVPool, kv: RequestKV, draft: Optional[DraftStateBuffers] = None) -> list:
    """The decode side's Regions of a request pre-allocated for the same prompt (written by the transfer)."""
    return request_regions(pool, kv, draft)


def region_addresses(buffers: list, regions: list) -> list:
    """[(address, nbytes)] of Regions over RegisteredBuffers (what a peer needs to write them)."""
    out = []
    for r in regions:
        buf = buffers[r.buffer]
        if r.offset < 0 or r.offset + r.nbytes > buf.nbytes:
            raise ValueError(f"region {r} lies outside buffer {buf.name} ({buf.nbytes} B)")
        out.append((buf.data_ptr + r.offset, r.nbytes))
    return out


def pair_regions(src: list, dst: list) -> TransferPlan:
    """One-to-one copies from source to destination [(address, nbytes)] lists that cover the same bytes in the same
    order: cut at every boundary of either list, then merged where both sides are contiguous. ValueError when the
    totals differ (the two sides pool differently or describe different prompts)."""
    src, dst = [r for r in src if r[1]], [r for r in dst if r[1]]
    total_src, total_dst = sum(n for _, n in src), sum(n for _, n in dst)
    if total_src != total_dst:
        raise ValueError(f"source holds {total_src} B, destination {total_dst} B: the servers pool differently or "
                         f"the prompt lengths differ")
    src_addrs, dst_addrs, lengths = [], [], []
    i = j = 0
    used_src = used_dst = 0  # bytes of src[i] / dst[j] already paired
    while i < len(src) and j < len(dst):
        n = min(src[i][1] - used_src, dst[j][1] - used_dst)
        src_addrs.append(src[i][0] + used_src)
        dst_addrs.append(dst[j][0] + used_dst)
        lengths.append(n)
        used_src, used_dst = used_src + n, used_dst + n
        if used_src == src[i][1]:
            i, used_src = i + 1, 0
        if used_dst == dst[j][1]:
            j, used_dst = j + 1, 0
    return TransferPlan(*coalesce(src_addrs, dst_addrs, lengths))
