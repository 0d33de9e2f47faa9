"""LogitsProcessor: next-token logits of each request's last row, plus optional prompt logprobs and streams."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Optional

import torch
from torch import nn


@dataclass
class LogitsProcessorOutput:
    next_token_logits: torch.Tensor  # [B, V] fp32, at each request's last row
    # [T] fp32 logprob of forward_batch.logprob_target_ids[row] (0 where the target is -1), or None.
    input_token_logprobs: Optional[torch.Tensor] = None
    # [T, n_hc, D] residual streams before the HC head (for the MTP draft), or None.
    hidden_states: Optional[torch.Tensor] = None
    # [T, V] fp32 logits of every row when forward_batch.return_all_logits (speculative verification), or None.
    all_logits: Optional[torch.Tensor] = None


class LogitsProcessor(nn.Module):
    def __init__(self, config) -> None:
        super().__init__()
        self.vocab_size = config.vocab_size

    def forward(self, hidden: torch.Tensor, head: nn.Linear, forward_batch,
                pre_hc_streams: Optional[torch.Tensor] = None) -> LogitsProcessorOutput:
        last_rows = forward_batch.extend_start_loc + forward_batch.extend_seq_lens - 1
        input_logprobs = None
        if forward_batch.return_all_logits:
            logits = head(hidden).float()
            return LogitsProcessorOutput(next_token_logits=logits[last_rows], hidden_states=pre_hc_streams,
                                         all_logits=logits)
        if forward_batch.return_logprob:
            logits = head(hidden).float()
            targets = forward_batch.logprob_target_ids
            logprobs = torch.log_softmax(logits, dim=-1).gather(1, targets.clamp(min=0)[:, None]).squeeze(1)
            input_logprobs = torch.where(targets >= 0, logprobs, torch.zeros_like(logprobs))
            next_logits = logits[last_rows]
        else:
            next_logits = head(hidden[last_rows]).float()
        return LogitsProcessorOutput(next_token_logits=next_logits, input_token_logprobs=input_logprobs,
                                     hidden_states=pre_hc_streams)
