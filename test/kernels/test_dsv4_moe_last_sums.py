"""MoeConfig.last_sums: the parity planes' decode chain without its two reduction launches; each gate-up tile's last
K split adds the splits and applies the SwiGLU, each down output tile's last program adds every token's k rows
(arrival counters, dsv4_moe_sums.arrive). The sums are the separate launches' in the same order, so the output must
equal theirs bit for bit, and the counters must be back at zero after every launch (a graph replays them)."""

from __future__ import annotations

import dataclasses

import pytest
import torch
import triton
import triton.language as tl

from sgl_kernel.dsv4_moe_mxfp4 import MoeConfig, MoeLaunch, dsv4_moe_mxfp4, moe_config
from sgl_kernel.dsv4_moe_sums import arrival_counters, arrive
from test_dsv4_moe_mxfp4 import _experts, _routing

needs_cuda = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")


@triton.jit
def _arrivals_kernel(cnt_ptr, last_ptr):
    if arrive(cnt_ptr, tl.num_programs(0)):
        tl.store(last_ptr + tl.program_id(0), 1)


def test_exactly_one_last_arriver_and_the_counter_reset():
    counter = torch.zeros(1, dtype=torch.int32)
    for programs in (1, 5, 17):
        last = torch.zeros(programs, dtype=torch.int32)
        _arrivals_kernel[(programs,)](counter, last)
        assert int(last.sum()) == 1 and int(counter) == 0


def _planes(n, k, splits):
    return MoeLaunch(n, k, 4, 3, scaled_dot=False, split_k=splits, planes=True)


E, D, I, K = 8, 512, 256, 2


@pytest.mark.parametrize("tokens", [1, 3, 6])
@pytest.mark.parametrize("splits", [(4, 2), (2, 1), (1, 1)], ids=["split", "gate_up_split", "unsplit"])
@pytest.mark.parametrize("other_rank", [False, True], ids=["all_local", "other_rank"])
def test_last_sums_equal_the_reduction_launches(tokens, splits, other_rank):
    w13, s13, w2, s2 = _experts(E, D, I, seed=0)
    ids, weights = _routing(tokens, K, E, 1, False)
    if other_rank:  # another rank's experts: -1 pairs, their blocks write zeros and still arrive
        ids[0, 0] = -1
    x = torch.randn(tokens, D, generator=torch.Generator().manual_seed(2)) * 0.1
    cfg = MoeConfig(16, _planes(128, 128, splits[0]), _planes(128, 128, splits[1]))
    plain = dsv4_moe_mxfp4(x, ids, weights, w13, s13, w2, s2, 10.0, config=cfg)
    last = dsv4_moe_mxfp4(x, ids, weights, w13, s13, w2, s2, 10.0, config=dataclasses.replace(cfg, last_sums=True))
    assert plain.abs().max() > 0 and torch.equal(last, plain)
    assert not arrival_counters(x.device).any()


def test_last_sums_refuse_more_tiles_than_counters():
    w13, s13, w2, s2 = _experts(E, D, I, seed=0)
    ids, weights = _routing(4, K, E, 1, False)
    cfg = MoeConfig(16, _planes(128, 128, 2), _planes(128, 128, 1), last_sums=True)
    x = torch.zeros(4, D)
    from sgl_kernel import dsv4_moe_planes

    with pytest.MonkeyPatch.context() as mp:
        mp.setattr(dsv4_moe_planes, "GATE_UP_COUNTERS", 2)  # the down's 4 output tiles no longer fit
        with pytest.raises(ValueError, match="arrival counters"):
            dsv4_moe_mxfp4(x, ids, weights, w13, s13, w2, s2, 10.0, config=cfg)


