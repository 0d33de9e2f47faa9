"""Tensor and expert parallelism on CPU (gloo, one process per rank; SGLANG_TEST_DEVICE=cuda: one GPU per rank over
NCCL, for the multi-GPU runs): TP2, EP2 (TP2 x EP2), TP4 and TP4 x EP2 give
prompt logprobs within 1e-5 of the single-rank engine and identical greedy tokens, on the tiny config and on one
with unusual dimensions (a vocabulary no rank count divides: padded LM-head parts), with speculative decoding on and
off, and from a hub-quantized checkpoint; DP attention (eager, MTP, and on the static decode path); the prefix cache
under TP2 x EP2. Also: the sharding rules' refusals, and the per-rank weight bytes equal the planner's count."""

from __future__ import annotations

import functools
import json
import os
import subprocess
import sys
import tempfile

import pytest
import torch

from oracle import CHECKPOINT_ROOT, DEVICE, PAGE_SIZES, TINY, checkpoint, random_ids
from sglang.srt.distributed.sharding import ParallelConfig, RankCoords, rank_tensor
from sglang.srt.model_loader.tiny_checkpoint import make_tiny_checkpoint

# Eight heads in four output groups, a prime vocabulary (509: every rank count pads the last LM-head part).
WIDE = {**TINY, "num_attention_heads": 8, "o_groups": 4, "vocab_size": 509}
# CPU: within 1e-5 of one rank. GPUs (SGLANG_TEST_DEVICE=cuda, NCCL, fp32 with IEEE-precision kernels): the ranks'
# partial sums add in another order than one GPU's GEMMs, so 1e-4 (scripts/gpu_multi.sh runs it on several GPUs).
LOGPROB_TOL = 1e-5 if DEVICE == "cpu" else 1e-4
_WORKER = os.path.join(os.path.dirname(os.path.abspath(__file__)), "tp_worker.py")


def _wide_checkpoint() -> str:
    path = os.path.join(CHECKPOINT_ROOT, "tp-wide")
    if not os.path.exists(os.path.join(path, "config.json")):
        make_tiny_checkpoint(path, WIDE, seed=0, quantize=False, dtype="float32")
    return path


def _engine_kwargs(model_path: str, page_size: int, spec: bool, **parallel) -> dict:
    kwargs = dict(model_path=model_path, device=DEVICE, dtype="float32", page_size=page_size, log_level="warning",
                  max_running_requests=4, max_total_tokens=4096, disable_cuda_graph=True, **parallel)
    if spec:
        kwargs.update(speculative_algorithm="EAGLE", speculative_num_steps=2)
    return kwargs


def _needs_gpus(world: int) -> None:
    """On GPUs each rank needs its own (NCCL refuses two ranks on one device): name what is missing."""
    if DEVICE != "cpu" and torch.cuda.device_count() < world:
        pytest.skip(f"{world} ranks need {world} GPUs, {torch.cuda.device_count()} here")


def _run_ranks(kwargs: dict, prompts: list, new_tokens: int, world: int, logprob_tail: int = 0,
               update_from: str = "") -> list:
    """Start `world` worker processes, wait (bounded), and return each rank's outputs."""
    with tempfile.TemporaryDirectory() as tmp:
        spec = {"init_method": f"file://{tmp}/rendezvous", "engine": kwargs, "prompts": prompts,
                "new_tokens": new_tokens, "out": f"{tmp}/out", "logprob_tail": logprob_tail,
                "update_from": update_from}
        spec_path = f"{tmp}/spec.json"
        with open(spec_path, "w") as f:
            json.dump(spec, f)
        env = {**os.environ, "PYTHONPATH": os.pathsep.join(sys.path)}
        procs = [subprocess.Popen([sys.executable, _WORKER, spec_path, str(r)], env=env, stdout=subprocess.PIPE,
                                  stderr=subprocess.STDOUT, text=True) for r in range(world)]
        logs = []
        try:
            for p in procs:
                logs.append(p.communicate(timeout=600)[0])
        finally:
            for p in procs:
                p.kill()
        for r, (p, log) in enumerate(zip(procs, logs)):
            assert p.returncode == 0, f"rank {r} failed:\n{log[-4000:]}"
        return [json.load(open(f"{tmp}/out.{r}")) for r in range(world)]


