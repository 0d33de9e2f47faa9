"""EagleWorker: speculative decoding with DeepSeek-V4's MTP layer (EAGLE-style, top-k 1).

Positions: after the target has processed [0, c) and sampled x_c, the draft row (Hs_{c-1}, x_c) at position c-1
gave d_1 (in the previous draft-extend). One decode cycle then:
  1. allocates target slots for the k+1 verify positions c..c+k;
  2. drafts d_2..d_k: row (S_{i-1}, d_{i-1}) at position c+i-2, S = the MTP's own output streams (all step
     metadata is built up front by the multi-step backend);
  3. verifies rows [x_c, d_1..d_k] through the target (TARGET_VERIFY, every row its own window and visible
     compressed entries), accepting drafts against the target's argmax (or by speculative sampling);
  4. rolls the target back to the accepted length (window slots of rejected positions return; compressed entries
     and staging rows they touched are position-addressed and rewritten before being read again);
  5. draft-extends over the accepted rows (Hs_p from the verify, x_{p+1} the committed tokens), which fills the
     draft's window with real rows and yields the next d_1.
After every prefill chunk the draft extends over the same rows, so its window is always complete.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Optional

import torch

from sglang.srt.layers.attention.dsv4.multi_step_backend import DeepseekV4MultiStepBackend
from sglang.srt.layers.sampler import filtered_probs, penalize_rows
from sglang.srt.model_executor.forward_batch_info import ForwardBatch, ForwardMode
from sglang.srt.speculative.acceptance import accept_sampling


def read_back(x: torch.Tensor) -> list:
    """The speculative cycle's one device -> host transfer (tests count the calls and forbid any other read)."""
    return x.tolist()


@dataclass
class SpecState:
    """A request's pending draft (set by draft-extend, consumed by the next cycle) and its acceptance counters."""

    draft_token: torch.Tensor  # d_1, a 0-d int64 tensor on the device (no host round trip between passes)
    draft_streams: torch.Tensor  # S_1 [n_hc, D], the MTP output streams of the row that produced d_1
    draft_probs: Optional[torch.Tensor]  # q_1 [V] when sampling (None for greedy)
    num_verify: int = 0
    num_accepted_tokens: int = 0  # tokens committed by verifications (accepted drafts + bonus)


