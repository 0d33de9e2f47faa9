"""The server warm-up (managers/server_warmup.py): its prompts cover every launch variant the kernel wrappers pick for
a prefill chunk (checked against aot_check's recorder), and it runs them through the scheduler before the engine is
ready, leaving the pools and the prefix cache empty and later outputs unchanged."""

from __future__ import annotations

import json
import math
import os
import subprocess
import sys

import pytest
import triton.language as tl

from oracle import engine, random_ids
from sglang.srt.environ import envs
from sglang.srt.managers.server_warmup import WarmupShapes, plan_warmup, prefill_signature, run_server_warmup
from sglang.srt.model_executor.model_runner import ModelRunner

# aot_plan's Flash on an H100: bf16 compute and KV cache
FLASH = WarmupShapes(hidden=4096, heads=64, experts=256, top_k=6, num_sms=132, attn_dot=tl.bfloat16)


_SHAPE_KEYS = """
import json, sys, torch
from sgl_kernel import aot_plan
from sgl_kernel.aot_check import recording
from sgl_kernel.aot_targets import TARGETS
out = {}
for rows in json.loads(sys.argv[1]):
    with recording(TARGETS["sm90"]) as rec:
        for label, case in aot_plan.prefill_cases(aot_plan.MODELS[0], rows, torch.bfloat16, TARGETS["sm90"]):
            rec.label = label
            case()
    out[rows] = sorted(repr(launch.shape_key()) for launch in rec.launches.values())
print(json.dumps(out))
"""


def _shape_keys(rows: list) -> dict:
    """rows -> the compiled code shapes (constexprs, launch options) of a Flash prefill chunk of that many rows on
    sm90, recorded as aot_check records them: in a process without Triton's interpreter (the kernels here were
    defined under it)."""
    env = {k: v for k, v in os.environ.items() if k != "TRITON_INTERPRET"}
    done = subprocess.run([sys.executable, "-c", _SHAPE_KEYS, json.dumps(rows)], env=env, capture_output=True,
                          text=True, timeout=300)
    assert done.returncode == 0, done.stderr[-3000:]
    return {int(k): v for k, v in json.loads(done.stdout.strip().splitlines()[-1]).items()}


def test_plan_prefills_a_row_count_of_every_launch_variant():
    """Row counts either side of the wrappers' thresholds (the MoE align's sort width, attention's key splits, the
    mixes' grid, the MoE tiles) compile exactly what the plan's prompt for their variant compiles."""
    plan = plan_warmup(FLASH, 8192, 10**6)
    assert 8192 in plan.prompt_lens and 1 in plan.prompt_lens and 16384 in plan.prompt_lens  # two chunks
    pairs = []
    for rows in (11, 43, 66, 171, 700, 2100, 6000):
        sig = prefill_signature(rows, FLASH)
        pairs.append((rows, min(n for n in plan.prompt_lens if n >= rows and prefill_signature(n, FLASH) == sig)))
    keys = _shape_keys(sorted({n for pair in pairs for n in pair}))
    for rows, planned in pairs:
        assert keys[rows] == keys[planned], (rows, planned)
    assert len({tuple(v) for v in keys.values()}) > 3  # the row counts do pick different variants


def test_plan_keeps_to_the_prompt_limit():
    plan = plan_warmup(FLASH, 512, 300)
    assert max(plan.prompt_lens) <= 300 and 1 in plan.prompt_lens and 16384 not in plan.prompt_lens


def test_shapes_of_a_rank():
    """A rank's attention heads divide by the attention TP size (DP attention keeps every head on a rank), and the
    attention's dots follow the KV cache: 16-bit for a bf16 cache, fp16 for an FP8 cache with bf16 compute."""
    import torch
    from types import SimpleNamespace

    config = SimpleNamespace(hidden_size=4096, num_attention_heads=64, n_routed_experts=256, num_experts_per_tok=6,
                             head_dim=512, qk_rope_head_dim=64)
    cpu = torch.device("cpu")
    tp4 = WarmupShapes.of(config, 4, cpu, torch.bfloat16)
    assert (tp4.heads, tp4.attn_dot) == (16, tl.bfloat16)
    dp = WarmupShapes.of(config, 1, cpu, torch.bfloat16, "fp8_e4m3")
    assert (dp.heads, dp.attn_dot) == (64, tl.float16)
    assert prefill_signature(700, tp4) != prefill_signature(700, dp)  # 16 heads: another attention tiling