_PTX = r"""
import json
import triton
from triton.backends.compiler import GPUTarget
from sgl_kernel import dsv4_moe_planes as planes

types = {"x_ptr": "*bf16", "h_ptr": "*fp32", "rows_ptr": "*i64", "bexp_ptr": "*i64", "w_ptr": "*u8", "s_ptr": "*u8",
         "wts_ptr": "*fp32", "out_ptr": "*fp32", "limit": "fp32", "sum_ptr": "*bf16", "cnt_ptr": "*i32"}
out = {}
for name, kernel, splits, k in (("gate_up", planes._planes_gate_up_kernel, 4, 128),
                                ("down", planes._planes_down_kernel, 2, 256)):
    kt = dict(types, h_ptr="*bf16") if name == "down" else types
    consts = {"BLOCK_M": 16, "BLOCK_N": 128, "BLOCK_K": k, "PREC": "tf32", "SCALE_CHUNKED": True, "SWAP": False,
              "PTX": True, "SPLITS": splits, "LAST_SUMS": True, "PDL": True}
    sig = {a: "constexpr" if a in consts else kt.get(a, "i32") for a in kernel.arg_names}
    src = triton.compiler.ASTSource(fn=kernel, signature=sig,
                                    constexprs={(kernel.arg_names.index(a),): v for a, v in consts.items()})
    ptx = triton.compile(src, target=GPUTarget("cuda", 90, 32), options={"num_warps": 4, "num_stages": 3}).asm["ptx"]
    lines = [ln.strip() for ln in ptx.splitlines()]
    atoms = [i for i, ln in enumerate(lines) if "atom." in ln]
    out[name] = {"atoms": [lines[i] for i in atoms],
                 "barrier_before": [any("bar.sync" in ln or "barrier.sync" in ln for ln in lines[max(0, i - 12):i])
                                    for i in atoms],
                 "cg_loads": sum("ld.global.cg" in ln for ln in lines)}
print(json.dumps(out))
"""


def test_last_arrivers_compile_to_a_fenced_atomic_and_l2_reads():
    """Compiled for sm90 on the CPU (a subprocess: this one may run the interpreter): one release-acquire atomic at
    GPU scope per program, behind a CTA barrier (every thread's stores first), and the partial sums read from L2."""
    from sm90_compile import compiled_facts

    facts = compiled_facts(_PTX, timeout=600)
    for name in ("gate_up", "down"):
        assert len(facts[name]["atoms"]) == 1, facts[name]
        assert "gpu.acq_rel.add" in facts[name]["atoms"][0] and facts[name]["barrier_before"] == [True], facts[name]
        assert facts[name]["cg_loads"] >= 2, facts[name]


@pytest.mark.gpu
@needs_cuda
@pytest.mark.parametrize("tokens", [1, 2, 4, 8, 32])
def test_gpu_last_sums_bit_equal_in_graph_replays(tokens):
    """Flash widths, bf16, moe_config's planes launches with K splits in both kernels (4 / 2; the tier's own as well):
    last_sums (eager, and replayed from a CUDA graph with new activations, routes and weights each time) equal the
    separate reductions bit for bit, and the counters are zero after."""
    from graph_replays import assert_replays_equal

    device = torch.device("cuda")
    w13, s13, w2, s2 = _experts(256, 4096, 2048, seed=0, device="cuda")
    tier = moe_config(tokens * 6, 256, planes=True)
    split = MoeConfig(16, dataclasses.replace(tier.gate_up, split_k=4), dataclasses.replace(tier.down, split_k=2))

    def inputs(seed):
        ids, weights = _routing(tokens, 6, 256, seed=seed, skew=False, device="cuda")
        x = (torch.randn(tokens, 4096, device="cuda", generator=torch.Generator("cuda").manual_seed(seed))
             * 0.05).bfloat16()
        return x, ids, weights

    x, ids, weights = inputs(1)
    for cfg in (dataclasses.replace(tier, last_sums=False), split):
        run = lambda c: dsv4_moe_mxfp4(x, ids, weights, w13, s13, w2, s2, 10.0, config=c,  # noqa: E731
                                       scales_fit_planes=True)
        fused = dataclasses.replace(cfg, last_sums=True)
        assert torch.equal(run(fused), run(cfg))
        assert_replays_equal(lambda: run(fused), lambda: run(cfg), (x, ids, weights), inputs, range(2, 8))
        assert not arrival_counters(device).any()
