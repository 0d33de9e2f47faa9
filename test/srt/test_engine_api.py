"""sglang.Engine's offline API: SGLang's generate() shapes, batches, logprob windows, sampling, bad input."""

from __future__ import annotations

import functools
import os

import pytest
import torch

import sglang
from oracle import engine, random_ids


@functools.lru_cache(maxsize=None)
def tiny():
    return engine("tiny", chunked_prefill_size=32)


def test_single_and_batch_shapes():
    eng = tiny()
    out = eng.generate(input_ids=random_ids(20, 1), sampling_params={"temperature": 0, "max_new_tokens": 5,
                                                                     "ignore_eos": True})
    assert set(out) == {"text", "output_ids", "meta_info"} and len(out["output_ids"]) == 5
    meta = out["meta_info"]
    assert meta["prompt_tokens"] == 20 and meta["completion_tokens"] == 5
    assert meta["finish_reason"] == {"type": "length", "length": 5}
    outs = eng.generate(input_ids=[random_ids(9, 2), random_ids(33, 3)],
                        sampling_params=[{"temperature": 0, "max_new_tokens": 3, "ignore_eos": True},
                                         {"temperature": 0, "max_new_tokens": 6, "ignore_eos": True}])
    assert [len(o["output_ids"]) for o in outs] == [3, 6]
    # A batch gives each request what it gets alone.
    alone = eng.generate(input_ids=random_ids(33, 3), sampling_params={"temperature": 0, "max_new_tokens": 6,
                                                                       "ignore_eos": True})
    assert alone["output_ids"] == outs[1]["output_ids"]
    eng.model_runner.token_allocator.check_all_free()


def test_logprob_windows():
    eng = tiny()
    ids = random_ids(12, 4)
    full = eng.generate(input_ids=ids, sampling_params={"temperature": 0, "max_new_tokens": 2},
                        return_logprob=True, logprob_start_len=0)["meta_info"]
    assert [t for _, t, _ in full["input_token_logprobs"]] == ids and full["input_token_logprobs"][0][0] is None
    part = eng.generate(input_ids=ids, sampling_params={"temperature": 0, "max_new_tokens": 2},
                        return_logprob=True, logprob_start_len=7)["meta_info"]
    assert part["input_token_logprobs"] == full["input_token_logprobs"][7:]
    last = eng.generate(input_ids=ids, sampling_params={"temperature": 0, "max_new_tokens": 2},
                        return_logprob=True)["meta_info"]
    assert last["input_token_logprobs"] == full["input_token_logprobs"][-1:]
    assert len(full["output_token_logprobs"]) == 2 and all(lp <= 0 for lp, _, _ in full["output_token_logprobs"])


def test_sampling_seed_and_stop_tokens():
    eng = tiny()
    ids = random_ids(15, 5)
    params = {"temperature": 1.0, "top_p": 0.9, "top_k": 50, "max_new_tokens": 8, "seed": 7, "ignore_eos": True}
    a = eng.generate(input_ids=ids, sampling_params=params)["output_ids"]
    b = eng.generate(input_ids=ids, sampling_params=params)["output_ids"]
    c = eng.generate(input_ids=ids, sampling_params={**params, "seed": 8})["output_ids"]
    assert a == b and a != c
    greedy = eng.generate(input_ids=ids, sampling_params={"temperature": 0, "max_new_tokens": 8,
                                                          "ignore_eos": True})["output_ids"]
    stop = greedy[3]
    out = eng.generate(input_ids=ids, sampling_params={"temperature": 0, "max_new_tokens": 8, "ignore_eos": True,
                                                       "stop_token_ids": [stop]})
    assert out["output_ids"] == greedy[:greedy.index(stop) + 1]
    assert out["meta_info"]["finish_reason"] == {"type": "stop", "matched": stop}
    zero = eng.generate(input_ids=ids, sampling_params={"max_new_tokens": 0})
    assert zero["output_ids"] == [] and zero["meta_info"]["finish_reason"]["type"] == "length"
    eng.model_runner.token_allocator.check_all_free()


@pytest.mark.parametrize("kwargs, message", [
    (dict(input_ids=[]), "empty"),
    (dict(input_ids=[5, 600]), "outside the vocabulary"),
    (dict(input_ids=[5, 6], sampling_params={"max_new_tokens": -1}), "max_new_tokens"),
    (dict(input_ids=[5, 6], sampling_params={"temperature": -0.5}), "temperature"),
    (dict(input_ids=[5, 6], sampling_params={"top_p": 0}), "top_p"),
    (dict(input_ids=[5, 6], sampling_params={"top_k": 0}), "top_k"),
    (dict(input_ids=[5, 6], sampling_params={"bogus": 1}), "unknown sampling parameter"),
    (dict(input_ids=[5, 6], sampling_params={"max_new_tokens": 5000}), "context length"),
    (dict(), "exactly one of"),
])
def test_bad_requests_raise_named_errors(kwargs, message):
    eng = tiny()
    with pytest.raises(ValueError, match=message):
        eng.generate(**kwargs)
    eng.model_runner.token_allocator.check_all_free()
    assert not eng.scheduler.waiting and not eng.scheduler.running


