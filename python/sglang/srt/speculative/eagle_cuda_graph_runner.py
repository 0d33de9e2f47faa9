"""EagleCudaGraphRunner: a whole greedy speculative cycle from static buffers, one CUDA graph per batch size.

A cycle of k draft steps over B requests has R = k + 1 rows per request, at positions c_b .. c_b + k (allocated by
the host before the step: plan_extend's table, written to the page table inside the replay). One replay runs, for
every request at once (EagleWorker's steps 2, 3 and 5):
  - the draft steps d_2..d_k (one MTP row per request each, at positions c_b .. c_b + k - 2), fed by the pending
    draft d_1 and streams S_1 of the request (static input buffers);
  - TARGET_VERIFY over [x_c, d_1..d_k] and greedy acceptance (acceptance.accept_greedy), tokens and logprobs packed
    into one result block for the cycle's one read-back;
  - the draft-extend over all R rows with the committed tokens as inputs (rows past the accepted ones carry the
    correction: they write draft window keys at rejected positions only, which are rolled back and rewritten
    before being read), its logits and streams taken at each request's last accepted row: the next d_1 and S_1.
The host then commits the tokens, rolls the target back (EagleWorker.draft_extend) and keeps the next drafts.

Only greedy requests without penalties, logit bias or grammar are captured (sampled acceptance draws from each
request's own generator); a batch holding another, or larger than the largest size, runs the eager cycle. Padded
requests (raw batch 3 in a graph of 4) are request 0 at position 0 in every row, as for DECODE (cuda_graph_runner.py).
"""

from __future__ import annotations

import torch

from sglang.srt.model_executor.cuda_graph_runner import _IDS, _OUT_LOC, _POSITIONS, _REQS, StaticGraphRunner
from sglang.srt.model_executor.forward_batch_info import ForwardBatch, ForwardMode
from sglang.srt.speculative.acceptance import accept_greedy


class EagleCudaGraphRunner(StaticGraphRunner):
    kind = "speculative cycle"

    def __init__(self, model_runner, batch_sizes: list, use_graphs: bool) -> None:
        self.num_steps = model_runner.server_args.speculative_num_steps
        self.rows_per_req = self.num_steps + 1
        config, device = model_runner.model_config, model_runner.device
        max_bs = max(batch_sizes)
        self.draft_tokens = torch.zeros(max_bs, dtype=torch.int64, device=device)  # d_1 of each request
        self.draft_streams = torch.zeros(max_bs, config.hc_mult, config.hidden_size,  # S_1 of each request
                                         dtype=model_runner.model.embed.weight.dtype, device=device)
        super().__init__(model_runner, batch_sizes, use_graphs)

    def _batch(self, mode: ForwardMode, bs: int, column=None, **kw) -> ForwardBatch:
        """The static rows of `bs` requests: all R per request, or only row `column` of each (a draft step)."""
        rows = bs * self.rows_per_req
        v = self.inputs[:, :rows]
        reqs = v[_REQS].view(bs, -1)[:, 0]
        if column is None:
            per_req = self.rows_per_req
            positions, out_loc = v[_POSITIONS], v[_OUT_LOC]
        else:
            per_req = 1
            positions, out_loc = v[_POSITIONS].view(bs, -1)[:, column], v[_OUT_LOC].view(bs, -1)[:, column]
        row_req = torch.div(self.rows[:bs * per_req], per_req, rounding_mode="floor")
        kw.setdefault("extend_seq_lens", self.ones[:bs] * per_req)
        return ForwardBatch(forward_mode=mode, positions=positions.contiguous(), out_cache_loc=out_loc.contiguous(),
                            req_pool_indices=reqs.contiguous(), extend_start_loc=self.rows[:bs] * per_req,
                            row_req=row_req, capacity_static=True, capture_hidden=True, **kw)

    def _run(self, bs: int) -> tuple:
        k, runner = self.num_steps, self.runner
        self._write_slots(bs)
        columns, streams = [self.draft_tokens[:bs]], self.draft_streams[:bs]
        for i in range(k - 1):  # d_{i+2} from the row (S_{i+1}, d_{i+1}) at position c + i
            draft_step = self._batch(ForwardMode.DRAFT_EXTEND, bs, column=i, input_ids=columns[-1],
                                     spec_hidden_states=streams)
            out = runner.forward_draft(draft_step)
            columns.append(out.next_token_logits.argmax(dim=-1))
            streams = out.hidden_states
        drafts = torch.stack(columns, dim=1)  # [bs, k]
        last = self.inputs[_IDS, :bs]  # x_c of each request
        verify = self._batch(ForwardMode.TARGET_VERIFY, bs, input_ids=torch.cat((last[:, None], drafts), 1).flatten(),
                             return_all_logits=True)
        out = runner.forward(verify)
        logits = out.all_logits.view(bs, self.rows_per_req, -1)
        tokens, num_acc = accept_greedy(drafts, logits)
        logprobs = torch.log_softmax(logits, dim=-1).gather(2, tokens[:, :, None]).squeeze(2)
        result = torch.cat((tokens.double(), num_acc[:, None].double(), logprobs.double()), dim=1)
        extend = self._batch(ForwardMode.DRAFT_EXTEND, bs, input_ids=tokens.flatten(),
                             spec_hidden_states=out.hidden_states, extend_seq_lens=num_acc.long() + 1)
        draft = runner.forward_draft(extend)  # next_token_logits: at each request's last accepted row
        last_rows = extend.extend_start_loc + num_acc.long()
        return result, draft.next_token_logits.argmax(dim=-1), draft.hidden_states[last_rows]

    @torch.inference_mode()
    def forward(self, slots: torch.Tensor, last_tokens: list, draft_tokens: list, draft_streams: list) -> tuple:
        """One cycle of B requests: `slots` plan_extend's [4, B * R] table of the verify positions (R per request, in
        request order), `last_tokens` x_c per request (host), each request's pending draft d_1 (0-d) and streams S_1
        [n, D] (device tensors, stacked straight into the static buffers). Returns (result [B, 2k + 3] float64: k+1
        tokens, accepted drafts, k+1 logprobs; next d_1 [B]; next S_1 [B, n, D]) as views of the graph's outputs,
        valid until the next replay."""
        raw = len(last_tokens)
        if slots.shape != (4, raw * self.rows_per_req):
            raise ValueError(f"a speculative cycle needs {self.rows_per_req} new positions per request: slots "
                             f"{tuple(slots.shape)} for {raw} requests")
        bs = self.padded_size(raw)
        self._stage(slots, last_tokens, bs)
        torch.stack(draft_tokens, out=self.draft_tokens[:raw])
        torch.stack(draft_streams, out=self.draft_streams[:raw])
        result, next_tokens, next_streams = self._replay(bs)
        return result[:raw], next_tokens[:raw], next_streams[:raw]
