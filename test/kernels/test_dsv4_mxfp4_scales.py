"""The fused MXFP4 MoE's chunked scale storage (sgl_kernel.dsv4_mxfp4_scales): the same bytes as the checkpoint's
row-major [E, R, G], one 8-group chunk of consecutive rows contiguous, and every kernel path (in-register, scaled
dot, parity planes, their K splits) computing the identical result from either layout. CPU (the Triton interpreter); GPU
(skipped without CUDA): bit-equal outputs at DeepSeek-V4 Flash widths, decode and prefill."""

from __future__ import annotations

import pytest
import torch

from sgl_kernel.dsv4_moe import MoeConfig, MoeLaunch, dsv4_moe_mxfp4
from sgl_kernel.dsv4_moe_ref import fused_moe_mxfp4_ref
from sgl_kernel.dsv4_mxfp4_scales import CHUNK, as_rows, chunked, chunked_empty, scale_groups, scale_layout

needs_cuda = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")


def _experts(num_experts, hidden, inter, seed, device="cpu"):
    g = torch.Generator(device).manual_seed(seed)

    def packed(n, k):
        codes = torch.randint(0, 256, (num_experts, n, k // 2), generator=g, dtype=torch.int32, device=device)
        scale = torch.randint(116, 130, (num_experts, n, k // 32), generator=g, dtype=torch.int32, device=device)
        return codes.to(torch.uint8), scale.to(torch.uint8)

    return (*packed(2 * inter, hidden), *packed(hidden, inter))


def _routing(tokens, top_k, num_experts, seed, device="cpu"):
    g = torch.Generator().manual_seed(seed)
    ids = torch.stack([torch.randperm(num_experts, generator=g)[:top_k] for _ in range(tokens)])
    return ids.to(device), torch.rand(tokens, top_k, generator=g).to(device)


def test_chunked_layout_holds_the_same_bytes():
    """chunked() keeps every byte at its (expert, row, group), stores one chunk of consecutive rows contiguously and
    addresses group g of row r at r * 8 + (g // 8) * R * 8 + g % 8 (scale_layout's major stride R * 8); row-major
    bytes at r * G + g; other layouts are refused."""
    s = torch.randint(0, 256, (3, 5, 16), dtype=torch.int32).to(torch.uint8)
    c = chunked(s)
    assert c.shape == (3, 5, 2, CHUNK) and scale_groups(c) == scale_groups(s) == (3, 5, 16)
    assert torch.equal(c.reshape(3, 5, 16), s)
    storage = c.permute(0, 2, 1, 3)
    assert storage.is_contiguous() and torch.equal(storage[1, 1, 2], s[1, 2, 8:16])  # chunk 1 of row 2, in one run
    assert scale_layout(c) == (2 * 5 * 8, 5 * 8, True) and scale_layout(s) == (5 * 16, 16, False)
    flat = storage.flatten()
    se, sg, _ = scale_layout(c)
    assert all(flat[e * se + r * 8 + (g // 8) * sg + g % 8] == s[e, r, g]
               for e in range(3) for r in range(5) for g in range(16))
    empty = chunked_empty(2, 4, 24)
    assert empty.shape == (2, 3, 4, CHUNK) and as_rows(empty).shape == (2, 4, 3, CHUNK)
    with pytest.raises(ValueError, match="multiple of 8"):
        chunked(s[:, :, :12])
    for bad in (s.transpose(1, 2), torch.zeros(3, 5, 2, 2 * CHUNK, dtype=torch.uint8)[..., :CHUNK]):
        with pytest.raises(ValueError, match="unit stride"):
            scale_layout(bad)


@pytest.mark.parametrize("path", ["in-register", "scaled-dot", "planes", "planes-swap", "planes-split"])
def test_kernels_read_chunked_scales(path):
    """Each kernel path gives the same output from chunked scale bytes as from row-major ones (the same arithmetic,
    other addresses: equal bits), and that output is the reference's; 2 chunks per gate-up row, 1 per down row; two
    experts (a second expert's scale bytes past the first's: the chunked major stride), each one block of 3 rows."""
    w13, s13, w2, s2 = _experts(2, 512, 256, seed=11)
    ids, weights = _routing(3, 2, 2, seed=2)
    x = torch.randn(3, 512, generator=torch.Generator().manual_seed(3)) * 0.05
    if path == "scaled-dot":
        x = x.half()
    launch = {"in-register": MoeLaunch(64, 128, scaled_dot=False), "scaled-dot": MoeLaunch(64, 64),
              "planes": MoeLaunch(64, 256, scaled_dot=False, planes=True),
              "planes-swap": MoeLaunch(64, 128, scaled_dot=False, planes=True, swap=True),
              "planes-split": MoeLaunch(64, 128, split_k=2, scaled_dot=False, planes=True)}[path]
    config = MoeConfig(16, launch, launch)
    row_major = dsv4_moe_mxfp4(x, ids, weights, w13, s13, w2, s2, 10.0, config=config)
    got = dsv4_moe_mxfp4(x, ids, weights, w13, chunked(s13), w2, chunked(s2), 10.0, config=config)
    assert torch.equal(got, row_major)
    ref = fused_moe_mxfp4_ref(x, ids, weights, w13, chunked(s13), w2, chunked(s2), 10.0)
    tol = 2e-3 if path == "scaled-dot" else 1e-4
    torch.testing.assert_close(got.float(), ref, rtol=tol, atol=tol * ref.abs().max().item())
    storage_as_rows = as_rows(chunked(s13)).contiguous().view(s13.shape)  # chunked bytes read as row-major: wrong
    assert not torch.equal(dsv4_moe_mxfp4(x, ids, weights, w13, storage_as_rows, w2, s2, 10.0, config=config),
                           row_major)


_SCALE_LOAD_LAYOUTS = r"""
import json, re
import triton
from triton.backends.compiler import GPUTarget
from sgl_kernel import dsv4_moe as moe, dsv4_moe_general as general, dsv4_moe_planes as planes

types = {"x_ptr": "*bf16", "h_ptr": "*bf16", "rows_ptr": "*i64", "bexp_ptr": "*i64", "w_ptr": "*u8", "s_ptr": "*u8",
         "wts_ptr": "*fp32", "out_ptr": "*fp32", "limit": "fp32"}
out = {}
for tokens in (1, 32, 4096):  # Flash widths, top-6 of 256: decode (the planes) and prefill (the scaled dot) launches
    cfg = moe.moe_config(tokens * 6, 256, planes=tokens < 4096)
    for name, launch in (("gate_up", cfg.gate_up), ("down", cfg.down)):
        kernel = {(True, "gate_up"): planes._planes_gate_up_kernel, (True, "down"): planes._planes_down_kernel,
                  (False, "gate_up"): general._moe_gate_up_kernel, (False, "down"): general._moe_down_kernel}[
                      (launch.planes, name)]
        for chunked in (False, True):
            consts = {"BLOCK_M": cfg.block_m, "BLOCK_N": launch.block_n, "BLOCK_K": launch.block_k,
                      "PREC": "tf32", "SCALE_CHUNKED": chunked}
            if launch.planes:
                consts.update(SWAP=launch.swap, PTX=True, SPLITS=launch.split_k, PDL=True)
            else:
                consts.update(WEIGHT_FP8=False, A_FMT="bf16", TMA=False, w_desc=None)
            sig = {n: "constexpr" if n in consts else types.get(n, "i32") for n in kernel.arg_names}
            attrs = {(i,): [["tt.divisibility", 16]] for i, n in enumerate(kernel.arg_names)
                     if n not in consts and n not in ("TOPK", "limit")}  # as the JIT specializes Flash's sizes
            src = triton.compiler.ASTSource(fn=kernel, signature=sig, attrs=attrs,
                                            constexprs={(kernel.arg_names.index(n),): v for n, v in consts.items()})
            options = {"num_warps": launch.num_warps, "num_stages": launch.num_stages}
            ttgir = triton.compile(src, target=GPUTarget("cuda", 90, 32), options=options).asm["ttgir"]
            layouts = dict(re.findall(r"(#blocked\d*) = #ttg.blocked<([^>]*)>", ttgir))
            shape = f"{launch.block_n}x{launch.block_k // 32}"
            load = re.search(r"(?:tt\.load|ttg\.async_copy_global_to_local) [^\n]*?: tensor<" + shape +
                             r"x!tt\.ptr<i8>, (#blocked\d*)>", ttgir).group(1)
            out[f"{tokens} {name} {chunked}"] = layouts[load]
print(json.dumps(out))
"""


def test_chunked_scale_loads_keep_the_row_major_layout():
    """The compiler lays a K tile's scale loads out by what it can prove of their offsets: chunked offsets it cannot
    prove contiguous (a K split's start not known as a multiple of the K tile) get spread across warps and reshuffled
    (the prefill gate-up 14% slower on an H200), so every launch must give both layouts the same load layout. Compiled
    for sm90 on the CPU (a subprocess: this one runs the interpreter) at the decode and prefill launches of Flash's
    widths. Triton 3.6 (the GPU image's) needs K starts it can prove multiples of the K tile: the general kernels'
    loops start at 0, the planes' K splits carry a multiple_of hint (Triton 3.9 infers it)."""
    from sm90_compile import compiled_facts

    layouts = compiled_facts(_SCALE_LOAD_LAYOUTS)
    for key in {k.rsplit(" ", 1)[0] for k in layouts}:
        assert layouts[f"{key} True"] == layouts[f"{key} False"], (key, layouts)


@pytest.mark.gpu
@needs_cuda
@pytest.mark.parametrize("planes", [True, False], ids=["planes", "default"])
@pytest.mark.parametrize("tokens", [1, 8, 32, 4096])
def test_gpu_chunked_scales_bit_equal(tokens, planes):
    """Flash widths in bf16: chunked scale bytes give the row-major result bit for bit, on the parity planes (decode)
    and on the default launches (tl.dot_scaled; 4,096 tokens: prefill blocks)."""
    w13, s13, w2, s2 = _experts(256, 4096, 2048, seed=0, device="cuda")
    ids, weights = _routing(tokens, 6, 256, seed=1, device="cuda")
    x = (torch.randn(tokens, 4096, device="cuda") * 0.05).bfloat16()
    row_major = dsv4_moe_mxfp4(x, ids, weights, w13, s13, w2, s2, 10.0, scales_fit_planes=planes)
    got = dsv4_moe_mxfp4(x, ids, weights, w13, chunked(s13), w2, chunked(s2), 10.0, scales_fit_planes=planes)
    assert torch.equal(got, row_major)
