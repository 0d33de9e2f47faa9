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

Steps 1-3 are `verify`, which returns a SpecVerifyResult; the Scheduler then commits its tokens (stopping at one
that finishes the request) and calls `draft_extend` for steps 4-5. The worker never calls the Scheduler.

A batch of greedy requests (no penalties, logit bias or grammar) within the captured sizes runs steps 2, 3 and 5 as
one replay of a CUDA graph (eagle_cuda_graph_runner.py; eagerly from the same static buffers on CPU): `verify`
returns the next drafts with the tokens, and `draft_extend` only rolls back and keeps them. Other batches run the
eager cycle below.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Optional

import torch

from sglang.srt.layers.attention.dsv4.multi_step_backend import DeepseekV4MultiStepBackend
from sglang.srt.layers.sampler import draw, filtered_probs, penalize_rows
from sglang.srt.managers.decode_worker import DecodeWorker
from sglang.srt.model_executor.forward_batch_info import ForwardBatch, ForwardMode
from sglang.srt.speculative.acceptance import accept_greedy, accept_sampling
from sglang.srt.utils.device_readback import read_back  # the cycle's one device -> host transfer (tests count it)


@dataclass(frozen=True)
class SpecState:
    """A request's pending draft: set by draft-extend, consumed by the next cycle. Replaced, never mutated, so a
    step checkpoint may hold it as it is."""

    draft_token: torch.Tensor  # d_1, a 0-d int64 tensor on the device (no host round trip between passes)
    draft_streams: torch.Tensor  # S_1 [n_hc, D], the MTP output streams of the row that produced d_1
    draft_probs: Optional[torch.Tensor]  # q_1 [V] when sampling (None for greedy)


@dataclass
class SpecVerifyResult:
    """One verification of a decode batch. Request b verified positions starts[b]..starts[b]+k; tokens[b] are its
    accepted drafts then the target's token after them (correction or bonus), logprobs[b] their logprobs (host
    lists). The Scheduler commits them in order; a token that finishes the request drops the ones after it."""

    reqs: list
    starts: list
    tokens: list  # [B] lists of int, 1..k+1 each
    logprobs: list  # [B] lists of float
    hidden_states: Optional[torch.Tensor]  # [B * (k+1), n_hc, D] the target's streams of the verify rows
    # (d_1 [B], S_1 [B, n_hc, D]) of the next cycle when the captured cycle already draft-extended, else None
    next_drafts: Optional[tuple] = None


