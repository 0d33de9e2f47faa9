"""Speculative decoding with the MTP draft (EAGLE, top-k 1) on the tiny model (CPU, fp32).

Exactness: greedy speculative output equals non-speculative output token for token (32 requests x 128 tokens, steps
1..3, chunked prefill, requests joining and leaving mid-speculation, contexts crossing compression windows).
Acceptance is real: a checkpoint whose draft predicts the target accepts steps + 1 tokens per verification; the
random draft falls to about 1. The multi-step backend's metadata equals fresh single-step metadata. With
temperature > 0 the token distribution matches non-speculative sampling.
"""

from __future__ import annotations

import functools
import os

import pytest
import torch

from host_reads import HostReadGuard
from oracle import CHECKPOINT_ROOT, TINY, engine, random_ids
from spec_checkpoint import make_predictable_checkpoint
from sglang.srt.layers.attention.dsv4.torch_backend import TorchAttnBackend
from sglang.srt.managers.schedule_batch import Req
from sglang.srt.model_loader.tiny_checkpoint import TINY_CONFIG
from sglang.srt.model_executor.forward_batch_info import ForwardBatch, ForwardMode
from sglang.srt.sampling.sampling_params import SamplingParams

# 37-64 new tokens: every request decodes past a window (16) and several compressed entries (ratios 4 and 8) of its
# own tokens, the first half still speculating when the second joins and the lengths spread the leaving steps
NUM_REQS, NEW_TOKENS = 32, 64


def prompts() -> list:
    return [random_ids(12 + 5 * i, seed=100 + i) for i in range(NUM_REQS)]  # 12..167 tokens


def params(i: int) -> dict:
    # Different lengths, so requests leave at different steps while others keep speculating.
    return {"temperature": 0, "max_new_tokens": NEW_TOKENS - (i % 4) * 9, "ignore_eos": True}


@functools.lru_cache(maxsize=None)
def reference() -> list:
    eng = engine("tiny", chunked_prefill_size=64, max_running_requests=32)
    return [o["output_ids"] for o in eng.generate(input_ids=prompts(), sampling_params=[params(i) for i in
                                                                                        range(NUM_REQS)])]


def run_staggered(eng) -> list:
    """Half the requests at once, the rest joining while the first ones are mid-speculation."""
    sched = eng.scheduler
    reqs = [Req(rid=str(i), origin_input_ids=p, sampling_params=SamplingParams.from_dict(params(i)))
            for i, p in enumerate(prompts())]
    for req in reqs[:16]:
        sched.add_request(req)
    step = 0
    while sched.has_work() or step < 8:
        if step == 7:
            for req in reqs[16:]:
                sched.add_request(req)
        sched.step()
        step += 1
    return reqs


# one draft step, and several (the draft's multi-step loop and its backends; 2 steps run the same loop as 3)
@pytest.mark.parametrize("steps", [1, 3])
def test_greedy_speculative_equals_plain(steps):
    eng = engine("tiny", chunked_prefill_size=64, max_running_requests=32, speculative_algorithm="EAGLE",
                 speculative_num_steps=steps)
    reqs = run_staggered(eng)
    assert [r.output_ids for r in reqs] == reference()
    assert all(r.spec_accept_length is not None and r.spec_accept_length >= 1 for r in reqs)
    eng.model_runner.token_allocator.check_all_free()


@functools.lru_cache(maxsize=None)
def predictable_path(quantize: bool = False) -> str:
    config = dict(TINY, quantization_config=TINY_CONFIG["quantization_config"], expert_dtype="fp4") \
        if quantize else TINY
    out = os.path.join(CHECKPOINT_ROOT, f"tiny-predictable-{'q' if quantize else 'f32'}")
    return make_predictable_checkpoint(out, config, quantize=quantize)


