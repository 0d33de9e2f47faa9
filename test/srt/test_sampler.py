"""Sampler: penalties, top-k / top-p / min-p filtering, seeds, logprobs of the raw distribution."""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Optional

import pytest
import torch

from sglang.srt.layers.sampler import sample
from sglang.srt.sampling.sampling_params import SamplingParams


@dataclass
class FakeReq:
    sampling_params: SamplingParams
    origin_input_ids: list = field(default_factory=list)
    output_ids: list = field(default_factory=list)
    generator: Optional[torch.Generator] = None
    top_logprobs_num: int = 0


def logits(values) -> torch.Tensor:
    return torch.tensor([values], dtype=torch.float32)


def greedy(**kw) -> SamplingParams:
    return SamplingParams(temperature=0, **kw)


def test_greedy_logprobs_and_top_logprobs():
    x = logits([1.0, 3.0, 2.0, 0.0])
    out = sample(x, [FakeReq(greedy(), top_logprobs_num=2)])
    lp = torch.log_softmax(x[0], -1)
    assert out.ids == [1] and out.logprobs[0] == pytest.approx(lp[1].item())
    assert [t for _, t in out.top_logprobs[0]] == [1, 2]


def test_frequency_presence_and_repetition_penalties():
    x = logits([2.0, 1.9, -1.0, 0.0])
    # token 0 generated twice: frequency 0.1 * 2 + presence 0 keeps it on top (2.0 - 0.2 = 1.8 < 1.9 -> 1 wins)
    assert sample(x, [FakeReq(greedy(frequency_penalty=0.1), output_ids=[0, 0])]).ids == [1]
    assert sample(x, [FakeReq(greedy(frequency_penalty=0.01), output_ids=[0, 0])]).ids == [0]
    assert sample(x, [FakeReq(greedy(presence_penalty=0.2), output_ids=[0])]).ids == [1]
    # repetition divides positive logits of seen tokens (prompt included): 2.0 / 1.1 < 1.9
    assert sample(x, [FakeReq(greedy(repetition_penalty=1.1), origin_input_ids=[0])]).ids == [1]
    # and multiplies negative ones: -1.0 * 1.5 stays below everything
    out = sample(logits([-1.0, -1.2, -5.0]), [FakeReq(greedy(repetition_penalty=1.5), output_ids=[0])])
    assert out.ids == [1]
    # the reported logprob is the raw distribution's, not the penalised one
    assert out.logprobs[0] == pytest.approx(torch.log_softmax(torch.tensor([-1.0, -1.2, -5.0]), -1)[1].item())


def test_top_k_top_p_min_p_restrict_support():
    x = logits([4.0, 3.9, 0.0, -1.0, -2.0])
    gen = torch.Generator().manual_seed(0)
    for params, allowed in [(SamplingParams(top_k=2), {0, 1}), (SamplingParams(top_p=0.9), {0, 1}),
                            (SamplingParams(min_p=0.5), {0, 1})]:
        seen = {sample(x, [FakeReq(params, generator=gen)]).ids[0] for _ in range(200)}
        assert seen <= allowed and len(seen) == 2, (params, seen)


def test_seeded_sampling_is_reproducible():
    x = torch.randn(1, 50)
    draws = []
    for _ in range(2):
        gen = torch.Generator().manual_seed(123)
        draws.append([sample(x, [FakeReq(SamplingParams(temperature=1.5), generator=gen)]).ids[0] for _ in range(20)])
    assert draws[0] == draws[1] and len(set(draws[0])) > 3


@pytest.mark.parametrize("field_, value", [("frequency_penalty", 3), ("presence_penalty", -2.5),
                                           ("repetition_penalty", 0), ("stop", [""]), ("stop", 5)])
def test_invalid_penalties_and_stops(field_, value):
    with pytest.raises(ValueError, match=field_):
        SamplingParams.from_dict({field_: value})


def test_min_new_tokens_masks_stop_tokens_until_reached():
    """Before min_new_tokens the stop tokens cannot be sampled (masked, as upstream's penalizer does) and stop
    conditions do not apply; from then on they do. Speculative decoding (verify row i follows i drafts) agrees."""
    from oracle import engine, random_ids

    ids = random_ids(20, seed=5)
    free = {"temperature": 0, "max_new_tokens": 12, "ignore_eos": True}
    eng = engine("tiny")
    tokens = eng.generate(input_ids=ids, sampling_params=free)["output_ids"]
    stop = tokens[2]
    first = tokens.index(stop)
    stopped = eng.generate(input_ids=ids, sampling_params={**free, "stop_token_ids": [stop]})
    assert stopped["output_ids"] == tokens[:first + 1]
    params = {**free, "stop_token_ids": [stop], "min_new_tokens": 6}
    held = eng.generate(input_ids=ids, sampling_params=params)["output_ids"]
    assert len(held) >= 6 and stop not in held[:6]
    assert stop not in held[:-1] and (held[-1] == stop or len(held) == 12)  # stops at its first one after 6
    spec = engine("tiny", speculative_algorithm="EAGLE", speculative_num_steps=3)
    assert spec.generate(input_ids=ids, sampling_params=params)["output_ids"] == held
    for e in (eng, spec):
        e.model_runner.token_allocator.check_all_free()


def test_logit_bias_shifts_the_choice_not_the_reported_logprob():
    x = logits([2.0, 1.9, -1.0, 0.0])
    assert sample(x, [FakeReq(greedy(logit_bias={1: 0.2}))]).ids == [1]
    assert sample(x, [FakeReq(greedy(logit_bias={0: -100, 1: -100}))]).ids == [3]
    out = sample(x, [FakeReq(SamplingParams(temperature=1.0, logit_bias={2: 100}), generator=torch.Generator())])
    assert out.ids == [2] and out.logprobs[0] == pytest.approx(torch.log_softmax(x[0], -1)[2].item())
