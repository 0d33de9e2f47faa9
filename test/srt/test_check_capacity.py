"""The capacity planner (python -m sglang.check_capacity) and the sharding rules it counts with: on CPU the planner's
pool plan and weight bytes equal what the engine allocates for the same arguments (with and without the MTP draft);
per-rank weights shrink as the rules say under TP / EP / DP-attention; layouts that do not divide are refused
naming the sizes; the CLI takes launch recipes verbatim, resolves their defaults as the server does and the hub ids
offline, and answers fits / does not fit for the real Flash and Pro configs."""

from __future__ import annotations

import math
import re

import pytest
import torch

from oracle import TINY, checkpoint, engine


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
    assert report.fits and "fits: 0.0 GB weights/GPU, KV pool 6,144 tokens" in report.format()


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
    assert out.startswith("flash on 4 x H200 GPUs, TP4") and "GB = 10^9 bytes" in out, out
    assert "H200: 143,771 MiB = 150.8 GB" in out and "max running requests 256" in out
    assert out.splitlines()[-1].startswith("fits: 40.0 GB weights/GPU, KV pool 7,348,480 tokens"), out
    assert main(["flash"]) == 1  # 156 GB of weights on one H200
    assert "does not fit: weights 156.0 GB/GPU leave no room for the KV pools" in capsys.readouterr().out
    assert main(["flash", "--tp", "8", "--ep", "8", "--dp", "8", "--enable-dp-attention", "--gpu", "b200"]) == 0
    out = capsys.readouterr().out
    assert "DP-attention 8" in out and "KV pool 8 x " in out.splitlines()[-1]
    assert main(["flash", "--tp", "3"]) == 2 and "attention heads do not split" in capsys.readouterr().err


RECIPE = ["--model-path", "deepseek-ai/DeepSeek-V4-Flash", "--tp", "4", "--kv-cache-dtype", "fp8_e4m3",
          "--speculative-algorithm", "EAGLE", "--speculative-num-steps", "3", "--speculative-eagle-topk", "1",
          "--speculative-num-draft-tokens", "4"]
SUMMARY = re.compile(r"fits: \d+\.\d GB weights/GPU, KV pool [\d,]+ tokens, max context [\d,]+, [\d,]+ requests? of "
                     r"128K tokens at once\n")


def test_launch_recipe_verbatim(capsys):
    """A launch command's flags, verbatim: the ones the plan does not depend on change nothing, the ones it does mean
    what they mean to the server (the MTP draft layer and its rows, --moe-a2a-backend's EP), and what the server
    refuses is refused naming the flag (exit 2)."""
    from sglang.check_capacity import main

    assert main([*RECIPE, "--gpu", "h200", "--summary"]) == 0
    line = capsys.readouterr().out
    assert SUMMARY.fullmatch(line), line
    inert = ["--host", "0.0.0.0", "--port", "8000", "--reasoning-parser", "deepseek-v4", "--tool-call-parser",
             "deepseekv4", "--moe-runner-backend", "flashinfer_mxfp4", "--trust-remote-code", "--cuda-graph-max-bs",
             "64", "--attention-backend", "triton", "--device", "cpu", "--log-level", "warning"]
    assert main([*RECIPE, *inert, "--summary"]) == 0 and capsys.readouterr().out == line
    assert main(["flash", "--tp", "4", "--kv-cache-dtype", "fp8_e4m3", "--summary"]) == 0
    no_mtp = capsys.readouterr().out
    weights = lambda s: float(s.split()[1])  # noqa: E731
    assert weights(line) > weights(no_mtp)  # the MTP layer's weights
    assert main(RECIPE) == 0
    assert "MTP draft 4 tokens" in capsys.readouterr().out
    assert main(["pro", "--tp", "8", "--moe-a2a-backend", "deepep"]) in (0, 1)
    assert "TP8 EP8" in capsys.readouterr().out  # the experts over all ranks, as the server does
    assert main(["flash", "--tp", "4", "--speculative-num-steps", "3"]) == 2
    assert "need --speculative-algorithm EAGLE" in capsys.readouterr().err
    assert main([*RECIPE, "--speculative-eagle-topk", "2"]) == 2 and "top-k 1" in capsys.readouterr().err
    assert main(["flash", "--tp", "4", "--context-length", str(2**21)]) == 2
    assert "--context-length 2097152 exceeds" in capsys.readouterr().err
    for bad in (["flash", "--no-such-flag"], ["flash", "--model-path", "deepseek-ai/DeepSeek-V4-Pro"], []):
        with pytest.raises(SystemExit) as e:
            main(bad)
        assert e.value.code == 2, bad


def test_hub_ids_resolve_offline(monkeypatch, capsys):
    """The hub ids (and the FP8 repacks) plan from the built-in configs: nothing fetched, nothing read from disk."""
    import huggingface_hub

    import sglang.srt.model_loader.loader as loader
    import sglang.srt.model_loader.model_path as model_path
    from sglang.check_capacity import main

    def refuse(*args, **kwargs):
        raise AssertionError(f"a hub preset touched the network or the disk: {args}")

    for module, name in ((model_path, "resolve_model_path"), (loader, "plan_checkpoint"),
                         (loader, "detect_quantization"), (huggingface_hub, "snapshot_download")):
        monkeypatch.setattr(module, name, refuse)
    lines = {}
    for model in ("deepseek-ai/DeepSeek-V4-Flash", "sgl-project/DeepSeek-V4-Flash-FP8", "flash",
                  "DEEPSEEK-AI/deepseek-v4-flash"):
        assert main(["--model-path", model, "--tp", "4", "--summary"]) == 0
        lines[model] = capsys.readouterr().out
    assert lines["flash"] == lines["deepseek-ai/DeepSeek-V4-Flash"] == lines["DEEPSEEK-AI/deepseek-v4-flash"]
    gb = lambda s: float(s.split()[1])  # noqa: E731
    assert gb(lines["sgl-project/DeepSeek-V4-Flash-FP8"]) > gb(lines["flash"])  # FP8 experts: twice MXFP4's bytes
    assert main(["deepseek-ai/DeepSeek-V4-Pro", "--tp", "8", "--kv-cache-dtype", "fp8_e4m3"]) == 0
    assert "routed experts kept MXFP4" in capsys.readouterr().out
    assert main(["sgl-project/DeepSeek-V4-Pro-FP8", "--tp", "8", "--gpu", "b200"]) in (0, 1)
    assert "routed experts kept FP8" in capsys.readouterr().out