@pytest.mark.parametrize("steps", [1, 2, 3])
def test_acceptance_predictable_draft_vs_random(steps):
    ids = [random_ids(30 + 9 * i, seed=7 + i) for i in range(4)]
    sp = {"temperature": 0, "max_new_tokens": 40, "ignore_eos": True}
    good = engine("tiny", speculative_algorithm="EAGLE", speculative_num_steps=steps, model_path=predictable_path())
    outs = good.generate(input_ids=ids, sampling_params=sp)
    for prompt, out in zip(ids, outs):  # the constructed target counts upwards
        assert out["output_ids"] == [(prompt[-1] + 1 + i) % 512 for i in range(40)]
    good_len = good.scheduler.mean_accept_length
    rand = engine("tiny", speculative_algorithm="EAGLE", speculative_num_steps=steps)
    rand.generate(input_ids=ids, sampling_params=sp)
    rand_len = rand.scheduler.mean_accept_length
    print(f"steps {steps}: accept length predictable draft {good_len:.3f}, random draft {rand_len:.3f}")
    # Every verification accepts all k drafts plus the bonus, except where max_new_tokens cuts the last one short.
    assert good_len > steps + 1 - 0.25
    assert rand_len < 1.2
    for eng in (good, rand):
        eng.model_runner.token_allocator.check_all_free()


def test_quantized_predictable_checkpoint_accepts_every_draft():
    """The predictable checkpoint in the hub's formats (FP8 linears incl. the MTP's e_proj = I and zeroed wo_b / h_proj,
    MXFP4 experts with zeroed w2): the zeroed blocks load as exact zeros (no NaN scale), I survives FP8 exactly, greedy
    speculative output equals plain greedy output, and every verification accepts all 3 drafts plus the bonus token."""
    from safetensors import safe_open

    from sglang.srt.model_loader.quant_formats import dequantize_fp8_block, dequantize_mxfp4

    path = predictable_path(quantize=True)
    with safe_open(os.path.join(path, "model.safetensors"), "pt") as f:
        def stored(name: str) -> tuple:
            return f.get_tensor(name + ".weight"), f.get_tensor(name + ".scale")
        e_proj = dequantize_fp8_block(*stored("mtp.0.e_proj"))
        wo_b = dequantize_fp8_block(*stored("layers.1.attn.wo_b"))
        w2 = dequantize_mxfp4(*stored("mtp.0.ffn.experts.3.w2"))
    assert torch.equal(e_proj, torch.eye(e_proj.shape[0])) and not wo_b.any() and not w2.any()
    ids = [random_ids(30 + 9 * i, seed=7 + i) for i in range(3)]
    sp = {"temperature": 0, "max_new_tokens": 1 + 4 * 6, "ignore_eos": True}  # the prefill's token, 6 full cycles
    plain = engine("tiny", quantize=True, model_path=path).generate(input_ids=ids, sampling_params=sp)
    spec_eng = engine("tiny", quantize=True, model_path=path, speculative_algorithm="EAGLE", speculative_num_steps=3)
    spec = spec_eng.generate(input_ids=ids, sampling_params=sp)
    for prompt, p, s in zip(ids, plain, spec):
        assert s["output_ids"] == p["output_ids"] == [(prompt[-1] + 1 + i) % 512 for i in range(25)]
        assert s["meta_info"]["spec_accept_length"] == 4.0
    assert spec_eng.scheduler.mean_accept_length == 4.0
    spec_eng.model_runner.token_allocator.check_all_free()


def test_multi_step_metadata_equals_single_step():
    eng = engine("tiny", speculative_algorithm="EAGLE", speculative_num_steps=3)
    runner, worker = eng.model_runner, eng.scheduler.worker
    allocs = [runner.token_allocator.alloc_req() for _ in range(3)]
    starts = [37, 64, 9]
    for alloc, c in zip(allocs, starts):
        runner.token_allocator.extend(alloc, c + 4)
    rtt = runner.req_to_token_pool.req_to_token
    steps = []
    for i in range(2, 4):
        pos = [c + i - 2 for c in starts]
        loc = torch.stack([rtt[a.req_pool_idx, p] for a, p in zip(allocs, pos)])
        steps.append(ForwardBatch.build(ForwardMode.DRAFT_EXTEND, [5, 6, 7], [a.req_pool_idx for a in allocs], pos,
                                        [1, 1, 1], loc, runner.device))
    worker.draft_backend.init_forward_metadata(steps, runner)
    assert len(steps) == len(worker.draft_backend.backends)  # the last step's metadata was built too
    for forward_batch in steps:
        fresh = ForwardBatch.build(ForwardMode.DRAFT_EXTEND, [5, 6, 7], forward_batch.req_pool_indices_cpu,
                                   forward_batch.extend_prefix_lens_cpu, [1, 1, 1], forward_batch.out_cache_loc,
                                   runner.device)
        fresh.req_to_token_pool = runner.req_to_token_pool
        backend = TorchAttnBackend(runner.model_config, runner.token_to_kv_pool, runner.token_allocator,
                                   runner.server_args.page_size, runner.pool_plan.shape.num_draft_tokens)
        backend.init_forward_metadata(fresh)
        a, b = forward_batch.attn_metadata, fresh.attn_metadata
        assert torch.equal(a.window_slots, b.window_slots) and torch.equal(a.out_swa_loc, b.out_swa_loc)
        for ratio in a.ratios:
            ra, rb = a.ratios[ratio], b.ratios[ratio]
            assert torch.equal(ra.entry_slots, rb.entry_slots) and torch.equal(ra.row_visible, rb.row_visible)
            assert torch.equal(ra.plan.source_rows, rb.plan.source_rows)
    for alloc in allocs:
        runner.token_allocator.free_req(alloc)
    runner.token_allocator.check_all_free()


