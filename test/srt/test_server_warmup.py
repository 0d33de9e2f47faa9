"""The server warm-up (managers/server_warmup.py): its prompts cover every launch variant the kernel wrappers pick for
a prefill chunk (checked against aot_check's recorder), and it runs them through the scheduler before the engine is
ready, leaving the pools and the prefix cache empty and later outputs unchanged."""

from __future__ import annotations

import math

import pytest
import torch

from oracle import engine, random_ids
from sglang.srt.environ import envs
from sglang.srt.managers.server_warmup import WarmupShapes, plan_warmup, prefill_signature
from sglang.srt.model_executor.model_runner import ModelRunner

FLASH = WarmupShapes(hidden=4096, heads=64, experts=256, top_k=6, num_sms=132)  # aot_plan's Flash on an H100


def _shape_keys(rows: int) -> set:
    """The compiled code shapes (constexprs, launch options) of a Flash prefill chunk of `rows` rows on sm90."""
    from sgl_kernel import aot_plan
    from sgl_kernel.aot_check import recording
    from sgl_kernel.aot_targets import TARGETS

    target = TARGETS["sm90"]
    with recording(target) as rec:
        for label, case in aot_plan.prefill_cases(aot_plan.MODELS[0], rows, torch.bfloat16, target):
            rec.label = label
            case()
    return {launch.shape_key() for launch in rec.launches.values()}


def test_plan_prefills_a_row_count_of_every_launch_variant():
    """Row counts either side of the wrappers' thresholds (the MoE align's sort width, attention's key splits, the
    mixes' grid, the MoE tiles) compile exactly what the plan's prompt for their variant compiles."""
    plan = plan_warmup(FLASH, 8192, 10**6)
    assert 8192 in plan.prompt_lens and 1 in plan.prompt_lens and 16384 in plan.prompt_lens  # two chunks
    for rows in (11, 43, 66, 171, 700, 2100, 6000):
        sig = prefill_signature(rows, FLASH)
        planned = min(n for n in plan.prompt_lens if n >= rows and prefill_signature(n, FLASH) == sig)
        assert _shape_keys(rows) == _shape_keys(planned), (rows, planned)


def test_plan_keeps_to_the_prompt_limit():
    plan = plan_warmup(FLASH, 512, 300)
    assert max(plan.prompt_lens) <= 300 and 1 in plan.prompt_lens and 16384 not in plan.prompt_lens


@pytest.fixture
def forwards(monkeypatch):
    """Counts the model forwards run (extend batches: the warm-up's prefills)."""
    calls = []
    forward = ModelRunner.forward
    monkeypatch.setattr(ModelRunner, "forward", lambda self, batch: calls.append(1) or forward(
        self, batch))
    return calls


def test_warmup_runs_its_plan_before_the_engine_is_ready(forwards):
    args = dict(chunked_prefill_size=32, max_total_tokens=2048)
    with envs.SGLANG_SERVER_WARMUP_ON_CPU.override(1):
        skipped = engine("tiny", skip_server_warmup=True, **args)
        assert forwards == [] and skipped.warmup is None
        warm = engine("tiny", **args)
    lens = warm.warmup.prompt_lens
    assert len(forwards) == warm.warmup.forwards == sum(math.ceil(n / 32) for n in lens) > 0
    assert 64 in lens  # two chunks: the second after a prefix
    allocator = warm.model_runner.token_allocator
    allocator.check_all_free()
    assert allocator.cache.num_pages == 0 and allocator.cache.queried_tokens == 0
    assert warm.scheduler.num_generated_tokens == 0
    params = {"temperature": 0, "max_new_tokens": 4, "ignore_eos": True}
    ids = [random_ids(40, 7), random_ids(5, 8)]
    assert ([o["output_ids"] for o in warm.generate(input_ids=ids, sampling_params=params)]
            == [o["output_ids"] for o in skipped.generate(input_ids=ids, sampling_params=params)])
    for eng in (warm, skipped):
        eng.shutdown()
