"""Speculative-sampling acceptance (`accept_sampling`) as a unit: the emitted token follows the target distribution,
a draft equal to the target is always accepted, rows with filtering (top-k / top-p / min-p) match the one-row
definition, and the whole test reads nothing back to the host (no .item(), bool(), int(), float(), .tolist())."""

from __future__ import annotations

import pytest
import torch

from sglang.srt.layers.sampler import filtered_probs
from sglang.srt.sampling.sampling_params import SamplingParams
from sglang.srt.speculative.acceptance import accept_sampling


def _case(k: int, vocab: int, seed: int):
    g = torch.Generator().manual_seed(seed)
    target_logits = torch.randn(k + 1, vocab, generator=g) * 1.5
    q = torch.softmax(torch.randn(k, vocab, generator=g) * 1.5, dim=-1)
    return target_logits, q, g


def test_first_emitted_token_follows_the_target():
    """Whatever the draft, token 0 of the output is distributed as p_0 (accepted draft or correction): the total
    variation from p_0 over 20,000 trials stays within sampling noise (about 0.01 for 6 outcomes; tolerance 0.03).
    Emitting the draft unconditionally would give TV(q_0, p_0), asserted to be far larger."""
    k, vocab, n = 3, 6, 20000
    target_logits, q, g = _case(k, vocab, seed=1)
    params = SamplingParams(temperature=1.0)
    p0 = filtered_probs(target_logits[0], params)
    counts = torch.zeros(vocab)
    accepted = 0
    for _ in range(n):
        drafts = torch.multinomial(q, 1, generator=g).squeeze(1)
        tokens, num_acc = accept_sampling(drafts, q, target_logits, params, g)
        counts[tokens[0]] += 1
        accepted += int(num_acc)
    tv = 0.5 * (counts / n - p0).abs().sum()
    assert tv < 0.03, f"TV {tv:.4f}"
    assert 0.5 * (q[0] - p0).abs().sum() > 0.2  # the test can tell a wrong acceptance rule apart
    assert 0 < accepted < k * n


def test_draft_equal_to_target_is_always_accepted():
    k, vocab = 4, 50
    target_logits, _, g = _case(k, vocab, seed=2)
    params = SamplingParams(temperature=0.7, top_k=10, top_p=0.9)
    p = filtered_probs(target_logits, params)  # [k+1, V], each row as the one-row definition
    for i in range(k + 1):
        assert torch.allclose(p[i], filtered_probs(target_logits[i], params))
    for _ in range(50):
        drafts = torch.multinomial(p[:k], 1, generator=g).squeeze(1)
        tokens, num_acc = accept_sampling(drafts, p[:k], target_logits, params, g)
        assert int(num_acc) == k and torch.equal(tokens[:k], drafts)
        assert p[k, tokens[k]] > 0  # the bonus token comes from the target's filtered last row


def test_no_host_reads(monkeypatch):
    k, vocab = 3, 40
    target_logits, q, g = _case(k, vocab, seed=3)
    drafts = torch.multinomial(q, 1, generator=g).squeeze(1)
    params = SamplingParams(temperature=0.8, top_k=20, top_p=0.95, min_p=0.01)

    def host_read(*args, **kwargs):
        raise AssertionError("host read of a tensor in the acceptance path")

    with monkeypatch.context() as m:
        for name in ("item", "tolist", "__bool__", "__int__", "__float__", "__index__"):
            m.setattr(torch.Tensor, name, host_read)
        tokens, num_acc = accept_sampling(drafts, q, target_logits, params, g)
    with pytest.raises(AssertionError):  # the guard itself works
        with monkeypatch.context() as m:
            m.setattr(torch.Tensor, "item", host_read)
            num_acc.item()
    assert tokens.shape == (k + 1,) and num_acc.dim() == 0 and 0 <= int(num_acc) <= k


@pytest.mark.parametrize("params", [dict(frequency_penalty=0.7), dict(presence_penalty=1.1),
                                    dict(repetition_penalty=1.6),
                                    dict(frequency_penalty=0.4, presence_penalty=0.3, repetition_penalty=1.3)])
def test_verify_row_penalties_count_the_drafts_before_them(params):
    """Row i of a verification is penalised exactly as plain decoding would penalise the next-token logits after
    the committed tokens plus drafts d_1..d_i (drafts repeating committed tokens and each other included)."""
    from types import SimpleNamespace

    from sglang.srt.layers.sampler import penalize_rows

    vocab, k = 30, 4
    g = torch.Generator().manual_seed(5)
    rows = torch.randn(k + 1, vocab, generator=g) * 3
    req = SimpleNamespace(sampling_params=SamplingParams(temperature=0, **params), origin_input_ids=[1, 2, 3, 9],
                          output_ids=[4, 9, 4, 17])
    drafts = torch.tensor([17, 5, 5, 4])
    got = penalize_rows(rows, req, drafts)
    for i in range(k + 1):
        history = SimpleNamespace(sampling_params=req.sampling_params, origin_input_ids=req.origin_input_ids,
                                  output_ids=req.output_ids + drafts[:i].tolist())
        torch.testing.assert_close(got[i], penalize_rows(rows[i:i + 1], history)[0], atol=0, rtol=0)
    assert not torch.equal(got[4], got[0])  # the drafts changed the later rows
