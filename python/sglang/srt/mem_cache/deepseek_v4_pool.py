"""DeepSeekV4TokenToKVPool: the per-layer buffers of DeepSeek-V4's cache (DESIGN section 4, arch section 9).

There is no per-raw-token KV. Per layer the pool holds:
- window KV: every layer (main and MTP), one entry per live window token, addressed by a *window slot*
  (`full_to_swa[full_slot]`, owned by DeepSeekV4TokenAllocator);
- compressed KV: compressed layers, entry `w` of a request at
  `page_table[req, w // epp] * epp + w % epp` with `epp = page_size // ratio` entries per page;
- indexer keys: CSA layers, same addressing as the ratio-4 compressed KV;
- compressor staging rings: compressed layers (attention compressor) and CSA layers (indexer compressor),
  fp32 rows `(content, gate logit)` with `ape` already added, at `req_pool_idx * ring + position % ring`.
Rows are in the layout of an `EntryFormat` (dense, FP8 main KV, FP8/FP4 index keys). The attention backends read
and write the buffers directly with sgl_kernel's ops (kernels or their torch references, the same layouts); the
accessors below store / load through the format (quantize on write, dequantize on read).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Optional

import torch

from sglang.srt.configs.deepseek_v4 import DeepseekV4Config
from sglang.srt.mem_cache.kv_formats import EntryFormat


@dataclass(frozen=True)
class PoolShape:
    """Sizes chosen by pool sizing (mem_cache/pool_sizing.py)."""

    page_size: int
    num_pages: int  # including the reserved page 0
    num_swa_slots: int  # including the reserved slot 0
    max_num_reqs: int  # request slots, excluding the reserved slot 0
    num_draft_tokens: int = 0  # speculative drafts per step; grows the rings so rejected drafts never clobber state
    num_state_slots: int = 0  # saved CSA staging states of cached prefixes (0: no prefix cache)


def ring_size(ratio: int, overlap: bool, num_draft_tokens: int = 0) -> int:
    """Staging ring rows: CSA keeps the previous window plus the pending one (2m), HCA the pending one (m), plus one
    row: a decode step launched behind one in flight (overlap scheduling) writes the position after it, and when the
    first fails both are undone and it runs again, reading its rows intact. Doubled under speculative decoding (never
    overlapped) so rejected draft rows never overwrite rows still needed."""
    base = 2 * ratio if overlap else ratio
    return base * 2 if num_draft_tokens > 0 else base + 1


class CompressorState:
    """Staging ring of one compressor: fp32 [(max_reqs + 1) * ring, 2, width] holding (content, gate logit).
    CSA (overlapping) compressors also keep, per request, the m rows before each page boundary (`boundary`, written
    by every forward; two halves by page parity, so a step already in flight past a finished request's end cannot
    overwrite the rows of the boundary being saved) and `num_state_slots` saved copies (`saved`): the state a cached
    prefix ending there needs (mem_cache/radix_cache.py). HCA needs none: a page boundary closes its window."""

    def __init__(self, ratio: int, overlap: bool, width: int, shape: PoolShape, device) -> None:
        self.ratio, self.overlap, self.width = ratio, overlap, width
        self.ring = ring_size(ratio, overlap, shape.num_draft_tokens)
        self.buf = torch.zeros((shape.max_num_reqs + 1) * self.ring, 2, width, dtype=torch.float32, device=device)
        self.boundary = self.saved = None
        self.page_size = shape.page_size
        if overlap and shape.num_state_slots:
            self.boundary = torch.zeros((shape.max_num_reqs + 1) * 2 * ratio, 2, width, dtype=torch.float32,
                                        device=device)
            self.saved = torch.zeros((shape.num_state_slots + 1) * ratio, 2, width, dtype=torch.float32,
                                     device=device)  # slot 0 reserved, as in every allocator

    def _boundary_rows(self, req_pool_idx: int, end: int) -> slice:
        first = (req_pool_idx * 2 + (end - 1) // self.page_size % 2) * self.ratio
        return slice(first, first + self.ratio)

    def save(self, req_pool_idx: int, slot: int, end: int) -> None:
        """Keep request req_pool_idx's rows of the boundary at `end` (a page boundary) in state slot `slot`."""
        m = self.ratio
        self.saved[slot * m:(slot + 1) * m] = self.boundary[self._boundary_rows(req_pool_idx, end)]

    def ring_rows(self, req_pool_idx: int, end: int) -> torch.Tensor:
        """Ring rows of request req_pool_idx's positions [end - m, end) (host)."""
        return req_pool_idx * self.ring + torch.remainder(torch.arange(end - self.ratio, end), self.ring)

    def restore(self, slot: int, req_pool_idx: int, end: int, ring_rows: torch.Tensor) -> None:
        """Give request req_pool_idx the state saved in `slot` for a prefix of `end` tokens (a page boundary): its
        ring rows of positions [end - m, end) (`ring_rows`, on the device) and its boundary rows."""
        m = self.ratio
        rows = self.saved[slot * m:(slot + 1) * m]
        self.boundary[self._boundary_rows(req_pool_idx, end)] = rows
        self.buf[ring_rows] = rows

    def rows_at_risk(self, spans: list) -> list:
        """Ring rows that a forward over `spans` overwrites while a rerun of it reads them (see
        DeepSeekV4TokenToKVPool.checkpoint_staging): per request (req_pool_idx, start, end), the rows of positions
        [lo, start) read (lo: where the first window it completes starts, one window earlier for CSA) that the
        positions it keeps, [max(start, end - ring), end), wrap onto: all of them once it keeps a whole ring."""
        m, ring = self.ratio, self.ring
        rows = []
        for req_pool_idx, start, end in spans:
            lo = max(0, start // m * m - (m if self.overlap else 0))
            rows += [req_pool_idx * ring + p % ring for p in range(lo, min(start, end - ring))]
        return rows

    @property
    def nbytes(self) -> int:
        return sum(t.numel() * t.element_size() for t in (self.buf, self.boundary, self.saved) if t is not None)


@dataclass
class StagingCheckpoint:
    """Staging rows saved before a forward (DeepSeekV4TokenToKVPool.checkpoint_staging): (ring buffer, rows on the
    device, their values)."""

    copies: list


class DeepSeekV4TokenToKVPool:
    def __init__(self, config: DeepseekV4Config, num_layers: int, shape: PoolShape, kv_format: EntryFormat,
                 index_format: EntryFormat, index_keys_rotated: bool, device) -> None:
        """`num_layers` = main layers plus the MTP layers that are served (each MTP layer is window-only)."""
        self.config, self.shape, self.device = config, shape, device
        self.num_layers = num_layers
        self.kv_format, self.index_format = kv_format, index_format
        self.index_keys_rotated = index_keys_rotated
        page = shape.page_size
        self.window_kv = [kv_format.allocate(shape.num_swa_slots, device) for _ in range(num_layers)]
        self.compressed_kv: dict = {}
        self.index_k: dict = {}
        self.attn_state: dict = {}
        self.index_state: dict = {}
        for layer_id in range(min(num_layers, config.num_hidden_layers)):
            ratio = config.compress_ratio(layer_id)
            if ratio == 0:
                continue
            entries = shape.num_pages * (page // ratio)
            overlap = config.is_csa(layer_id)
            coeff = 2 if overlap else 1
            self.compressed_kv[layer_id] = kv_format.allocate(entries, device)
            self.attn_state[layer_id] = CompressorState(ratio, overlap, coeff * config.head_dim, shape, device)
            if overlap:
                self.index_k[layer_id] = index_format.allocate(entries, device)
                self.index_state[layer_id] = CompressorState(ratio, True, 2 * config.index_head_dim, shape, device)

    # ---- window KV ------------------------------------------------------------------------------
    def get_window_kv(self, layer_id: int, slots: torch.Tensor) -> torch.Tensor:
        return self.kv_format.load(self.window_kv[layer_id], slots)

    # ---- compressed KV and indexer keys --------------------------------------------------------
    def get_compressed_kv(self, layer_id: int, slots: torch.Tensor) -> torch.Tensor:
        return self.kv_format.load(self.compressed_kv[layer_id], slots)

    def set_index_k(self, layer_id: int, slots: torch.Tensor, values: torch.Tensor) -> None:
        self.index_format.store(self.index_k[layer_id], slots, values)

    def get_index_k(self, layer_id: int, slots: torch.Tensor) -> torch.Tensor:
        return self.index_format.load(self.index_k[layer_id], slots)

    def compressor_state(self, layer_id: int, is_indexer: bool) -> CompressorState:
        return (self.index_state if is_indexer else self.attn_state)[layer_id]

    def csa_states(self) -> list:
        return [s for s in list(self.attn_state.values()) + list(self.index_state.values()) if s.saved is not None]

    def checkpoint_staging(self, spans: list) -> Optional[StagingCheckpoint]:
        """Copies of the staging rows a forward over `spans` ((req_pool_idx, start, end): a request's new positions
        [start, end)) overwrites although running it again reads them, for restore_staging after a failed step. The
        forward reads the rows of positions before `start` that the windows it completes span and writes the rows of
        its last positions: a prefill chunk longer than the ring's slack wraps onto the first. Every other pool write
        is addressed by position and rewritten alike by the rerun. None when nothing is at risk (decode rows never
        are)."""
        spans = [span for span in spans if span[2] - span[1] > 1]
        copies, rows = [], {}
        for state in [*self.attn_state.values(), *self.index_state.values()]:
            key = (state.ratio, state.overlap, state.ring)
            if key not in rows:  # one host -> device copy per ring shape; non_blocking: no stream synchronisation
                at_risk = state.rows_at_risk(spans)
                rows[key] = (torch.tensor(at_risk, dtype=torch.int64).to(self.device, non_blocking=True)
                             if at_risk else None)
            if rows[key] is not None:
                copies.append((state.buf, rows[key], state.buf[rows[key]]))
        return StagingCheckpoint(copies) if copies else None

    @staticmethod
    def restore_staging(checkpoint: StagingCheckpoint) -> None:
        for buf, rows, values in checkpoint.copies:
            buf[rows] = values

    def save_state(self, req_pool_idx: int, slot: int, end: int) -> None:
        for state in self.csa_states():
            state.save(req_pool_idx, slot, end)

    def restore_state(self, slot: int, req_pool_idx: int, end: int) -> None:
        rows: dict = {}  # one host -> device copy per ring size (every CSA compressor has the same)
        for state in self.csa_states():
            if state.ring not in rows:
                rows[state.ring] = state.ring_rows(req_pool_idx, end).to(self.device)
            state.restore(slot, req_pool_idx, end, rows[state.ring])