class EagleWorker(DecodeWorker):
    speculative = True
    capture_hidden = True  # the draft consumes the target's streams of every row

    def __init__(self, runner) -> None:
        self.runner = runner
        self.allocator = runner.token_allocator
        self.num_steps = runner.server_args.speculative_num_steps
        self.num_draft_tokens = runner.server_args.speculative_num_draft_tokens
        self.draft_backend = DeepseekV4MultiStepBackend(runner.attn_backend, max(1, self.num_steps - 1))

    # ---- draft passes -----------------------------------------------------------------------------------------
    def _draft_forward(self, reqs: list, starts: list, lens: list, input_ids: list,
                       hidden: torch.Tensor) -> tuple:
        """MTP rows [starts[b], starts[b] + lens[b]) of each request -> (last-row logits [B, V], streams [B, n, D])."""
        loc = self._token_slots([r.alloc.req_pool_idx for r in reqs], starts, lens)
        forward_batch = ForwardBatch.build(ForwardMode.DRAFT_EXTEND, input_ids, [r.alloc.req_pool_idx for r in reqs],
                                           starts, lens, loc, self.runner.device, capture_hidden=True)
        forward_batch.spec_hidden_states = hidden
        out = self.runner.forward_draft(forward_batch)
        last = forward_batch.extend_start_loc + forward_batch.extend_seq_lens - 1
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
                tokens[b] = draw(probs[b], req.generator)
        return tokens, probs

    def _set_drafts(self, reqs: list, logits: torch.Tensor, streams: torch.Tensor) -> None:
        tokens, probs = self._next_tokens(reqs, logits)
        for b, req in enumerate(reqs):
            req.spec = SpecState(tokens[b], streams[b], probs[b])

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
        for req, start, n in zip(reqs, starts, lens):
            if start <= req.draft_len:
                req.draft_len = start + n
        # a retracted request resumes with the draft it had (its prefill re-fills the draft's window only)
        done = [b for b, req in enumerate(reqs) if req.prefill_done and req.spec is None]
        if done:
            index = torch.tensor(done, device=logits.device)
            self._set_drafts([reqs[b] for b in done], logits[index], streams[index])

    # ---- one speculative decode cycle ---------------------------------------------------------------------
    def verify(self, reqs: list) -> SpecVerifyResult:
        """Steps 1-3 of a cycle: allocate the verify positions, draft, verify and accept (one device read)."""
        k = self.num_steps
        starts = [r.num_computed for r in reqs]
        if self._captured(reqs):
            return self._verify_static(reqs, starts)
        self.allocator.extend_batch([r.alloc for r in reqs], [c + k + 1 for c in starts])  # positions c..c+k
        drafts, draft_probs = self._draft_steps(reqs, starts, k)
        return self._verify(reqs, starts, drafts, draft_probs)

    def _captured(self, reqs: list) -> bool:
        """Whether the cycle runs on the static path (EagleCudaGraphRunner): greedy requests with nothing that
        adjusts their logits, none holding positions past its computed ones, within the captured batch sizes."""
        graphs = self.runner.graph_runner
        return graphs is not None and graphs.can_run(len(reqs)) and all(
            r.sampling_params.is_greedy and not r.sampling_params.adjusts_logits and r.grammar is None
            and r.alloc.num_tokens == r.num_computed for r in reqs)

    def _verify_static(self, reqs: list, starts: list) -> SpecVerifyResult:
        k = self.num_steps
        slots = self.allocator.plan_extend([r.alloc for r in reqs], [c + k + 1 for c in starts])  # written in replay
        result, next_tokens, next_streams = self.runner.graph_runner.forward(
            slots, [r.output_ids[-1] for r in reqs], [r.spec.draft_token for r in reqs],
            [r.spec.draft_streams for r in reqs])
        next_drafts = (next_tokens.clone(), next_streams.clone())  # the next replay overwrites the graph's outputs
        tokens, logprobs = self._unpack(read_back(result))
        return SpecVerifyResult(reqs, starts, tokens, logprobs, None, next_drafts)

    def _unpack(self, host: list) -> tuple:
        """Rows of k+1 tokens, the number j of accepted drafts, k+1 logprobs -> per-request token and logprob lists
        (the first j+1 of each count; token ids are exact in float64)."""
        k = self.num_steps
        tokens_out, logprobs_out = [], []
        for row in host:
            j = int(row[k + 1])
            tokens_out.append([int(t) for t in row[:j + 1]])
            logprobs_out.append(row[k + 2:k + 3 + j])
        return tokens_out, logprobs_out

    def draft_extend(self, verified: SpecVerifyResult) -> None:
        """Steps 4-5, after the Scheduler committed the tokens and advanced num_computed past the accepted rows: roll
        each running request's target back to them and draft-extend over them (x_{p+1}: the committed tokens)."""
        k = self.num_steps
        live = [r for r in verified.reqs if not r.finished]
        self.allocator.truncate_batch([r.alloc for r in live], [r.num_computed for r in live])
        reqs, starts, lens, ids, rows = [], [], [], [], []
        for b, (req, c, tokens) in enumerate(zip(verified.reqs, verified.starts, verified.tokens)):
            if req.finished:
                continue
            if c <= req.draft_len:  # rows c .. num_computed - 1 get the committed tokens' rows (here or in the graph)
                req.draft_len = req.num_computed
            if verified.next_drafts is not None:  # the captured cycle draft-extended already
                req.spec = SpecState(verified.next_drafts[0][b], verified.next_drafts[1][b], None)
                continue
            reqs.append(req)
            starts.append(c)
            lens.append(len(tokens))
            ids.extend(tokens)
            rows.append(torch.arange(b * (k + 1), b * (k + 1) + len(tokens)))
        if reqs:
            hidden = verified.hidden_states[torch.cat(rows).to(verified.hidden_states.device)]
            logits, streams = self._draft_forward(reqs, starts, lens, ids, hidden)
            self._set_drafts(reqs, logits, streams)

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
        for forward_batch in steps:
            forward_batch.input_ids = columns[-1]
            forward_batch.spec_hidden_states = streams
            out = self.runner.forward_draft(forward_batch, metadata_ready=True)
            streams = out.hidden_states
            tokens, step_probs = self._next_tokens(reqs, out.next_token_logits)
            columns.append(tokens)
            for b in range(len(reqs)):
                probs[b].append(step_probs[b])
        return torch.stack(columns, dim=1), probs

    def _verify(self, reqs: list, starts: list, drafts: torch.Tensor, draft_probs: list) -> SpecVerifyResult:
        """drafts [B, k] on the device. Acceptance (greedy for the batch, speculative sampling per sampled request)
        stays on the device; tokens, accept lengths and logprobs come back in one transfer."""
        k = self.num_steps
        device = self.runner.device
        last = torch.tensor([r.output_ids[-1] for r in reqs], dtype=torch.int64).to(device, non_blocking=True)
        loc = self._token_slots([r.alloc.req_pool_idx for r in reqs], starts, [k + 1] * len(reqs))
        forward_batch = ForwardBatch.build(ForwardMode.TARGET_VERIFY, [0] * (len(reqs) * (k + 1)),
                                           [r.alloc.req_pool_idx for r in reqs], starts, [k + 1] * len(reqs), loc,
                                           device, capture_hidden=True, return_all_logits=True)
        forward_batch.input_ids = torch.cat((last[:, None], drafts), dim=1).flatten()
        out = self.runner.forward(forward_batch)
        logits = out.all_logits.view(len(reqs), k + 1, -1)  # raw: the reported logprobs are taken before penalties
        target = self._constrained(reqs, self._penalized(reqs, logits, drafts), drafts)  # what acceptance uses
        # tokens[b, :j+1]: the j accepted drafts, then the target's token at position j (correction or bonus)
        tokens, num_acc = accept_greedy(drafts, target)
        for b, req in enumerate(reqs):
            if not req.sampling_params.is_greedy:  # speculative sampling, still on the device
                tokens[b], num_acc[b] = accept_sampling(drafts[b], torch.stack(draft_probs[b]), target[b],
                                                        req.sampling_params, req.generator)
        lps = torch.log_softmax(logits, dim=-1).gather(2, tokens[:, :, None]).squeeze(2)
        # the one host transfer of the cycle
        tokens_out, logprobs_out = self._unpack(read_back(torch.cat((tokens.double(), num_acc[:, None].double(),
                                                                     lps.double()), dim=1)))
        return SpecVerifyResult(reqs, starts, tokens_out, logprobs_out, out.hidden_states)

    def _constrained(self, reqs: list, target: torch.Tensor, drafts: torch.Tensor) -> torch.Tensor:
        """Verify logits [B, k+1, V] masked by each constrained request's grammar: row i allows what the grammar
        allows after the committed tokens and d_1..d_i. The matchers run on the host, so constrained cycles read the
        drafts back (one more transfer)."""
        if self.grammar is None or all(r.grammar is None for r in reqs):
            return target
        batch, rows, vocab = target.shape
        host_drafts = drafts.tolist()
        bitmask = self.grammar.new_bitmask(batch * rows)
        for b, req in enumerate(reqs):
            if req.grammar is not None:
                self.grammar.fill_verify_rows(bitmask, b * rows, req.grammar, host_drafts[b])
        return self.grammar.apply_bitmask(target.reshape(batch * rows, vocab), bitmask).view(batch, rows, vocab)

    @staticmethod
    def _penalized(reqs: list, logits: torch.Tensor, drafts: torch.Tensor) -> torch.Tensor:
        """Verify logits [B, k+1, V] with each request's penalties; row i also counts the drafts before it (had they
        been generated one by one, they would be in the history), so acceptance matches plain decoding."""
        if not any(r.sampling_params.adjusts_logits for r in reqs):
            return logits
        target = logits.clone()
        for b, req in enumerate(reqs):
            if req.sampling_params.adjusts_logits:
                target[b] = penalize_rows(logits[b], req, drafts[b])
        return target
