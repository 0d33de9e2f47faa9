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


@pytest.mark.parametrize("width", [48, 42])  # 42: rows of 168 bytes in fp32, not whole 16-byte units
def test_odd_width_loads_at_tp1_and_matches_hf(monkeypatch, caplog, width):
    """The start-up log names the path: torch's grouped GEMM at 48, the CPU's per-expert loop at 42."""
    name = f"moe{width}"
    monkeypatch.setitem(oracle.ORACLE_CONFIGS, name, {**TINY, "moe_intermediate_size": width})
    monkeypatch.setitem(oracle.PAGE_SIZES, name, 16)
    if width * 4 % 16:  # HF's grouped GEMM refuses such rows as torch's does: its per-expert loop instead
        oracle.hf_model(name, False).config._experts_implementation = "eager"  # the key hf_reference uses
    ref = hf_reference(name, tuple(random_ids(37, seed=3)), 12)
    with caplog.at_level(logging.INFO, logger="sglang.srt.layers.moe.experts"):
        eng = engine(name, chunked_prefill_size=-1)
    path = "torch grouped GEMM" if width == 48 else "a per-expert loop over the rows sorted by expert"
    assert f"MoE: routed experts fp32 via {path}" in caplog.text, caplog.text
    assert eng.model_runner.model.layers[0].ffn.experts.w1.shape[1] == width
    assert_matches_hf(greedy_run(eng, ref[0], 12), ref)
    eng.model_runner.token_allocator.check_all_free()


@pytest.mark.parametrize("width,dtype", [(6, torch.float32), (12, torch.bfloat16), (8, torch.bfloat16)])
def test_routed_experts_of_unaligned_widths_run(width, dtype):
    """torch's grouped GEMM refuses rows that are not whole 16-byte units ('strides should be multiple of 16 bytes',
    on CPU and on an H100 alike): such widths run the per-expert loop on the CPU and the fused Triton MoE on a GPU
    (simulated: the Triton interpreter), with the grouped path's result on the weights zero-padded to a width it
    takes."""
    from sglang.srt.layers.moe.dispatch import FUSED, GROUPED, LOOP, moe_device, routed_path
    from sglang.srt.layers.moe.experts import RoutedExperts
    from sglang.srt.platform import simulate_platform

    g = torch.Generator().manual_seed(0)
    experts = RoutedExperts(8, 40, width, 10.0).to(dtype)
    for p in experts.parameters():
        p.data = (torch.randn(p.shape, generator=g) * 0.05).to(dtype)
    x = torch.randn(9, 40, generator=g).to(dtype)
    ids = torch.randint(0, 8, (9, 2), generator=g)
    weights = torch.rand(9, 2, generator=g)
    wide = RoutedExperts(8, 40, 16, 10.0).to(dtype)  # zero-padded to 16 rows of 32 bytes: the grouped GEMM takes it
    with torch.no_grad():
        for name, dim in (("w1", 1), ("w3", 1), ("w2", 2)):
            pad = [0, 0, 0, 16 - width] if dim == 1 else [0, 16 - width]
            getattr(wide, name).copy_(torch.nn.functional.pad(getattr(experts, name), pad))
        want = wide._forward_grouped(x, ids, weights).float()
        tol = 1e-2 if dtype == torch.bfloat16 else 1e-6
        whole = width * x.element_size() % 16 == 0  # 8 in bf16: one 16-byte unit
        assert routed_path(moe_device(x), dtype, 40, width).kernel == (GROUPED if whole else LOOP)
        assert torch.allclose(experts(x, ids, weights).float(), want, atol=tol)
        with simulate_platform("cuda"):  # Hopper: grouped for bf16 only
            assert routed_path(moe_device(x), dtype, 40, width).kernel == (
                GROUPED if whole and dtype == torch.bfloat16 else FUSED)
            assert torch.allclose(experts(x, ids, weights).float(), want, atol=tol)


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