def token_histograms(eng, n: int) -> torch.Tensor:
    """[2, V] empirical distributions of the 2nd and 3rd generated tokens (the first verifications decide them)."""
    ids = random_ids(25, seed=3)
    counts = torch.zeros(2, 512)
    for lo in range(0, n, 32):
        outs = eng.generate(input_ids=[ids] * 32, sampling_params=[
            {"temperature": 1.0, "top_k": 2, "max_new_tokens": 3, "ignore_eos": True, "seed": lo + i}
            for i in range(32)])
        for o in outs:
            for pos in (1, 2):
                counts[pos - 1, o["output_ids"][pos]] += 1
    return counts / n


def test_sampling_distribution_is_unchanged():
    """Speculative sampling (accept d with min(1, p/q), else draw from max(p - q, 0)) keeps the target's token
    distribution: the total variation between speculative and plain histograms of the 2nd and 3rd tokens over 384
    seeds stays within sampling noise (top-k 2 keeps 2-8 outcomes, noise about 0.05-0.09; tolerance 0.15). Always
    accepting the random draft's tokens instead moves it close to 1."""
    n = 384
    plain = token_histograms(engine("tiny", max_running_requests=32), n)
    spec = token_histograms(engine("tiny", max_running_requests=32, speculative_algorithm="EAGLE",
                                   speculative_num_steps=2), n)
    tv = 0.5 * (plain - spec).abs().sum(dim=1)
    print(f"TV(plain, speculative) over {n} samples: 2nd token {tv[0]:.3f}, 3rd token {tv[1]:.3f} "
          f"({int((plain[0] > 0).sum())} and {int((plain[1] > 0).sum())} distinct tokens)")
    assert (tv < 0.15).all()


@pytest.mark.parametrize("kwargs, message", [
    (dict(speculative_algorithm="EAGLE", speculative_eagle_topk=2), "top-k 1"),
    (dict(speculative_algorithm="EAGLE", speculative_num_steps=3, speculative_num_draft_tokens=5), "steps \\+ 1"),
    (dict(speculative_num_steps=2), "need --speculative-algorithm"),
])
def test_bad_speculative_flags(kwargs, message):
    with pytest.raises(ValueError, match=message):
        engine("tiny", **kwargs)


def test_nextn_alias():
    eng = engine("tiny", speculative_algorithm="NEXTN", speculative_num_steps=1)
    assert eng.server_args.speculative_algorithm == "EAGLE" and eng.server_args.speculative_num_draft_tokens == 2
    eng.model_runner.token_allocator.check_all_free()


PENALTIES = [{"frequency_penalty": 0.7}, {"presence_penalty": 1.1}, {"repetition_penalty": 1.6},
             {"frequency_penalty": 0.4, "presence_penalty": 0.3, "repetition_penalty": 1.3},
             {"logit_bias": {str(t): 3.0 for t in range(0, 512, 5)}}, {}]


@pytest.mark.parametrize("steps", [1, 3])
def test_greedy_with_penalties_equals_plain(steps):
    """Penalties apply to every verify row with the drafts before it counted as generated, so greedy speculative
    decoding with frequency / presence / repetition penalties and logit_bias equals plain decoding token for token
    (12 requests, 64 tokens, mixed with requests without penalties). The penalties change the output (checked
    against none)."""
    ids, sp, plain = penalties_plain()
    eng = engine("tiny", max_running_requests=12, speculative_algorithm="EAGLE", speculative_num_steps=steps)
    spec = [o["output_ids"] for o in eng.generate(input_ids=ids, sampling_params=sp)]
    assert spec == plain
    eng.model_runner.token_allocator.check_all_free()