def _single_rank(kwargs: dict, prompts: list, new_tokens: int, logprob_tail: int = 0) -> list:
    """The single-rank engine's outputs, computed once per engine arguments and requests (several tests compare other
    rank layouts against the same reference)."""
    return _single_rank_cached(json.dumps([kwargs, prompts, new_tokens, logprob_tail], sort_keys=True))


@functools.lru_cache(maxsize=None)
def _single_rank_cached(key: str) -> list:
    import sglang

    kwargs, prompts, new_tokens, logprob_tail = json.loads(key)

    eng = sglang.Engine(**kwargs)
    sampling = {"temperature": 0, "max_new_tokens": new_tokens, "ignore_eos": True}
    try:
        if logprob_tail:  # as tp_worker.py: one request after another
            return [eng.generate(input_ids=p, return_logprob=True, logprob_start_len=len(p) - logprob_tail,
                                 sampling_params=sampling) for p in prompts]
        return eng.generate(input_ids=prompts, return_logprob=True, logprob_start_len=0, sampling_params=sampling)
    finally:
        eng.shutdown()


def _assert_same(got: list, ref: list) -> None:
    for g, r in zip(got, ref):
        assert g["output_ids"] == r["output_ids"]
        for key in ("input_token_logprobs", "output_token_logprobs"):
            a = [lp for lp, _, _ in g["meta_info"][key] if lp is not None]
            b = [lp for lp, _, _ in r["meta_info"][key] if lp is not None]
            assert len(a) == len(b) and max(abs(x - y) for x, y in zip(a, b)) <= LOGPROB_TOL, key


# EP2 also runs chunked prefill (16-token chunks) and the static decode path (the CPU form of CUDA graphs).
STATIC_CHUNKED = dict(chunked_prefill_size=16, disable_cuda_graph=False)


# Plain TP2 on the tiny config is in tp2-spec (the same shards, the MTP draft besides) and non-speculative pure TP
# decode in wide-tp4.
@pytest.mark.parametrize("config,tp,ep,spec,extra", [
    ("tiny", 2, 2, False, STATIC_CHUNKED),  # EP2: four experts per rank, each whole
    ("tiny", 2, 1, True, {}),  # the MTP draft sharded the same way
    ("wide", 2, 2, True, {}),  # the padded LM head and 4-head ranks where only 2 GPUs are lent
    ("wide", 4, 1, False, {}),
    ("wide", 4, 2, True, {}),  # TP4 x EP2: two experts' halves per rank
], ids=["ep2-static-chunked", "tp2-spec", "wide-tp2-ep2-spec", "wide-tp4", "wide-tp4-ep2-spec"])
def test_ranks_match_single_rank(config, tp, ep, spec, extra):
    _needs_gpus(tp)
    path = checkpoint("tiny") if config == "tiny" else _wide_checkpoint()
    vocab = TINY["vocab_size"] if config == "tiny" else WIDE["vocab_size"]
    prompts = [random_ids(40, seed=1, vocab=vocab), random_ids(23, seed=2, vocab=vocab)]
    ref = _single_rank({**_engine_kwargs(path, PAGE_SIZES["tiny"], spec), **extra}, prompts, 6)
    kwargs = {**_engine_kwargs(path, PAGE_SIZES["tiny"], spec, tp_size=tp, ep_size=ep), **extra}
    outs = _run_ranks(kwargs, prompts, 6, tp)
    planned = _planned_weight_bytes(kwargs)
    for rank_out in outs:
        _assert_same(rank_out["outputs"], ref)
        assert rank_out["weight_bytes"] == planned  # what the capacity planner counts per GPU


