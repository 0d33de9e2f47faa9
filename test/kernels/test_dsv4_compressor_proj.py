"""dsv4_compressor_proj (one launch: both compressors' fp32 projections with the slot bias `ape`, and the indexer's
head weights) against its torch reference, which is the model's Compressor / Indexer torch path.

CPU (Triton interpreter), odd shapes: with dyadic inputs (small integers times powers of two) every product and
partial sum is exact in fp32, so the kernel equals the reference bit for bit whatever the summation order, in both
row tiles of 1, 2 and 4 (several tiles from 5 rows); random inputs agree to fp32 rounding.
GPU (skipped without CUDA): Flash widths (hidden 4096, CSA widths 1024 + 256, 64 index heads) at batch 1 / 32 / 128,
and a CUDA-graph replay equals a plain launch.
"""

from __future__ import annotations

import pytest
import torch

from sgl_kernel.dsv4_compressor_proj import dsv4_compressor_proj, dsv4_compressor_proj_ref, launch_config

CUDA = torch.cuda.is_available()


def _dyadic(shape, g, scale=2.0 ** -3):
    return torch.randint(-8, 9, shape, generator=g).float() * scale


def _inputs(T, D, widths, ni, ratio, dtype, exact, device="cpu", seed=0, weight_dtype=torch.float32):
    g = torch.Generator().manual_seed(seed)
    make = _dyadic if exact else (lambda shape, g: torch.randn(shape, generator=g))
    x = make((T, D), g).to(dtype)
    weights = [make((2 * w, D), g).to(weight_dtype) for w in widths]
    apes = [make((ratio, w), g) for w in widths]
    index_weight = make((ni, D), g).to(dtype) if ni else None
    offset = torch.randint(0, ratio, (T,), generator=g)
    to = (lambda t: t.to(device) if t is not None else None)
    return to(x), to(offset), [to(w) for w in weights], [to(a) for a in apes], to(index_weight)


CASES = [  # T, D, compressor widths, index heads, ratio
    (1, 37, (5, 3), 7, 4), (3, 70, (9, 2), 5, 4), (2, 33, (11,), 0, 8), (7, 45, (6, 5), 3, 4),
    (19, 21, (13,), 0, 128), (40, 29, (3, 7), 9, 4),
]


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.float16], ids=str)
@pytest.mark.parametrize("case", CASES, ids=lambda c: f"T{c[0]}-D{c[1]}-w{'x'.join(map(str, c[2]))}-nI{c[3]}")
def test_exact_inputs_equal_the_reference(case, dtype):
    T, D, widths, ni, ratio = case
    x, offset, weights, apes, wi = _inputs(T, D, widths, ni, ratio, dtype, exact=True, seed=T + D)
    scale = 0.125 * 3  # the indexer's scale (dI nI)^-1/2 need not be a power of two
    got, got_i = dsv4_compressor_proj(x, offset, weights, apes, wi, scale)
    ref, ref_i = dsv4_compressor_proj_ref(x, offset, weights, apes, wi, scale)
    assert [g.shape for g in got] == [(T, 2, w) for w in widths]
    for g, r in zip(got, ref):
        assert g.dtype == torch.float32 and torch.equal(g, r)
    assert (got_i is None) == (ni == 0)
    if ni:
        assert got_i.dtype == torch.float32 and torch.equal(got_i, ref_i)


@pytest.mark.parametrize("case", CASES[:4], ids=lambda c: f"T{c[0]}-D{c[1]}")
def test_random_inputs_match_the_reference(case):
    T, D, widths, ni, ratio = case
    x, offset, weights, apes, wi = _inputs(T, D, widths, ni, ratio, torch.bfloat16, exact=False, seed=5)
    got, got_i = dsv4_compressor_proj(x, offset, weights, apes, wi, 0.3)
    ref, ref_i = dsv4_compressor_proj_ref(x, offset, weights, apes, wi, 0.3)
    for g, r in zip(got, ref):
        torch.testing.assert_close(g, r, rtol=1e-5, atol=1e-5)
    if ni:  # one bf16 step apart at most where the fp32 sums straddle a rounding boundary
        torch.testing.assert_close(got_i, ref_i, rtol=2 ** -7, atol=1e-5)


@pytest.mark.parametrize("case", CASES, ids=lambda c: f"T{c[0]}-D{c[1]}-w{'x'.join(map(str, c[2]))}-nI{c[3]}")
def test_bf16_weights_equal_the_reference(case):
    """Compressor weights kept bf16 (the engine's bf16 engine keeps them so): read as stored and widened in
    registers, the same products as the reference's fp32 copy of them; random values, so bit equality shows the
    widening itself is exact (the sums agree to fp32 rounding), and the dyadic values are equal outright."""
    T, D, widths, ni, ratio = case
    for exact in (True, False):
        x, offset, weights, apes, wi = _inputs(T, D, widths, ni, ratio, torch.bfloat16, exact=exact, seed=T,
                                               weight_dtype=torch.bfloat16)
        got, got_i = dsv4_compressor_proj(x, offset, weights, apes, wi, 0.375)
        ref, ref_i = dsv4_compressor_proj_ref(x, offset, weights, apes, wi, 0.375)
        wide, _ = dsv4_compressor_proj(x, offset, [w.float() for w in weights], apes, wi, 0.375)
        for g, r, f in zip(got, ref, wide):
            assert g.dtype == torch.float32 and torch.equal(g, f)  # bf16 or fp32 storage of the same values
            if exact:
                assert torch.equal(g, r)
            else:
                torch.testing.assert_close(g, r, rtol=1e-5, atol=1e-5)


