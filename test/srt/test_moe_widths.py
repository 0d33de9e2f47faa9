"""MoE intermediate widths that are not multiples of 32: a layout is refused only for what it splits. One rank holds
whole experts of any width (48 loads and matches HF); over ranks each part must be whole (the error names the field
and the layout); quantized experts stay packed only where each rank's part is whole scale blocks, else they are
dequantized at load (a packed-MXFP4 checkpoint's own widths are the loader's format check)."""

from __future__ import annotations

import logging
from types import SimpleNamespace

import pytest
import torch

import oracle
from oracle import TINY, assert_matches_hf, engine, greedy_run, hf_reference, random_ids


def test_width_48_loads_at_tp1_and_matches_hf(monkeypatch):
    monkeypatch.setitem(oracle.ORACLE_CONFIGS, "moe48", {**TINY, "moe_intermediate_size": 48})
    monkeypatch.setitem(oracle.PAGE_SIZES, "moe48", 16)
    ref = hf_reference("moe48", tuple(random_ids(37, seed=3)), 12)
    eng = engine("moe48", chunked_prefill_size=-1)
    assert eng.model_runner.model.layers[0].ffn.experts.w1.shape[1] == 48
    assert_matches_hf(greedy_run(eng, ref[0], 12), ref)
    eng.model_runner.token_allocator.check_all_free()


@pytest.mark.parametrize("width,layout", [
    (48, dict()), (48, dict(tp=2)), (48, dict(tp=2, ep=2)), (48, dict(tp=4, dp=2, dp_attention=True)),
    (36, dict(tp=4, ep=4, dp=4, dp_attention=True)), (40, dict(tp=2))])
def test_layouts_that_split_the_width_into_whole_parts(width, layout):
    from sglang.srt.configs.deepseek_v4 import DeepseekV4Config
    from sglang.srt.distributed.sharding import ParallelConfig

    ParallelConfig(**layout).validate(DeepseekV4Config.from_dict({**TINY, "moe_intermediate_size": width}))


@pytest.mark.parametrize("width,layout,message", [
    (48, dict(tp=5, dp=5, dp_attention=True),
     "moe_intermediate_size 48 does not split over --tp 5 ranks (each holds 1/5 of the shared expert's intermediate "
     "width and 1/5 of every routed expert's)"),
    (50, dict(tp=4, ep=4, dp=2, dp_attention=True),
     "moe_intermediate_size 50 does not split over --tp 4 ranks (each holds 1/4 of the shared expert's intermediate "
     "width)"),
])
def test_layouts_that_cannot_split_the_width_are_refused(width, layout, message):
    from sglang.srt.configs.deepseek_v4 import DeepseekV4Config
    from sglang.srt.distributed.sharding import ParallelConfig

    with pytest.raises(ValueError) as e:
        ParallelConfig(**layout).validate(DeepseekV4Config.from_dict({**TINY, "moe_intermediate_size": width}))
    assert str(e.value) == message


@pytest.mark.parametrize("experts,width,layout,kept", [
    ("fp4", 96, dict(tp=2), None),  # 48 per rank: not whole blocks of 32
    ("fp4", 96, dict(tp=2, ep=2), "fp4"),  # whole experts per rank
    ("fp4", 128, dict(tp=2), "fp4"),
    ("fp8", 384, dict(tp=2), None),  # 192 per rank: 3 block rows of multipliers do not split over 2 ranks
    ("fp8", 192, dict(tp=2), None),  # 96 per rank: rank 1's rows 96-127 would take block 1's multipliers, not 0's
    ("fp8", 256, dict(tp=2), "fp8"),
    ("fp8", 384, dict(), "fp8"),  # one rank: a partial last block is the checkpoint's own
])
def test_quantized_experts_stay_packed_only_in_whole_blocks(caplog, experts, width, layout, kept):
    """The formats the engine keeps on an NVIDIA GPU (model_builder.kept_formats, which the planner calls too)."""
    from sglang.check_capacity import hub_plans
    from sglang.srt.configs.deepseek_v4 import DeepseekV4Config
    from sglang.srt.distributed.sharding import ParallelConfig
    from sglang.srt.model_loader.model_builder import kept_formats
    from sglang.srt.platform import simulate_platform

    config = DeepseekV4Config.from_dict({**TINY, "moe_intermediate_size": width})
    plans = {"main": hub_plans(config, "main", experts)}
    with simulate_platform("cuda"), caplog.at_level(logging.WARNING):
        _, got = kept_formats(SimpleNamespace(quantization="fp8"), plans, config, torch.device("cuda"),
                              ParallelConfig(**layout))
    assert got == kept
    said = f"routed experts stored {experts.upper()} are dequantized at load: moe_intermediate_size {width}"
    assert (said in caplog.text) == (kept is None), caplog.text


def test_packed_mxfp4_widths_are_the_format_checks():
    """A packed-MXFP4 checkpoint holds its codes in blocks of 32 inputs: a width that is not is refused by the loader's
    format check, naming the tensor, before any layout is considered."""
    from sglang.srt.configs.deepseek_v4 import DeepseekV4Config
    from sglang.srt.model_loader.loader import CheckpointError, plan_checkpoint

    path = oracle.checkpoint("tiny", quantize=True)  # routed experts packed MXFP4
    with pytest.raises(CheckpointError, match=r"tensor 'layers\.0\.ffn\.experts\.0\.w2\.weight' is packed FP4 but its "
                                              r"input dim 48 is not a multiple of 32"):
        plan_checkpoint(path, DeepseekV4Config.from_dict({**TINY, "moe_intermediate_size": 48}), "main")