@functools.lru_cache(maxsize=None)
def penalties_plain() -> tuple:
    """The penalties' requests and their plain (non-speculative) outputs, computed once for every step count."""
    ids = [random_ids(20 + 9 * i, seed=300 + i) for i in range(12)]
    sp = [{"temperature": 0, "max_new_tokens": 64, "ignore_eos": True, **PENALTIES[i % len(PENALTIES)]}
          for i in range(12)]
    plain = [o["output_ids"] for o in engine("tiny", max_running_requests=12).generate(input_ids=ids,
                                                                                       sampling_params=sp)]
    free = engine("tiny", max_running_requests=12).generate(
        input_ids=ids, sampling_params=[{k: v for k, v in s.items() if "penalty" not in k and k != "logit_bias"}
                                        for s in sp])
    assert sum(f["output_ids"] != p for f, p in zip(free, plain)) >= 6  # the penalties did something
    return ids, sp, plain


def test_sampling_with_penalties_runs():
    eng = engine("tiny", speculative_algorithm="EAGLE", speculative_num_steps=2)
    outs = eng.generate(input_ids=[random_ids(30, seed=i) for i in range(4)], sampling_params={
        "temperature": 0.9, "max_new_tokens": 24, "ignore_eos": True, "frequency_penalty": 0.5,
        "repetition_penalty": 1.2, "seed": 7})
    assert all(len(o["output_ids"]) == 24 for o in outs)
    eng.model_runner.token_allocator.check_all_free()


@pytest.mark.parametrize("sampled", [True, False])  # the eager cycle; the static (captured) cycle
def test_decode_cycle_reads_the_device_once(monkeypatch, sampled):
    """A whole speculative cycle (draft steps, verify, acceptance for greedy and sampled requests, rollback,
    draft-extend, scheduler bookkeeping) makes exactly one device -> host read, `read_back`; any other Python-level
    read of a tensor (.item(), .tolist(), bool(), int(), float(), index use) is recorded as a violation. The
    rollback of every request's rejected drafts is one unmapping a cycle."""
    import sglang.srt.speculative.eagle_worker as ew
    from sglang.srt.managers.scheduler import Scheduler

    eng = engine("tiny", speculative_algorithm="EAGLE", speculative_num_steps=3, max_running_requests=8)
    sched = eng.scheduler
    reqs = [Req(rid=str(i), origin_input_ids=random_ids(30 + 7 * i, seed=i), sampling_params=SamplingParams.from_dict(
        {"temperature": 0.8 if sampled and i % 2 else 0, "max_new_tokens": 40, "ignore_eos": True, "seed": i}))
        for i in range(4)]
    static = []
    real_static = ew.EagleWorker._verify_static
    monkeypatch.setattr(ew.EagleWorker, "_verify_static", lambda *a: static.append(1) or real_static(*a))
    for req in reqs:
        sched.add_request(req)
    while not all(r.spec is not None for r in reqs):  # prefill (and the first drafts) outside the guard
        sched.step()
    guard, cycles = HostReadGuard(), []
    real_cycle = Scheduler._run_speculative_cycle

    def cycle(self, batch_reqs):
        cycles.append(len(batch_reqs))
        with monkeypatch.context() as m:
            guard.install(m)
            if len(cycles) == 1:
                bool(torch.tensor(1))  # the guard sees a read (positive control, removed below)
            return real_cycle(self, batch_reqs)

    monkeypatch.setattr(ew, "read_back", guard.allowed(lambda x: x.tolist()))
    monkeypatch.setattr(Scheduler, "_run_speculative_cycle", cycle)
    alloc, unmaps = eng.model_runner.token_allocator, []
    real_unmap = alloc._unmap
    monkeypatch.setattr(alloc, "_unmap", lambda full: unmaps.append(len(full)) or real_unmap(full))
    for _ in range(6):
        sched.step()
    assert len(cycles) == 6 and guard.reads == 6
    # the rejected drafts' rollback: one host -> device copy and fill a cycle for every request (random weights
    # reject most drafts)
    assert 0 < len(unmaps) <= 6 and sum(unmaps) > len(unmaps)
    assert guard.violations == ["__bool__"], guard.violations  # only the control
    assert len(static) == (0 if sampled else 6)
    while sched.has_work():
        sched.step()
    assert all(len(r.output_ids) == 40 for r in reqs)
    eng.model_runner.token_allocator.check_all_free()