def test_help_has_every_flag_and_the_units():
    from sglang.check_capacity import build_parser

    ap = build_parser()
    missing = [a.option_strings or a.dest for a in ap._actions if not (a.help or "").strip()]
    assert not missing, missing
    text = " ".join(ap.format_help().split())
    for part in ("GB = 10^9 bytes", "H200: 143,771 MiB = 150.8 GB", "\"141 GB\"", "140.4 GiB", "B200: 180.0 GB",
                 "MI355X: 288.0 GB", "--speculative-num-draft-tokens", "--summary", "Exit status: 0 fits"):
        assert part in text, part


@pytest.mark.parametrize("platform", ["cuda", "hip"])
@pytest.mark.parametrize("kwargs", [
    {}, {"speculative_algorithm": "EAGLE"}, {"speculative_algorithm": "NEXTN", "speculative_num_steps": 2},
    {"tp_size": 2, "ep_size": 2, "kv_cache_dtype": "fp8_e4m3", "enable_deepseek_v4_fp4_indexer": True},
    {"tp_size": 2, "dp_size": 2, "enable_dp_attention": True, "speculative_algorithm": "EAGLE"},
    {"tp_size": 2, "moe_a2a_backend": "deepep", "cuda_graph_max_bs_decode": 64, "max_running_requests": 32},
    {"quantization": "mxfp4", "page_size": 128, "context_length": 512, "mem_fraction_static": 0.7},
    {"quantization": "none", "disable_cuda_graph": True, "enforce_shared_experts_fusion": True},
    {"speculative_num_steps": 3}, {"speculative_algorithm": "EAGLE", "speculative_eagle_topk": 2},
    {"context_length": 4096}, {"page_size": 24}, {"tp_size": 3}, {"mem_fraction_static": 1.5},
])
def test_preset_resolution_equals_the_servers(platform, kwargs):
    """Presets have no directory, so check_capacity gives the server's resolve_server_args their config and stored
    formats; for a checkpoint directory that gives what reading the directory gives (every field, the defaults it
    reports, the platform decisions), or refuses with the same message."""
    import dataclasses

    from sglang.srt.arg_groups.deepseek_v4_hook import resolve_server_args
    from sglang.srt.model_loader.loader import detect_quantization, load_config
    from sglang.srt.platform import simulate_platform
    from sglang.srt.server_args import ServerArgs

    path = checkpoint("tiny", quantize=True)
    config = load_config(path)

    def resolved(fn) -> tuple:
        args = ServerArgs(model_path=path, device="cuda", log_level="warning", **kwargs)
        try:
            with simulate_platform(platform, gfx="gfx950" if platform == "hip" else None):
                fn(args)
        except ValueError as e:
            return ("refused", str(e))
        return dataclasses.asdict(args), args.applied_defaults, args.platform_decisions, args.recipe_notes

    server = resolved(resolve_server_args)
    assert resolved(lambda a: resolve_server_args(a, (config, detect_quantization(path, config)))) == server


def test_hub_plans_match_the_loaders_plan():
    """The hub formats the presets are planned with are what the loader plans for a hub-quantized checkpoint: the same
    tensors, formats and stored shapes (weights and scales)."""
    from sglang.check_capacity import hub_plans
    from sglang.srt.model_loader.loader import load_config, plan_checkpoint

    path = checkpoint("tiny", quantize=True)
    config = load_config(path)

    def shapes(plans: list) -> dict:
        return {p.name: (p.fmt, p.weight.shape, p.scale.shape if p.scale else None) for p in plans}

    for part in ("main", "mtp"):
        assert shapes(hub_plans(config, part, "fp4")) == shapes(plan_checkpoint(path, config, part))


def test_odd_moe_widths_plan_as_they_load(tmp_path, capsys):
    """The planner refuses exactly the layouts the server refuses (the same ParallelConfig.validate): a width of 48
    plans at --tp 1 and over two ranks; over five it is refused naming the field and the layout."""
    from sglang.check_capacity import main
    from sglang.srt.model_loader.tiny_checkpoint import make_tiny_checkpoint

    path = make_tiny_checkpoint(str(tmp_path / "moe48"), {**TINY, "moe_intermediate_size": 48}, dtype="float32")
    assert main([path, "--summary"]) == 0 and main([path, "--tp", "2", "--summary"]) == 0
    capsys.readouterr()
    assert main([path, "--tp", "5", "--dp", "5", "--enable-dp-attention"]) == 2
    assert "moe_intermediate_size 48 does not split over --tp 5 ranks" in capsys.readouterr().err


def test_cli_checkpoint_directory(capsys):
    """A checkpoint directory: its stored formats detected (kept quantized: the plan is a GPU's), TP2 x EP2."""
    from oracle import checkpoint
    from sglang.check_capacity import main

    assert main([checkpoint("tiny", quantize=True), "--tp", "2", "--ep", "2"]) == 0
    out = capsys.readouterr().out
    assert "TP2" in out and "fits" in out, out