def test_weight_updates_under_tensor_and_expert_parallelism():
    """update_weights_from_disk and update_weights_from_tensor on TP2 x EP2 with the MTP draft: each rank loads its
    part (its heads, its experts); outputs equal the single-rank engine's on each checkpoint."""
    _needs_gpus(2)
    other = os.path.join(CHECKPOINT_ROOT, "tp-update-other")
    if not os.path.exists(os.path.join(other, "config.json")):
        make_tiny_checkpoint(other, TINY, seed=1, quantize=False, dtype="float32")
    prompts = [random_ids(40, seed=1), random_ids(23, seed=2)]
    kwargs = _engine_kwargs(checkpoint("tiny"), PAGE_SIZES["tiny"], True)
    ref = _single_rank(kwargs, prompts, 6)
    ref_other = _single_rank({**kwargs, "model_path": other}, prompts, 6)
    assert [o["output_ids"] for o in ref] != [o["output_ids"] for o in ref_other]
    for rank_out in _run_ranks({**kwargs, "tp_size": 2, "ep_size": 2}, prompts, 6, 2, update_from=other):
        _assert_same(rank_out["outputs"], ref)
        _assert_same(rank_out["disk"], ref_other)
        _assert_same(rank_out["tensor"], ref)


def test_prefix_cache_and_quantized_checkpoint_under_tensor_and_expert_parallelism():
    """TP2 x EP2 from a hub-quantized checkpoint (FP8 linears, MXFP4 experts: each rank reads its slices) with the
    prefix cache (on by default), requests one after another sharing a system prompt: the third starts at the end the
    second gave the cache where it left the first one's pages. Every rank's cache makes the same decisions: outputs
    and cached-token counts equal the single-rank engine's."""
    _needs_gpus(2)
    system = random_ids(50, seed=7)
    prompts = [system + random_ids(40, seed=8)] + [system + random_ids(30 + i, seed=20 + i) for i in range(2)]
    kwargs = _engine_kwargs(checkpoint("tiny", quantize=True), PAGE_SIZES["tiny"], False)
    ref = _single_rank(kwargs, prompts, 4, logprob_tail=4)
    assert [o["meta_info"]["cached_tokens"] for o in ref] == [0, 0, 48]
    for rank_out in _run_ranks({**kwargs, "tp_size": 2, "ep_size": 2}, prompts, 4, 2, logprob_tail=4):
        _assert_same(rank_out["outputs"], ref)
        assert [o["meta_info"]["cached_tokens"] for o in rank_out["outputs"]] == [0, 0, 48]