class EagleWorker:
    def __init__(self, runner, scheduler) -> None:
        self.runner, self.scheduler = runner, scheduler
        self.allocator = runner.token_allocator
        self.num_steps = runner.server_args.speculative_num_steps
        self.window = runner.model_config.sliding_window
        self.draft_backend = DeepseekV4MultiStepBackend(runner.attn_backend, max(1, self.num_steps - 1))
        self.total_verify = 0
        self.total_accepted = 0

    @property
    def mean_accept_length(self) -> float:
        return self.total_accepted / self.total_verify if self.total_verify else 0.0

    # ---- draft passes -----------------------------------------------------------------------------------------
    def _draft_forward(self, reqs: list, starts: list, lens: list, input_ids: list,
                       hidden: torch.Tensor) -> tuple:
        """MTP rows [starts[b], starts[b] + lens[b]) of each request -> (last-row logits [B, V], streams [B, n, D])."""
        loc = self._token_slots([r.alloc.req_pool_idx for r in reqs], starts, lens)
        fb = ForwardBatch.build(ForwardMode.DRAFT_EXTEND, input_ids, [r.alloc.req_pool_idx for r in reqs], starts,
                                lens, loc, self.runner.device, capture_hidden=True)
        fb.spec_hidden_states = hidden
        out = self.runner.forward_draft(fb)
        last = fb.extend_start_loc + fb.extend_seq_lens - 1
        return out.next_token_logits, out.hidden_states[last]

    def _token_slots(self, pool_idx: list, starts: list, lens: list) -> torch.Tensor:
        """Full-token slots of positions [starts[b], starts[b] + lens[b]) of each request, packed: one gather from
        req_to_token (the index lists are built on the host and copied once), not one slice per request."""
        rows = [i for i, n in zip(pool_idx, lens) for _ in range(n)]
        cols = [s + j for s, n in zip(starts, lens) for j in range(n)]
        index = torch.tensor([rows, cols], dtype=torch.int64).to(self.runner.device, non_blocking=True)
        return self.runner.req_to_token_pool.req_to_token[index[0], index[1]]

    def _next_tokens(self, reqs: list, logits: torch.Tensor) -> tuple:
        """Draft tokens [B] on the device: argmax for greedy requests, a draw from the request's sampling
        distribution otherwise (its probabilities are kept for the acceptance test). No host synchronisation."""
        tokens = logits.argmax(dim=-1)
        probs = [None] * len(reqs)
        for b, req in enumerate(reqs):
            if not req.sampling_params.is_greedy:
                probs[b] = filtered_probs(logits[b], req.sampling_params)
                tokens[b] = torch.multinomial(probs[b], 1, generator=req.generator)[0]
        return tokens, probs

    def _set_drafts(self, reqs: list, logits: torch.Tensor, streams: torch.Tensor) -> None:
        tokens, probs = self._next_tokens(reqs, logits)
        for b, req in enumerate(reqs):
            counts = (req.spec.num_verify, req.spec.num_accepted_tokens) if req.spec else (0, 0)
            req.spec = SpecState(tokens[b], streams[b], probs[b], *counts)

    def after_extend(self, batch, output) -> None:
        """Draft-extend over the rows a target EXTEND batch just processed (before their window slots are released).
        A row at position p feeds (Hs_p, x_{p+1}); the last prompt position feeds the token sampled from it."""
        reqs, starts, lens, ids, rows = [], [], [], [], []
        row = 0
        for req, n in zip(batch.reqs, batch.extend_lens):
            start = req.num_computed - n
            fill = req.fill_ids
            if not req.finished and start + n < len(fill):  # x_{p+1} known for every row
                reqs.append(req)
                starts.append(start)
                lens.append(n)
                ids.extend(fill[start + 1:start + n + 1])
                rows.append(torch.arange(row, row + n))
            row += n
        if not reqs:
            return
        hidden = output.hidden_states[torch.cat(rows).to(output.hidden_states.device)]
        logits, streams = self._draft_forward(reqs, starts, lens, ids, hidden)
        done = [b for b, req in enumerate(reqs) if req.prefill_done]
        if done:
            index = torch.tensor(done, device=logits.device)
            self._set_drafts([reqs[b] for b in done], logits[index], streams[index])

    # ---- one speculative decode cycle ---------------------------------------------------------------------
    def decode(self, reqs: list) -> list:
        k = self.num_steps
        starts = [r.num_computed for r in reqs]
        for req, c in zip(reqs, starts):  # verify positions c..c+k
            self.allocator.extend(req.alloc, c + k + 1)
        drafts, draft_probs = self._draft_steps(reqs, starts, k)
        accepted = self._verify(reqs, starts, drafts, draft_probs)
        self.scheduler.finish_step(reqs)
        return accepted

    def _draft_steps(self, reqs: list, starts: list, k: int) -> tuple:
        """d_1 from the last draft-extend, then d_2..d_k (one MTP row per request per step) -> (drafts [B, k] on the
        device, per-request lists of draft distributions for sampled requests)."""
        drafts = torch.stack([r.spec.draft_token for r in reqs]).unsqueeze(1)
        probs = [[r.spec.draft_probs] for r in reqs]
        streams = torch.stack([r.spec.draft_streams for r in reqs])
        if k < 2:
            return drafts, probs
        pool_idx = [r.alloc.req_pool_idx for r in reqs]
        steps = []
        for i in range(2, k + 1):  # every step's metadata is built before the first step runs
            pos = [c + i - 2 for c in starts]
            loc = self._token_slots(pool_idx, pos, [1] * len(reqs))
            steps.append(ForwardBatch.build(ForwardMode.DRAFT_EXTEND, [0] * len(reqs),
                                            [r.alloc.req_pool_idx for r in reqs], pos, [1] * len(reqs), loc,
                                            self.runner.device, capture_hidden=True))
        self.draft_backend.init_forward_metadata(steps, self.runner)
        columns = [drafts[:, 0]]
        for fb in steps:
            fb.input_ids = columns[-1]
            fb.spec_hidden_states = streams
            out = self.runner.forward_draft(fb, metadata_ready=True)
            streams = out.hidden_states
            tokens, step_probs = self._next_tokens(reqs, out.next_token_logits)
            columns.append(tokens)
            for b in range(len(reqs)):
                probs[b].append(step_probs[b])
        return torch.stack(columns, dim=1), probs

    def _verify(self, reqs: list, starts: list, drafts: torch.Tensor, draft_probs: list) -> list:
        """drafts [B, k] on the device. Acceptance (greedy for the batch, speculative sampling per sampled request)
        stays on the device; tokens, accept lengths and logprobs come back in one transfer."""
        k = self.num_steps
        device = self.runner.device
        last = torch.tensor([r.output_ids[-1] for r in reqs], dtype=torch.int64).to(device, non_blocking=True)
        loc = self._token_slots([r.alloc.req_pool_idx for r in reqs], starts, [k + 1] * len(reqs))
        fb = ForwardBatch.build(ForwardMode.TARGET_VERIFY, [0] * (len(reqs) * (k + 1)),
                                [r.alloc.req_pool_idx for r in reqs], starts, [k + 1] * len(reqs), loc, device,
                                capture_hidden=True, return_all_logits=True)
        fb.input_ids = torch.cat((last[:, None], drafts), dim=1).flatten()
        out = self.runner.forward(fb)
        logits = out.all_logits.view(len(reqs), k + 1, -1)  # raw: the reported logprobs are taken before penalties
        target = self._penalized(reqs, logits, drafts)  # what acceptance compares against
        best = target.argmax(dim=-1)  # [B, k+1]
        num_acc = (drafts == best[:, :k]).int().cumprod(dim=1).sum(dim=1)  # greedy: longest matching prefix
        # tokens[b, :j+1]: the j accepted drafts, then the target's token at position j (correction or bonus)
        tokens = torch.where(torch.arange(k + 1, device=device)[None, :] < num_acc[:, None],
                             torch.cat((drafts, drafts[:, :1]), dim=1), best.gather(1, num_acc[:, None].long()))
        for b, req in enumerate(reqs):
            if not req.sampling_params.is_greedy:  # speculative sampling, still on the device
                tokens[b], num_acc[b] = accept_sampling(drafts[b], torch.stack(draft_probs[b]), target[b],
                                                        req.sampling_params, req.generator)
        lps = torch.log_softmax(logits, dim=-1).gather(2, tokens[:, :, None]).squeeze(2)
        # the one host transfer of the cycle (token ids are exact in float64)
        host = read_back(torch.cat((tokens.double(), num_acc[:, None].double(), lps.double()), dim=1))
        ext_reqs, ext_starts, ext_lens, ext_ids, ext_rows = [], [], [], [], []  # the draft-extend rows
        for b, (req, c) in enumerate(zip(reqs, starts)):
            j = int(host[b][k + 1])
            tokens_b, lps_b = [int(t) for t in host[b][:j + 1]], host[b][k + 2:k + 3 + j]
            self._commit(req, tokens_b, lps_b)
            req.num_computed = c + 1 + j  # x_c and the accepted drafts are real rows
            if req.finished:
                continue
            self.allocator.truncate(req.alloc, req.num_computed)
            ext_reqs.append(req)
            ext_starts.append(c)
            ext_lens.append(j + 1)
            ext_ids.extend(tokens_b)
            ext_rows.append(torch.arange(b * (k + 1), b * (k + 1) + j + 1))
        if ext_reqs:
            hidden = out.hidden_states[torch.cat(ext_rows).to(out.hidden_states.device)]
            logits_d, streams = self._draft_forward(ext_reqs, ext_starts, ext_lens, ext_ids, hidden)
            self._set_drafts(ext_reqs, logits_d, streams)
        return list(reqs)

    @staticmethod
    def _penalized(reqs: list, logits: torch.Tensor, drafts: torch.Tensor) -> torch.Tensor:
        """Verify logits [B, k+1, V] with each request's penalties; row i also counts the drafts before it (had they
        been generated one by one, they would be in the history), so acceptance matches plain decoding."""
        if not any(r.sampling_params.has_penalties for r in reqs):
            return logits
        target = logits.clone()
        for b, req in enumerate(reqs):
            if req.sampling_params.has_penalties:
                target[b] = penalize_rows(logits[b], req, drafts[b])
        return target

    def _commit(self, req, tokens: list, logprobs: list) -> None:
        """Append accepted tokens in order, stopping at the first that finishes the request."""
        self.total_verify += 1
        req.spec.num_verify += 1
        committed = 0
        for token, lp in zip(tokens, logprobs):
            self.scheduler.append_token(req, token, lp)
            committed += 1
            if req.finished:
                break
        self.total_accepted += committed
        req.spec.num_accepted_tokens += committed
