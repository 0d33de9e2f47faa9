"""TorchAttnBackend: the reference DeepSeek-V4 attention backend, in plain torch (CPU and GPU).

It is the oracle for every faster backend: gathers keys by slot, computes in fp32, and processes query rows
in blocks so memory stays bounded for long prefills. Letters as in metadata.py; K keys per row.
"""

from __future__ import annotations

from typing import Optional

import torch

from sglang.srt.layers.attention.base_attn_backend import AttentionBackend
from sglang.srt.layers.attention.dsv4.hadamard import hadamard_rotate
from sglang.srt.layers.attention.dsv4.logits_workspace import IndexerLogitsWorkspace, logits_budget_bytes
from sglang.srt.layers.attention.dsv4.metadata import (
    DSV4Metadata, RatioMetadata, build_compress_plan, build_entry_slots, build_window_slots)


class TorchAttnBackend(AttentionBackend):
    name = "torch"

    def __init__(self, config, pool, allocator, page_size: int, num_draft_tokens: int = 0,
                 row_block: int = 256) -> None:
        self.config, self.pool, self.allocator = config, pool, allocator
        self.page_size = page_size
        self.num_draft_tokens = num_draft_tokens
        self.row_block = row_block
        self.logits_workspace = IndexerLogitsWorkspace(logits_budget_bytes(pool.index_format.name), pool.device)

    # ---- metadata ------------------------------------------------------------------------------
    def init_forward_metadata(self, fb) -> None:
        window_slots = build_window_slots(fb, self.config.sliding_window, self.allocator.full_to_swa)
        ratios = {}
        for ratio in self.config.distinct_ratios:
            overlap = ratio == 4
            state = self._any_state(ratio)
            plan = build_compress_plan(fb, ratio, overlap, self.page_size, self.num_draft_tokens,
                                       num_ring_rows=state.buf.shape[0])
            ratios[ratio] = RatioMetadata(ratio=ratio, entry_slots=build_entry_slots(fb, ratio, self.page_size),
                                          row_visible=torch.div(fb.positions + 1, ratio, rounding_mode="floor"),
                                          plan=plan)
        fb.attn_metadata = DSV4Metadata(window_slots=window_slots,
                                        out_swa_loc=self.allocator.full_to_swa[fb.out_cache_loc], ratios=ratios)

    def _any_state(self, ratio: int):
        for layer_id, state in self.pool.attn_state.items():
            if state.ratio == ratio:
                return state
        raise KeyError(f"no compressed layer with ratio {ratio}")

    # ---- compressor ----------------------------------------------------------------------------
    def forward_compressor(self, compressor, kv: torch.Tensor, gate: torch.Tensor, fb) -> None:
        md: DSV4Metadata = fb.attn_metadata
        plan = md.ratios[compressor.ratio].plan
        state = self.pool.compressor_state(compressor.layer_id, compressor.is_indexer)
        fresh = torch.stack((kv, gate), dim=1)  # [T, 2, c*d]
        if plan.num_new:
            src = torch.cat((state.buf, fresh), dim=0)
            rows = src[plan.source_rows.clamp(min=0)]  # [N, S, 2, c*d]
            empty = (plan.source_rows < 0)[:, :, None]
            d = compressor.head_dim
            if plan.overlap:  # slots [0, m): A halves of the previous window; [m, 2m): B halves of this one
                m = plan.ratio
                content = torch.cat((rows[:, :m, 0, :d], rows[:, m:, 0, d:]), dim=1)
                logits = torch.cat((rows[:, :m, 1, :d], rows[:, m:, 1, d:]), dim=1)
            else:
                content, logits = rows[:, :, 0], rows[:, :, 1]
            logits = logits.masked_fill(empty, float("-inf"))
            content = content.masked_fill(empty, 0.0)
            pooled = (content * logits.softmax(dim=1)).sum(dim=1)  # [N, d]: channel-wise softmax pool
            entries = compressor.finish(pooled, plan.entry_positions)
            if compressor.is_indexer:
                if self.pool.index_keys_rotated:  # quantized keys are stored Hadamard-rotated (queries too)
                    entries = hadamard_rotate(entries)
                self.pool.set_index_k(compressor.layer_id, plan.entry_slots, entries)
            else:
                self.pool.set_compressed_kv(compressor.layer_id, plan.entry_slots, entries)
        state.buf[plan.ring_dst] = fresh[plan.ring_src]

    # ---- indexer -------------------------------------------------------------------------------
    def forward_indexer(self, indexer, q: torch.Tensor, weights: torch.Tensor, fb) -> torch.Tensor:
        """Per request: score its rows against its visible index keys, then top-k. Prefill logits live in the
        pooled workspace, a chunk of rows at a time, each chunk's top-k finished before the block is reused."""
        md: DSV4Metadata = fb.attn_metadata
        rm: RatioMetadata = md.ratios[indexer.ratio]
        top_k = indexer.index_topk
        out = torch.full((q.shape[0], top_k), -1, dtype=torch.int64, device=q.device)
        e_max = rm.entry_slots.shape[1]
        if e_max == 0:
            return out
        if self.pool.index_keys_rotated:
            q = indexer.rotate(q)
        decode = fb.forward_mode.is_decode()
        row = 0
        for b, n in enumerate(fb.extend_seq_lens_cpu):
            lo, hi, row = row, row + n, row + n
            cand = rm.entry_slots[b]
            keys = self.pool.get_index_k(indexer.layer_id, cand.clamp(min=0))  # [E_max, dI], read once
            step = n if decode else self.logits_workspace.logits_rows_per_chunk(e_max)
            for r0 in range(lo, hi, step):
                r1 = min(hi, r0 + step)
                logits = (torch.empty(r1 - r0, e_max, dtype=torch.float32, device=q.device) if decode
                          else self.logits_workspace.view(r1 - r0, e_max))
                self._index_logits(q[r0:r1], weights[r0:r1], keys, rm.row_visible[r0:r1], logits)
                k = min(top_k, e_max)
                top = logits.topk(k, dim=-1).indices
                visible = top < rm.row_visible[r0:r1, None]
                out[r0:r1, :k] = torch.where(visible, cand[top], torch.full_like(top, -1))
        return out

    @staticmethod
    def _index_logits(q, weights, keys, visible, out: torch.Tensor) -> None:
        """out[t, e] = sum_h w[t,h] relu(q[t,h].k[e]) for e < visible[t], else -inf. One row at a time, so a
        row's logits never depend on which rows share its chunk (chunked prefill is elementwise one pass)."""
        entry = torch.arange(keys.shape[0], device=q.device)
        for t in range(q.shape[0]):
            scores = torch.einsum("hd,ed->he", q[t].float(), keys).relu()
            logits = torch.einsum("he,h->e", scores, weights[t].float())
            out[t] = logits.masked_fill(entry >= visible[t], float("-inf"))

    # ---- attention -----------------------------------------------------------------------------
    def forward(self, layer, q: torch.Tensor, kv: torch.Tensor, fb,
                topk_slots: Optional[torch.Tensor] = None) -> torch.Tensor:
        md: DSV4Metadata = fb.attn_metadata
        self.pool.set_window_kv(layer.layer_id, md.out_swa_loc, kv)
        out = torch.empty(q.shape, dtype=torch.float32, device=q.device)
        for lo, hi in self._row_blocks(q.shape[0]):
            keys, valid = self._gather_keys(layer, md, fb, lo, hi, topk_slots)
            scores = torch.einsum("thd,tkd->thk", q[lo:hi].float(), keys) * layer.softmax_scale
            scores = scores.masked_fill(~valid[:, None, :], float("-inf"))
            sink = layer.attn_sink.float()[None, :, None].expand(hi - lo, -1, 1)
            lse = torch.logsumexp(torch.cat((scores, sink), dim=-1), dim=-1, keepdim=True)
            out[lo:hi] = torch.einsum("thk,tkd->thd", torch.exp(scores - lse), keys)
        return out.to(q.dtype)

    def _gather_keys(self, layer, md: DSV4Metadata, fb, lo: int, hi: int, topk_slots) -> tuple:
        """Keys [t, K, Dh] fp32 and validity [t, K] of rows [lo, hi): window then compressed entries."""
        win = md.window_slots[lo:hi]
        keys = [self.pool.get_window_kv(layer.layer_id, win.clamp(min=0))]
        valid = [win >= 0]
        if layer.ratio > 0:
            if topk_slots is not None:  # CSA: the indexer's choice
                slots = topk_slots[lo:hi]
                ok = slots >= 0
            else:  # HCA: every visible entry
                rm: RatioMetadata = md.ratios[layer.ratio]
                slots = rm.entry_slots[fb.row_req[lo:hi]]
                ok = torch.arange(slots.shape[1], device=slots.device)[None, :] < rm.row_visible[lo:hi, None]
            keys.append(self.pool.get_compressed_kv(layer.layer_id, slots.clamp(min=0)))
            valid.append(ok)
        return torch.cat(keys, dim=1), torch.cat(valid, dim=1)

    def _row_blocks(self, num_rows: int):
        for lo in range(0, num_rows, self.row_block):
            yield lo, min(lo + self.row_block, num_rows)
