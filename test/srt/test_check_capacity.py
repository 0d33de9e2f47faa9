"""The capacity planner (python -m sglang.check_capacity) and the sharding rules it counts with: on CPU the planner's
pool plan and weight bytes equal what the engine allocates for the same arguments (with and without the MTP draft);
per-rank weights shrink as the rules say under TP / EP / DP-attention; layouts that do not divide are refused
naming the sizes; the CLI answers fits / does not fit for the real Flash and Pro configs."""

from __future__ import annotations

import math

import pytest
import torch

from oracle import checkpoint, engine


@pytest.mark.parametrize("spec,cache", [(False, True), (True, True), (False, False)])
def test_planner_equals_engine_on_cpu(monkeypatch, spec, cache):
    import sglang.srt.model_executor.model_runner as model_runner
    from sglang.check_capacity import per_rank_weight_bytes, plan_capacity
    from sglang.srt.distributed.sharding import ParallelConfig
    from sglang.srt.model_loader.loader import load_config

    free, total = 3 * 2**30, 8 * 2**30
    monkeypatch.setattr(model_runner, "memory_budget_bytes", lambda device: (free, total))
    kw = dict(speculative_algorithm="EAGLE", speculative_num_steps=2) if spec else {}
    eng = engine("tiny", quantize=True, disable_cuda_graph=True, mem_fraction_static=0.01, max_running_requests=6,
                 disable_radix_cache=not cache, **kw)
    runner, args = eng.model_runner, eng.server_args
    path = checkpoint("tiny", quantize=True)
    config = load_config(path)
    weights, stored = per_rank_weight_bytes(path, config, args, ParallelConfig(), torch.device("cpu"))
    assert (weights, stored) == (runner.weight_bytes, runner.checkpoint_bytes)
    report = plan_capacity(config, args, ParallelConfig(), weights, stored, total, free, device_type="cpu",
                           dtype=runner.dtype)
    assert report.plan == runner.pool_plan  # the same shape, tokens, bytes per token and totals
    assert report.plan.shape.num_pages == runner.token_allocator.pages.size
    # staging state as planned: the compressors' rings plus, with the prefix cache, its boundary rows and saved states
    pool = runner.token_to_kv_pool
    states = list(pool.attn_state.values()) + list(pool.index_state.values())
    assert sum(s.nbytes for s in states) == report.plan.state_bytes
    assert report.plan.shape.num_state_slots == (2 * 6 if cache else 0)
    assert report.fits and "max total tokens" in report.format()


def test_sharding_rules_split_weights():
    """The split rules (sharding.shard_shape, which the loader splits checkpoint tensors by) agree with the model each
    rank builds (parallel_state.layout_of_rank, which the planner counts): every parameter of rank 0's bf16 model has
    the shape the rules give the whole model's."""
    from sglang.srt.configs.deepseek_v4 import DeepseekV4Config
    from sglang.srt.configs.hub_configs import FLASH
    from sglang.srt.distributed.parallel_state import layout_of_rank
    from sglang.srt.distributed.sharding import ParallelConfig, shard_shape
    from sglang.srt.model_loader.model_builder import build_meta_model, parameter_bytes
    from sglang.srt.models.deepseek_v4 import DeepseekV4ForCausalLM

    config = DeepseekV4Config.from_dict({**FLASH, "num_hidden_layers": 4, "compress_ratios": [0, 4, 128, 4, 0]})
    model = build_meta_model(DeepseekV4ForCausalLM, config, torch.bfloat16)
    tp1 = parameter_bytes(model)
    tp4, ep4 = ParallelConfig(tp=4), ParallelConfig(tp=4, ep=4)
    dpa = ParallelConfig(tp=4, dp=4, dp_attention=True)
    assert shard_shape("layers.1.attn.wq_b.weight", (32768, 1024), tp4) == (8192, 1024)
    assert shard_shape("layers.1.attn.wo_b.weight", (4096, 8192), tp4) == (4096, 2048)
    assert shard_shape("layers.1.attn.wo_b.weight", (4096, 8192), dpa) == (4096, 8192)  # attention replicated
    assert shard_shape("layers.1.attn.wkv.weight", (512, 4096), tp4) == (512, 4096)  # the shared K=V head
    assert shard_shape("layers.1.attn.indexer.wq_b.weight", (8192, 1024), tp4) == (8192, 1024)
    assert shard_shape("layers.1.ffn.experts.w1", (32, 2048, 4096), tp4) == (32, 512, 4096)  # MoE TP
    assert shard_shape("layers.1.ffn.experts.w2", (32, 4096, 2048), ep4) == (8, 4096, 2048)  # EP
    assert shard_shape("layers.1.ffn.experts.w13_scale", (32, 4096, 128), ep4) == (8, 4096, 128)
    assert shard_shape("embed.weight", (129280, 4096), tp4) == (32320, 4096)
    assert shard_shape("mtp.0.ffn.shared_experts.w2.weight", (4096, 2048), tp4) == (4096, 512)
    whole = {n: tuple(t.shape) for n, t in list(model.named_parameters()) + list(model.named_buffers())}
    per_rank = {}
    for pc in (tp4, ep4, dpa):
        with layout_of_rank(pc):
            rank_model = build_meta_model(DeepseekV4ForCausalLM, config, torch.bfloat16)
        for name, t in list(rank_model.named_parameters()) + list(rank_model.named_buffers()):
            assert tuple(t.shape) == shard_shape(name, whole[name], pc), (name, pc)
        per_rank[pc] = parameter_bytes(rank_model)
    assert all(b < tp1 for b in per_rank.values()) and per_rank[dpa] > per_rank[tp4]
    assert math.isclose(per_rank[tp4], per_rank[ep4], rel_tol=0.01)  # routed experts split either way