def test_builtin_model_prompt_roundtrip():
    eng = sglang.Engine(model_path="tiny-deepseek-v4", device="cpu", dtype="float32", log_level="warning",
                        max_running_requests=4, max_total_tokens=4096)
    out = eng.generate(prompt="Hello, DeepSeek", sampling_params={"temperature": 0, "max_new_tokens": 4,
                                                                  "ignore_eos": True})
    assert isinstance(out["text"], str) and len(out["output_ids"]) == 4
    assert out["meta_info"]["prompt_tokens"] == len(eng.tokenizer.encode("Hello, DeepSeek").ids)
    eng.shutdown()


@pytest.mark.parametrize("kwargs, message", [
    (dict(page_size=24), "multiple of"),
    (dict(kv_cache_dtype="int4"), "kv-cache-dtype"),
    (dict(swa_full_tokens_ratio=0), "swa-full-tokens-ratio"),
    (dict(context_length=4096), "max_position_embeddings"),
])
def test_bad_server_args(kwargs, message):
    with pytest.raises(ValueError, match=message):
        engine("tiny", **kwargs)


def assert_same_output(got, want, where="output"):
    """Equal dicts, lists and values, floats (logprobs) to 1e-5: the two paths batch requests differently."""
    if isinstance(want, dict):
        assert isinstance(got, dict) and set(got) == set(want), (where, got, want)
        for key in want:
            assert_same_output(got[key], want[key], f"{where}.{key}")
    elif isinstance(want, (list, tuple)):
        assert type(got) is type(want) and len(got) == len(want), (where, got, want)
        for i, (g, w) in enumerate(zip(got, want)):
            assert_same_output(g, w, f"{where}[{i}]")
    elif isinstance(want, float):
        assert isinstance(got, float) and abs(got - want) < 1e-5, (where, got, want)
    else:
        assert got == want, (where, got, want)


def test_subprocess_engine_matches_in_process(tmp_path):
    """Engine(launch_subprocess=True) runs the server's scheduler process and TokenizerManager; it returns the same
    dicts as the in-process Engine (one output-shaping module): logprobs with top-k, a stop string, a refusal."""
    ids = [random_ids(14, 20), random_ids(31, 21)]
    params = {"temperature": 0, "max_new_tokens": 6, "ignore_eos": True}
    logprobs = dict(return_logprob=True, logprob_start_len=[0, -1], top_logprobs_num=[3, 0])
    local = tiny().generate(input_ids=ids, sampling_params=params, **logprobs)
    free = tiny().generate(input_ids=ids[0], sampling_params={**params, "max_new_tokens": 12})
    stop = free["text"][len(free["text"]) // 2:][:2]
    assert stop.strip() and "\ufffd" not in stop, free["text"]
    stopped = tiny().generate(input_ids=ids[0], sampling_params={**params, "max_new_tokens": 12, "stop": stop},
                              return_logprob=True)
    assert stopped["meta_info"]["finish_reason"] == {"type": "stop", "matched": stop}
    assert stopped["text"] == free["text"][:free["text"].find(stop)]
    from oracle import checkpoint

    eng = sglang.Engine(launch_subprocess=True, model_path=checkpoint("tiny"), device="cpu", dtype="float32",
                        page_size=16, log_level="warning", max_running_requests=8, max_total_tokens=8192,
                        chunked_prefill_size=32)
    try:
        remote = eng.generate(input_ids=ids, sampling_params=params, **logprobs)
        remote_stopped = eng.generate(input_ids=ids[0], sampling_params={**params, "max_new_tokens": 12,
                                                                         "stop": stop}, return_logprob=True)
        with pytest.raises(ValueError, match="context length"):
            eng.generate(input_ids=[5, 6], sampling_params={"max_new_tokens": 5000})
        started = eng.start_profile(output_dir=str(tmp_path), num_steps=1, activities=["CPU"])
        again = eng.generate(input_ids=ids[1], sampling_params=params)  # its prefix is cached by now
        assert "for 1 steps" in started and len(os.listdir(tmp_path)) == 1  # the profiler of the scheduler process
        with pytest.raises(ValueError, match="no profile is running"):
            eng.stop_profile()
        assert eng.flush_cache()
        flushed = eng.generate(input_ids=ids[1], sampling_params=params)
        assert again["meta_info"]["cached_tokens"] == 16 and flushed["meta_info"]["cached_tokens"] == 0
        # weights through the scheduler process: tensors pickled over its socket, read back, the checkpoint again
        w = torch.tensor(eng.get_weights_by_name("layers.0.attn.wq_a.weight", 10**5))
        assert eng.update_weights_from_tensor([("layers.0.attn.wq_a.weight", 2 * w)]) == (True, "updated 1 weight "
                                                                                            "tensors")
        assert torch.equal(torch.tensor(eng.get_weights_by_name("layers.0.attn.wq_a.weight", 10**5)), 2 * w)
        assert eng.update_weights_from_disk(checkpoint("tiny"))[0]
        assert torch.equal(torch.tensor(eng.get_weights_by_name("layers.0.attn.wq_a.weight", 10**5)), w)
        proc = eng._remote.proc
    finally:
        eng.shutdown()
    assert not proc.is_alive()
    for got, want in zip(remote + [remote_stopped], local + [stopped]):
        for out in (got, want):  # a duration, and each engine numbers its own requests
            del out["meta_info"]["e2e_latency"], out["meta_info"]["id"]
        assert_same_output(got, want)
    assert len(local[0]["meta_info"]["input_token_logprobs"]) == 14 and local[0]["meta_info"]["output_top_logprobs"]
