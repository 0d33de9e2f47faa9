"""ForwardBatch: everything one model forward needs, built by the scheduler side, read by the model and backend.

Data flow: Scheduler (host: requests, allocation) -> ForwardBatch (device tensors + the few host ints the
backend needs to size its metadata) -> ModelRunner.forward -> attn_backend.init_forward_metadata (once per
forward, for all layers) -> model -> LogitsProcessorOutput.

Tokens are packed: row i of `input_ids` / `positions` / `out_cache_loc` belongs to request `row_req[i]`;
request b owns rows [extend_start_loc[b], extend_start_loc[b] + extend_seq_lens[b]). A prefill chunk of a
request is a run of consecutive positions; decode is the one-row case.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from enum import IntEnum, auto
from typing import TYPE_CHECKING, Any, Callable, Optional

import torch

from sglang.srt.utils.host_ints import int64_tensor

if TYPE_CHECKING:
    from sglang.srt.layers.attention.base_attn_backend import AttentionBackend
    from sglang.srt.mem_cache.req_to_token_pool import ReqToTokenPool


# int64 elements per 16 bytes. Triton specialises every pointer argument on whether its address is a multiple of 16
# bytes, so a view starting mid-way would make the kernels reading it (the attention's and the indexer's row map,
# the positions) a variant of their own: one the server's warm-up (one request a chunk) never ran, compiled inside
# the first request of a chunk with an even request count (2.8 s on an H100, RESULTS.md "Serving").
_ALIGN = 2


def _packed_views(arrays: list, device) -> list:
    """int64 device views of the host int64 tensors `arrays`, all from one host -> device copy, each starting 16
    bytes aligned (padded to even lengths)."""
    at, offsets = 0, []
    for a in arrays:
        offsets.append(at)
        at += a.numel() + (-a.numel() % _ALIGN)
    packed = torch.zeros(at, dtype=torch.int64)
    for a, o in zip(arrays, offsets):
        packed[o:o + a.numel()] = a
    # non_blocking from pageable memory: the copy is staged at once, without a stream synchronisation
    packed = packed.to(device, non_blocking=True)
    return [packed.narrow(0, o, a.numel()) for a, o in zip(arrays, offsets)]


class ForwardMode(IntEnum):
    EXTEND = auto()  # prefill, chunked prefill, prefill after a prefix hit
    DECODE = auto()  # one new token per request
    TARGET_VERIFY = auto()  # score k draft tokens per request (speculative decoding)
    DRAFT_EXTEND = auto()  # MTP draft over accepted tokens (speculative decoding)
    IDLE = auto()  # no tokens on this rank

    def is_extend(self) -> bool:
        return self in (ForwardMode.EXTEND, ForwardMode.TARGET_VERIFY, ForwardMode.DRAFT_EXTEND)

    def is_decode(self) -> bool:
        return self == ForwardMode.DECODE


@dataclass
class ForwardBatch:
    forward_mode: ForwardMode
    input_ids: torch.Tensor  # [T] int64
    positions: torch.Tensor  # [T] int64, absolute position of each row
    out_cache_loc: torch.Tensor  # [T] int64, virtual full-token slot of each row
    req_pool_indices: torch.Tensor  # [B] int64
    extend_seq_lens: torch.Tensor  # [B] int64, rows of each request in this forward (1 in decode)
    extend_start_loc: torch.Tensor  # [B] int64, first row of each request
    row_req: torch.Tensor  # [T] int64, batch index of each row
    # Host copies (the scheduler knows them without a device sync).
    seq_lens_cpu: list = field(default_factory=list)
    extend_seq_lens_cpu: list = field(default_factory=list)
    extend_prefix_lens_cpu: list = field(default_factory=list)
    req_pool_indices_cpu: list = field(default_factory=list)
    # Logprobs: for each row, the token whose logprob is wanted (the next prompt token), -1 for none.
    return_logprob: bool = False
    logprob_target_ids: Optional[torch.Tensor] = None  # [T] int64
    # Return the pre-HC-head residual streams of every row (the MTP draft consumes them).
    capture_hidden: bool = False
    # Return the logits of every row, not only each request's last (speculative verification).
    return_all_logits: bool = False
    # Speculative decoding input of the draft model (pre-HC-head streams [T, n_hc, D]).
    spec_hidden_states: Optional[torch.Tensor] = None
    # A DECODE batch of one row per request in static buffers (the CUDA-graph path): the attention metadata is derived
    # on the device at capacity-static shapes, from the tensors above only (host lists are empty).
    capacity_static: bool = False
    # Host-tier loads its requests read that are still landing (mem_cache/tier_copy.py): called before each layer i,
    # makes the device wait for that layer's rows.
    before_layer: Optional[Callable[[int], None]] = None
    # Set by the ModelRunner.
    req_to_token_pool: Optional["ReqToTokenPool"] = None
    attn_backend: Optional["AttentionBackend"] = None
    # Set by attn_backend.init_forward_metadata.
    attn_metadata: Any = None

    @classmethod
    def build(cls, forward_mode: ForwardMode, input_ids: list, req_pool_indices: list, prefix_lens: list,
              extend_lens: list, out_cache_loc: torch.Tensor, device, logprob_target_ids: Optional[list] = None,
              capture_hidden: bool = False, return_all_logits: bool = False) -> "ForwardBatch":
        """Pack a batch from host lists: `input_ids` is the flat list of new tokens of every request in order."""
        total = sum(extend_lens)
        if total != len(input_ids):
            raise ValueError(f"{len(input_ids)} input ids for {total} extend rows")
        # Positions and row owners by host tensor ops, not per-row Python: a prefill chunk has thousands of rows and
        # the GPU waits for this at the start of every extend step.
        ext = int64_tensor(extend_lens)
        starts = torch.cumsum(ext, 0) - ext
        row_req = torch.repeat_interleave(torch.arange(len(extend_lens)), ext, output_size=total)
        positions = torch.arange(total) + (int64_tensor(prefix_lens) - starts)[row_req]
        seq_lens = [s + n for s, n in zip(prefix_lens, extend_lens)]

        # One host -> device copy for all index arrays (each a view of it), not one per array.
        arrays = [int64_tensor(input_ids), positions, int64_tensor(req_pool_indices), ext, starts, row_req]
        if logprob_target_ids is not None:
            arrays.append(int64_tensor(logprob_target_ids))
        views = _packed_views(arrays, device)
        ids_t, pos_t, pool_t, ext_t, start_t, row_req_t = views[:6]

        return cls(
            forward_mode=forward_mode, input_ids=ids_t, positions=pos_t,
            out_cache_loc=out_cache_loc.to(device=device, dtype=torch.int64), req_pool_indices=pool_t,
            extend_seq_lens=ext_t, extend_start_loc=start_t, row_req=row_req_t, seq_lens_cpu=seq_lens,
            extend_seq_lens_cpu=list(extend_lens), extend_prefix_lens_cpu=list(prefix_lens),
            req_pool_indices_cpu=list(req_pool_indices),
            return_logprob=logprob_target_ids is not None,
            logprob_target_ids=None if logprob_target_ids is None else views[6],
            capture_hidden=capture_hidden, return_all_logits=return_all_logits,
        )