@pytest.mark.parametrize("layout", [dict(tp=8), dict(tp=8, ep=8), dict(tp=8, ep=2)])
def test_planner_counts_each_ranks_mxfp4_experts(layout):
    """Kept MXFP4 experts as rank 0 builds them (layout_of_rank): codes and scale bytes are exactly 1/8 of one rank's
    holding all, whatever the split (Pro's 3,072 intermediate over 8 MoE-TP ranks leaves 12 scale groups per row: not
    the 8-group chunks, a row-major layout). The per-tensor rules once counted the chunked 4-D scales whole on every
    rank (Pro TP8 'did not fit')."""
    from sglang.srt.configs.deepseek_v4 import DeepseekV4Config
    from sglang.srt.configs.hub_configs import PRO
    from sglang.srt.distributed.parallel_state import get_parallel_state, layout_of_rank
    from sglang.srt.distributed.sharding import ParallelConfig
    from sglang.srt.model_loader.model_builder import build_meta_model
    from sglang.srt.models.deepseek_v4 import DeepseekV4ForCausalLM

    config = DeepseekV4Config.from_dict({**PRO, "num_hidden_layers": 4, "num_hash_layers": 1,
                                         "compress_ratios": [0, 4, 128, 4, 0]})

    def expert_bytes() -> int:
        model = build_meta_model(DeepseekV4ForCausalLM, config, torch.bfloat16, frozenset(), "fp4")
        return sum(t.numel() * t.element_size() for n, t in model.named_parameters() if ".ffn.experts." in n)

    whole = expert_bytes()
    with layout_of_rank(ParallelConfig(**layout)) as state:
        assert get_parallel_state() is state and state.config.tp == 8
        part = expert_bytes()
    assert get_parallel_state().config.tp == 1  # restored
    assert part * 8 == whole


@pytest.mark.parametrize("pc,message", [
    (dict(tp=3), "attention heads do not split"),
    (dict(tp=4, ep=3), "must divide --tp"),
    (dict(tp=4, dp=2), "needs --enable-dp-attention"),
    (dict(tp=4, ep=4, dp=3, dp_attention=True), "must divide --tp 4"),
    (dict(tp=16), "o_groups 8"),
])
def test_layouts_that_do_not_divide_are_refused(pc, message):
    from sglang.srt.configs.deepseek_v4 import DeepseekV4Config
    from sglang.srt.configs.hub_configs import FLASH
    from sglang.srt.distributed.sharding import ParallelConfig

    with pytest.raises(ValueError, match=message):
        ParallelConfig(**pc).validate(DeepseekV4Config.from_dict(FLASH))


def test_cli_real_configs(capsys):
    from sglang.check_capacity import main

    assert main(["flash", "--tp", "4"]) == 0
    out = capsys.readouterr().out
    assert "flash on 4 x h200 GPUs, TP4" in out and "fits: max total tokens" in out
    assert main(["flash"]) == 1 and "does NOT fit" in capsys.readouterr().out  # 158 GB of weights on one H200
    assert main(["flash", "--tp", "8", "--ep", "8", "--dp", "8", "--enable-dp-attention", "--gpu", "b200"]) == 0
    assert "DP-attention 8" in capsys.readouterr().out
    assert main(["flash", "--tp", "3"]) == 2


def test_cli_checkpoint_directory(capsys):
    """A checkpoint directory: its stored formats detected (kept quantized: the plan is a GPU's), TP2 x EP2."""
    from oracle import checkpoint
    from sglang.check_capacity import main

    assert main([checkpoint("tiny", quantize=True), "--tp", "2", "--ep", "2"]) == 0
    out = capsys.readouterr().out
    assert "TP2" in out and "fits" in out, out
