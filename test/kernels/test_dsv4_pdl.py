"""Programmatic dependent launch (sgl_kernel.dsv4_pdl) of the decode MoE's kernel chain: where it is used (NVIDIA sm90+
only, never the interpreter or ROCm), what it compiles to, and on the GPU that the chained launches give the unchained
result bit for bit, replayed from a CUDA graph with new inputs each time (a missing wait would read a predecessor's
rows before they are written)."""

from __future__ import annotations

import dataclasses

import pytest
import torch

from sgl_kernel.dsv4_moe import MoeConfig, dsv4_moe_mxfp4, moe_config
from sgl_kernel.dsv4_pdl import pdl_launch, pdl_supported

needs_cuda = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")


def test_pdl_only_on_nvidia_gpus(monkeypatch):
    assert not pdl_supported(torch.device("cpu"))
    assert pdl_launch(False) == {} and pdl_launch(True) == {"launch_pdl": True}
    monkeypatch.setattr(torch.version, "hip", "6.4")  # a ROCm build: never, whatever the device
    assert not pdl_supported(torch.device("cuda", 0))


@pytest.mark.parametrize("capability,expected", [((8, 0), False), ((9, 0), True), ((10, 0), True)])
def test_pdl_from_sm90_on(monkeypatch, capability, expected):
    """A simulated NVIDIA GPU (CUDA build, compiled kernels): PDL from Hopper on, not on Ampere."""
    from sgl_kernel import dsv4_pdl

    monkeypatch.setattr(torch.version, "hip", None)
    monkeypatch.delenv("TRITON_INTERPRET", raising=False)
    monkeypatch.setattr(torch.cuda, "get_device_capability", lambda index=None: capability)
    dsv4_pdl._sm90_or_later.cache_clear()
    try:
        assert pdl_supported(torch.device("cuda", 0)) is expected
        monkeypatch.setenv("SGLANG_DSV4_PDL", "0")  # off for a profile's per-kernel times
        assert pdl_supported(torch.device("cuda", 0)) is False
    finally:
        dsv4_pdl._sm90_or_later.cache_clear()


_PTX = r"""
import json
import triton
from triton.backends.compiler import GPUTarget
from sgl_kernel import dsv4_moe_sums as sums

kernel = sums._combine_kernel
out = {}
for pdl in (False, True):
    consts = {"TOPK": 6, "SPLITS": 1, "BLOCK": 1024, "PDL": pdl, "ADD": False, "BF16_BITS": False}
    sig = {n: "constexpr" if n in consts else {"p_ptr": "*fp32", "add_ptr": "*bf16", "out_ptr": "*bf16"}.get(n, "i32")
           for n in kernel.arg_names}
    src = triton.compiler.ASTSource(fn=kernel, signature=sig,
                                    constexprs={(kernel.arg_names.index(n),): v for n, v in consts.items()})
    ptx = triton.compile(src, target=GPUTarget("cuda", 90, 32), options={"num_warps": 4}).asm["ptx"]
    out[str(pdl)] = [ptx.count("griddepcontrol.wait"), ptx.count("griddepcontrol.launch_dependents")]
print(json.dumps(out))
"""


def test_pdl_compiles_to_griddepcontrol_only_when_asked():
    """Compiled for sm90 on the CPU (a subprocess: this one may run the interpreter): PDL=True waits, then releases
    the next kernel; PDL=False has neither instruction (the default launches are the kernels without PDL)."""
    from sm90_compile import compiled_facts

    counts = compiled_facts(_PTX, timeout=600)
    assert counts["False"] == [0, 0]
    assert counts["True"][0] >= 1 and counts["True"][1] >= 1


@pytest.mark.gpu
@needs_cuda
@pytest.mark.parametrize("splits", [(1, 1), (4, 2)], ids=["unsplit", "split"])
@pytest.mark.parametrize("tokens", [1, 4, 8, 32])  # moe_config's three decode tiers
def test_gpu_pdl_chain_bit_equal_in_graph_replays(tokens, splits):
    """Flash widths, bf16, the parity planes' decode chain: PDL launches (eager and replayed from a CUDA graph with new
    activations, routes and weights before each replay) equal the launches without PDL bit for bit, unsplit and with
    K splits (the SwiGLU kernel and the down's slices in the chain)."""
    from test_dsv4_moe import _experts, _routing

    device = torch.device("cuda")
    assert pdl_supported(device), "an sm90+ GPU with Triton's griddepcontrol is this test's subject"
    w13, s13, w2, s2 = _experts(256, 4096, 2048, seed=0, device="cuda")
    cfg = moe_config(tokens * 6, 256, planes=True)
    cfg = MoeConfig(cfg.block_m, dataclasses.replace(cfg.gate_up, split_k=splits[0]),
                    dataclasses.replace(cfg.down, split_k=splits[1]))
    plain = dataclasses.replace(cfg, pdl=False)

    def inputs(seed):
        ids, weights = _routing(tokens, 6, 256, seed=seed, skew=False, device="cuda")
        x = (torch.randn(tokens, 4096, device="cuda", generator=torch.Generator("cuda").manual_seed(seed))
             * 0.05).bfloat16()
        return x, ids, weights

    from graph_replays import assert_replays_equal

    x, ids, weights = inputs(1)
    run = lambda c: dsv4_moe_mxfp4(x, ids, weights, w13, s13, w2, s2, 10.0, config=c,  # noqa: E731
                                   scales_fit_planes=True)
    assert torch.equal(run(cfg), run(plain))
    assert_replays_equal(lambda: run(cfg), lambda: run(plain), (x, ids, weights), inputs, range(2, 8))