@pytest.mark.parametrize("config,tp,ep,spec,extra", [
    # two DP groups of one attention rank each, the MoE over both ranks; decode on the static path (the CPU form of
    # CUDA graphs): static rounds, or eager ones beside the other group's prefill
    ("tiny", 2, 1, False, {"disable_cuda_graph": False, "expert_distribution_recorder_mode": "stat"}),
    ("tiny", 2, 1, True, {"chunked_prefill_size": 16}),  # MTP (eager): prefill and decode cycles interleave
    ("wide", 4, 2, False, STATIC_CHUNKED),  # two groups of two attention ranks, TP4 x EP2 MoE, chunks, static rounds
    # with batch 1 padded to the 2 attention ranks
], ids=["dp2-static", "dp2-spec-chunked", "wide-dp2-tp4-ep2-static-chunked"])
def test_dp_attention_matches_single_rank(config, tp, ep, spec, extra):
    """Each DP group runs its own requests (of other lengths: the groups run other numbers and kinds of forwards,
    the idle one serving the other's MoE); every request equals the single-rank engine's. On the static decode
    path the groups' decode steps meet in static rounds (2 and 1 requests: both run 2 rows) or, beside the other
    group's prefill chunk, run eagerly."""
    _needs_gpus(tp)
    path = checkpoint("tiny") if config == "tiny" else _wide_checkpoint()
    vocab = TINY["vocab_size"] if config == "tiny" else WIDE["vocab_size"]
    groups = [[random_ids(40, seed=1, vocab=vocab), random_ids(23, seed=2, vocab=vocab)],
              [random_ids(70, seed=3, vocab=vocab)]]
    kwargs = {**_engine_kwargs(path, PAGE_SIZES["tiny"], spec, tp_size=tp, ep_size=ep, dp_size=2,
                               enable_dp_attention=True), **extra}
    outs = _run_ranks(kwargs, groups, 6, tp)
    refs = [_single_rank({**_engine_kwargs(path, PAGE_SIZES["tiny"], spec), **extra}, g, 6) for g in groups]
    planned = _planned_weight_bytes(kwargs)
    for rank, rank_out in enumerate(outs):
        _assert_same(rank_out["outputs"], refs[rank // (tp // 2)])
        assert rank_out["weight_bytes"] == planned
        # static decode steps met in static rounds (each group decodes 6 tokens; the rest ran as ordinary rounds)
        assert (rank_out["static_rounds"] >= 3) == (extra.get("disable_cuda_graph") is False), rank_out["static_rounds"]
        if "expert_counts" in rank_out:  # each rank counts its group's tokens only, padded static rows excluded
            group = groups[rank // (tp // 2)]
            tokens = sum(len(p) + len(o["output_ids"]) - 1 for p, o in zip(group, rank_out["outputs"]))
            per_layer = [sum(row) for row in rank_out["expert_counts"][:TINY["num_hidden_layers"]]]
            assert per_layer == [tokens * TINY["num_experts_per_tok"]] * TINY["num_hidden_layers"], per_layer


def _planned_weight_bytes(kwargs: dict) -> int:
    from sglang.check_capacity import per_rank_weight_bytes
    from sglang.srt.arg_groups.deepseek_v4_hook import resolve_server_args
    from sglang.srt.configs.deepseek_v4 import DeepseekV4Config
    from sglang.srt.server_args import ServerArgs

    args = resolve_server_args(ServerArgs(**{**kwargs, "log_level": "warning"}))
    config = DeepseekV4Config.from_pretrained(kwargs["model_path"])
    return per_rank_weight_bytes(kwargs["model_path"], config, args, args.parallel_config(), torch.device("cpu"))[0]


def test_split_rules_refuse_what_does_not_divide():
    with pytest.raises(ValueError, match="attention heads do not split over 8"):
        ParallelConfig(tp=8).validate(_cfg(TINY))
    with pytest.raises(ValueError, match="o_groups 2"):
        ParallelConfig(tp=4).validate(_cfg({**TINY, "num_attention_heads": 8}))
    with pytest.raises(ValueError, match="--ep 3 must divide --tp 4"):
        ParallelConfig(tp=4, ep=3).validate(_cfg(WIDE))
    with pytest.raises(ValueError, match="does not split over 3 ranks"):
        rank_tensor("layers.0.attn.wq_b.weight", torch.zeros(8, 4), ParallelConfig(tp=3), RankCoords(attn_tp=1), 8)


def test_rank_tensor_parts():
    pc = ParallelConfig(tp=4, ep=2)
    # expert 5 lives on EP rank 1 (experts 4..7) as local expert 1; its w1 rows split over moe_tp = 2
    w1 = torch.arange(8 * 3).view(8, 3)
    name, part = rank_tensor("layers.2.ffn.experts.5.w1.weight", w1, pc, RankCoords(tp=3, attn_tp=3, ep=1, moe_tp=1),
                             8)
    assert name == "layers.2.ffn.experts.1.w1.weight" and torch.equal(part, w1[4:])
    assert rank_tensor("layers.2.ffn.experts.5.w1.weight", w1, pc, RankCoords(ep=0), 8) is None
    # the LM head of 509 rows: 128 per rank, the last part padded with zeros
    head = torch.ones(509, 2)
    _, last = rank_tensor("head.weight", head, pc, RankCoords(tp=3, attn_tp=3), 8)
    assert last.shape == (128, 2) and last[:125].eq(1).all() and last[125:].eq(0).all()


def _cfg(d: dict):
    from sglang.srt.configs.deepseek_v4 import DeepseekV4Config

    return DeepseekV4Config.from_dict(d)


def test_bench_one_batch_over_two_ranks():
    """`bench_one_batch --tp 2` spawns the second rank, both run the batch, rank 0 alone reports."""
    _needs_gpus(2)
    out = subprocess.run([sys.executable, "-m", "sglang.bench_one_batch", "--model-path", "tiny-deepseek-v4",
                          "--device", DEVICE, "--tp", "2", "--batch-size", "2", "--input-len", "16", "--output-len",
                          "4", "--profile-steps", "0"], capture_output=True, text=True, timeout=300,
                         env={**os.environ, "PYTHONPATH": os.pathsep.join(sys.path)})
    assert out.returncode == 0, out.stdout[-2000:] + out.stderr[-4000:]
    rows = [line for line in out.stdout.splitlines() if line.startswith("batch    2 input     16 | prefill")]
    assert len(rows) == 1 and "ranks: tp 2, ep 1" in out.stdout, out.stdout


def test_fp8_linears_cut_through_blocks_are_dequantized():
    """A rank part that is not whole 128 x 128 blocks cannot keep its block multipliers: the tiny wq_b (384 rows =
    3 blocks) stays FP8 on one rank, is dequantized at load under TP2; replicated FP8 linears stay FP8 on every
    rank (on 2 GPUs the loader once refused to split its multipliers)."""
    from sglang.srt.configs.deepseek_v4 import DeepseekV4Config
    from sglang.srt.model_loader.loader import fp8_linear_names, plan_checkpoint

    path = checkpoint("tiny", quantize=True)
    config = DeepseekV4Config.from_pretrained(path)
    plans = plan_checkpoint(path, config, "main")
    one, two = fp8_linear_names(plans, config), fp8_linear_names(plans, config, pc=ParallelConfig(tp=2))
    assert any(".attn.wq_b." in n for n in one) and not any(".attn.wq_b." in n for n in two)
    replicated = {n for n in one if ".attn.wq_a." in n or ".attn.wkv." in n}
    assert replicated and replicated <= two
    # the rule itself: only split dims must be whole blocks (one rank keeps a partial last block, as before TP)
    from sglang.srt.distributed.sharding import splits_whole_blocks

    assert splits_whole_blocks("layers.0.attn.wq_b.weight", (300, 256), ParallelConfig())
    assert not splits_whole_blocks("layers.0.attn.wq_b.weight", (384, 256), ParallelConfig(tp=2))
    assert splits_whole_blocks("layers.0.attn.wq_b.weight", (512, 300), ParallelConfig(tp=2))
    assert not splits_whole_blocks("layers.0.attn.wo_b.weight", (512, 384), ParallelConfig(tp=2))
    assert splits_whole_blocks("layers.0.attn.wq_a.weight", (300, 300), ParallelConfig(tp=4))  # replicated


def test_bench_collectives_dry_run():
    """benchmark/bench_collectives.py over 2 gloo ranks: one row per size, with bus bandwidth (on GPUs also the
    fraction of the peer copy: scripts/gpu_multi.sh)."""
    script = os.path.join(os.path.dirname(_WORKER), "..", "..", "benchmark", "bench_collectives.py")
    out = subprocess.run([sys.executable, script, "--device", "cpu", "--rows", "1", "8", "--iters", "2"],
                         capture_output=True, text=True, timeout=300)
    assert out.returncode == 0, out.stderr[-3000:]
    rows = [line for line in out.stdout.splitlines() if line.startswith("rows ")]
    assert len(rows) == 2 and all("all_reduce" in r and "GB/s bus" in r for r in rows), out.stdout