def test_weights_of_another_dtype_are_refused():
    x, offset, weights, apes, _ = _inputs(2, 16, (4,), 0, 4, torch.bfloat16, exact=True)
    with pytest.raises(AssertionError, match="compressor weight"):
        dsv4_compressor_proj(x, offset, [weights[0].half()], apes)


def test_the_gate_half_alone_gets_the_slot_bias():
    """Zero weights: the content half is exactly zero, the gate half exactly ape[offset]."""
    x, offset, weights, apes, _ = _inputs(3, 16, (4, 6), 0, 4, torch.bfloat16, exact=True)
    weights = [torch.zeros_like(w) for w in weights]
    got, _ = dsv4_compressor_proj(x, offset, weights, apes)
    for g, ape in zip(got, apes):
        assert torch.equal(g[:, 0], torch.zeros_like(g[:, 0])) and torch.equal(g[:, 1], ape[offset])


def test_launch_config_depends_on_the_row_count_only():
    assert launch_config(4) == launch_config(9) and launch_config(1)["BLOCK_T"] == 1
    assert launch_config(1)["BLOCK_T"] * launch_config(1)["BLOCK_K"] == 512


def test_empty_batch():
    x, offset, weights, apes, wi = _inputs(0, 16, (4,), 3, 4, torch.bfloat16, exact=True)
    got, got_i = dsv4_compressor_proj(x, offset, weights, apes, wi)
    assert got[0].shape == (0, 2, 4) and got_i.shape == (0, 3)


# ----------------------------------------------------------------------------- GPU, Flash widths


@pytest.mark.gpu
@pytest.mark.skipif(not CUDA, reason="needs a CUDA GPU")
@pytest.mark.parametrize("weight_dtype", [torch.float32, torch.bfloat16], ids=str)
@pytest.mark.parametrize("T", [1, 2, 4, 32, 128])
@pytest.mark.parametrize("widths,ni", [((1024, 256), 64), ((512,), 0)], ids=["csa", "hca"])
def test_gpu_flash_widths_and_graph_replay(T, widths, ni, weight_dtype):
    from graph_replays import assert_replays_equal

    x, offset, weights, apes, wi = _inputs(T, 4096, widths, ni, 4 if ni else 128, torch.bfloat16, exact=True,
                                           device="cuda", seed=T, weight_dtype=weight_dtype)
    got, got_i = dsv4_compressor_proj(x, offset, weights, apes, wi, 2.0 ** -6)
    ref, ref_i = dsv4_compressor_proj_ref(x, offset, weights, apes, wi, 2.0 ** -6)
    for g, r in zip(got, ref):
        assert torch.equal(g, r)  # dyadic inputs: exact in any order
    if ni:
        assert torch.equal(got_i, ref_i)
    xr, _, _, _, _ = _inputs(T, 4096, widths, ni, 4, torch.bfloat16, exact=False, device="cuda", seed=T + 1)
    live = x.clone()

    def run():
        outs, iw = dsv4_compressor_proj(live, offset, weights, apes, wi, 2.0 ** -6)
        return torch.cat([o.flatten() for o in outs] + ([iw.flatten()] if iw is not None else []))

    assert_replays_equal(run, run, (live,), lambda s: (xr * (s + 1),), seeds=range(3))
    # random inputs: fp32 rounding of another summation order
    outs, _ = dsv4_compressor_proj(xr, offset, weights, apes, wi)
    refs, _ = dsv4_compressor_proj_ref(xr, offset, weights, apes, wi)
    for g, r in zip(outs, refs):
        torch.testing.assert_close(g, r, rtol=1e-4, atol=1e-3)


_SM90 = r"""  # after sm90_compile.SM90_PREAMBLE
from sgl_kernel import dsv4_compressor_proj as m

kernel = m._dsv4_compressor_proj_kernel
out = {}
for rows in (1, 2):
    cfg = m.launch_config(rows)
    for w_type in ("fp32", "bf16"):
        consts = dict(HAS_INDEX=True, ROUND=1, BLOCK_T=cfg["BLOCK_T"], BLOCK_N=cfg["BLOCK_N"], BLOCK_K=cfg["BLOCK_K"])
        types = {"x_ptr": "*bf16", "off_ptr": "*i64", "w0_ptr": "*" + w_type, "w1_ptr": "*" + w_type,
                 "wi_ptr": "*bf16", "scale": "fp32"}
        sig = {n: "constexpr" if n in consts else types.get(n, "*fp32" if n.endswith("_ptr") else "i32")
               for n in kernel.arg_names}
        attrs = {(i,): [["tt.divisibility", 16]] for i, n in enumerate(kernel.arg_names)
                 if n.endswith("_ptr") or n in ("stride_x", "K")}
        src = triton.compiler.ASTSource(fn=kernel, signature=sig, attrs=attrs,
                                        constexprs={(kernel.arg_names.index(n),): v for n, v in consts.items()})
        c = triton.compile(src, target=GPUTarget("cuda", 90, 32), options={"num_warps": cfg["num_warps"]})
        regs, stack = usage(c.asm["cubin"])
        out[f"rows={rows} w={w_type}"] = [regs, stack]
print(json.dumps(out))
"""


def test_compressor_proj_compiles_for_sm90():
    """The engine's launches (1-2 rows, CSA: both compressors + index weights) with fp32 or bf16 compressor weights
    compile for sm90 on the CPU without spilling: registers / stack bytes printed."""
    from sm90_compile import SM90_PREAMBLE, compiled_facts

    found = compiled_facts(SM90_PREAMBLE + _SM90, timeout=900)
    for case, (regs, stack) in found.items():
        print(f"{case}: {regs} registers, stack {stack} B")
    assert set(found) == {f"rows={r} w={w}" for r in (1, 2) for w in ("fp32", "bf16")}
    assert all(stack == 0 for _, stack in found.values()), found