@pytest.fixture
def forwards(monkeypatch):
    """Counts the model forwards run (extend batches: the warm-up's prefills)."""
    calls = []
    forward = ModelRunner.forward
    monkeypatch.setattr(ModelRunner, "forward", lambda self, batch: calls.append(1) or forward(
        self, batch))
    return calls


def test_warmup_runs_its_plan_and_leaves_nothing_behind(forwards):
    """The scheduler process runs this before its ready message (the server's test: test_server_retraction)."""
    args = dict(chunked_prefill_size=32, max_total_tokens=2048)
    cold, warm = engine("tiny", **args), engine("tiny", **args)  # the in-process Engine never warms up itself
    assert forwards == []
    with envs.SGLANG_SERVER_WARMUP_ON_CPU.override(1):
        warm.model_runner.server_args.skip_server_warmup = True
        assert run_server_warmup(warm.scheduler) is None and forwards == []
        warm.model_runner.server_args.skip_server_warmup = False
        report = run_server_warmup(warm.scheduler)
    lens = report.prompt_lens
    assert len(forwards) == report.forwards == sum(math.ceil(n / 32) for n in lens) > 0
    assert 64 in lens  # two chunks: the second after a prefix
    allocator = warm.model_runner.token_allocator
    allocator.check_all_free()
    assert allocator.cache.num_pages == 0 and allocator.cache.queried_tokens == 0
    assert warm.scheduler.num_generated_tokens == 0
    params = {"temperature": 0, "max_new_tokens": 4, "ignore_eos": True}
    ids = [random_ids(40, 7), random_ids(5, 8)]
    assert ([o["output_ids"] for o in warm.generate(input_ids=ids, sampling_params=params)]
            == [o["output_ids"] for o in cold.generate(input_ids=ids, sampling_params=params)])
    for eng in (warm, cold):
        eng.shutdown()


@pytest.mark.parametrize("extend_lens", [[1], [3], [4, 5], [2, 7, 1], [1, 1, 1, 1, 1]])
def test_forward_batch_views_start_aligned(extend_lens):
    """Every index array of a packed ForwardBatch starts 16 bytes aligned whatever the row and request counts: Triton
    specialises pointers on it, and the warm-up runs one request a chunk (a mid-buffer row map made every chunk of an
    even request count compile its own attention and indexer variants inside a request). Values are unchanged."""
    import torch

    from sglang.srt.model_executor.forward_batch_info import ForwardBatch, ForwardMode

    total = sum(extend_lens)
    prefix = [5 * b for b in range(len(extend_lens))]
    fb = ForwardBatch.build(ForwardMode.EXTEND, list(range(100, 100 + total)), list(range(len(extend_lens))), prefix,
                            extend_lens, torch.arange(total), torch.device("cpu"),
                            logprob_target_ids=list(range(total)))
    views = [fb.input_ids, fb.positions, fb.req_pool_indices, fb.extend_seq_lens, fb.extend_start_loc, fb.row_req,
             fb.logprob_target_ids]
    assert all(v.data_ptr() % 16 == 0 for v in views), [v.data_ptr() % 16 for v in views]
    assert fb.input_ids.tolist() == list(range(100, 100 + total))
    assert fb.positions.tolist() == [p for s, n in zip(prefix, extend_lens) for p in range(s, s + n)]
    assert fb.row_req.tolist() == [b for b, n in enumerate(extend_lens) for _ in range(n)]
    assert fb.extend_start_loc.tolist() == [sum(extend_lens[:b]) for b in range(len(extend_lens))]
    assert fb.extend_seq_lens.tolist() == extend_lens and fb.logprob_target_ids.tolist() == list(range(total))
