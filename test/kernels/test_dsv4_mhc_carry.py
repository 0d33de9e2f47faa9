"""hc_post writing the next sub-layer's partial mixes (sgl_kernel.dsv4_mhc.dsv4_hc_post_mixes) and the hc_pre /
hc_pre_norm / hc_head launches that take them (`partials=`) instead of computing their own.

CPU (Triton interpreter): n = 4 / 3, D 48 / 40 (a partial tile), T = 1 / 5 / 33 (one and two token blocks, partial),
fp32 and bf16, a sub-layer's fn and the head's: the new streams equal dsv4_hc_post's bit for bit, the partials
mix_partials_ref's of them (fp32 summation order); the next hc_pre_norm / hc_pre / hc_head fed the carried partials
equal the same op computing its own mixes (fp32 summation order; the rounded outputs within one rounding); launch
counts (one launch for hc_post + mixes, one for the carried hc_pre); the layer's dispatch (None on the CPU path); the
tiny model's logprobs on the simulated GPU with the carry equal to those without.
GPU (skipped without CUDA): Flash widths at T 1 / 8 / 32 / 128, and post -> pre_norm -> post -> head carried through a
CUDA graph replay equal to plain launches bit for bit. sm90: registers and spills at 16 / 32 / 64-token blocks.
"""

from __future__ import annotations

import pytest
import torch

import sgl_kernel.dsv4_mhc as kernels
from sgl_kernel.dsv4_mhc import (MixPartials, dsv4_hc_head, dsv4_hc_post, dsv4_hc_post_mixes, dsv4_hc_pre,
                                 dsv4_hc_pre_norm, dsv4_hc_pre_norm_fp8, mixes_width, post_mixes_launch)
from sglang.srt.layers import mhc
from sglang.srt.layers.mhc import CARRY_MAX_ROWS, hc_post_mixes_ref, hc_post_ref, mix_partials_ref

needs_cuda = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")
BF16_ULP = 2.0 ** -7
FP32_EPS = torch.finfo(torch.float32).eps
ITERS, EPS = 20, 1e-6


def _case(t: int, n: int, d: int, seed: int, dtype=torch.float32, device="cpu", head=False) -> dict:
    """A sub-layer's streams, output o, post / comb (as hc_pre gives them) and the next fn (a sub-layer's or with
    `head` the head's) with its scale / base; fn scaled so the mixes are O(1)."""
    g = torch.Generator().manual_seed(seed)
    m = 2 * n + n * n
    rows = n if head else m
    x = dict(streams=torch.randn(t, n, d, generator=g) * 2, out=torch.randn(t, d, generator=g),
             fn=torch.randn(m, n * d, generator=g) * (n * d) ** -0.5 * 2,
             next_fn=torch.randn(rows, n * d, generator=g) * (n * d) ** -0.5 * 2,
             scale=torch.rand(3, generator=g) + 0.5, base=torch.randn(m, generator=g),
             next_scale=torch.rand(1 if head else 3, generator=g) + 0.5, next_base=torch.randn(rows, generator=g))
    x = {k: v.to(device) for k, v in x.items()}
    x["streams"], x["out"] = x["streams"].to(dtype), x["out"].to(dtype)
    _, x["post"], x["comb"] = dsv4_hc_pre(x["streams"], x["fn"], x["scale"], x["base"], ITERS, EPS, EPS)
    return x


def _chunk(t: int, d: int) -> int:
    launch = post_mixes_launch(t, d)
    return launch.block_d * launch.d_tiles


def _check_partials(new, partials, fn, gpu=False) -> None:
    t, _, d = new.shape
    want = mix_partials_ref(new, fn, _chunk(t, d), mixes_width(fn.shape[0]))
    assert isinstance(partials, MixPartials) and partials.rows == fn.shape[0]
    assert partials.part.shape == want.shape and partials.part.dtype == torch.float32
    tol = dict(rtol=1e-4, atol=1e-3) if gpu else dict(rtol=1e-5, atol=1e-4)  # sums of up to 128 (GPU 16,384) products
    torch.testing.assert_close(partials.part, want, **tol)


def test_launch_grid():
    """16 / 32-token blocks on 8 warps; past 16 tokens two tiles a program at least (as the mixes')."""
    assert post_mixes_launch(1, 4096) == kernels.MixesLaunch(block_t=16, block_d=32, d_tiles=1, chunks=128,
                                                             num_warps=8)
    assert post_mixes_launch(128, 4096) == kernels.MixesLaunch(block_t=32, block_d=32, d_tiles=2, chunks=64,
                                                               num_warps=8)
    assert post_mixes_launch(4096, 4096).block_t == 32 and kernels.mixes_launch(4096, 4096).block_t == 64


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=["fp32", "bf16"])
@pytest.mark.parametrize("t", [1, 5, 33])
@pytest.mark.parametrize("n,d,head", [(4, 48, False), (3, 40, False), (4, 40, True)])
def test_post_mixes_streams_and_partials(n, d, head, t, dtype):
    """The new streams are dsv4_hc_post's bit for bit (fp32: the torch reference's to summation order), the partials
    the reference's of them. D 48: two D chunks at decode; D 40: a partial tile; n 3: padded streams; 33 tokens: two
    token blocks, the second partial; the head's fn: 4 rows (a 16-column partial row)."""
    x = _case(t, n, d, seed=t * 10 + n + d, dtype=dtype, head=head)
    new, partials = dsv4_hc_post_mixes(x["out"], x["streams"], x["post"], x["comb"], x["next_fn"])
    assert new.dtype == dtype and new.is_contiguous()
    assert torch.equal(new, dsv4_hc_post(x["out"], x["streams"], x["post"], x["comb"]))
    if dtype == torch.float32:
        want, want_part = hc_post_mixes_ref(x["out"], x["streams"], x["post"], x["comb"], x["next_fn"],
                                            _chunk(t, d), mixes_width(x["next_fn"].shape[0]))
        torch.testing.assert_close(new, want, rtol=1e-5, atol=1e-5)
        torch.testing.assert_close(partials.part, want_part, rtol=1e-5, atol=1e-4)
    _check_partials(new, partials, x["next_fn"])


def _assert_carried_equal(carried, own, dtype) -> None:
    """The op fed the carried partials against the same op computing its own: fp32 to summation order, a rounded
    output within one rounding of it (the interpreter truncates: one ulp)."""
    for a, b in zip(carried, own):
        assert a.shape == b.shape and a.dtype == b.dtype
        rtol = BF16_ULP + 1e-4 if a.dtype == torch.bfloat16 else 1e-5
        torch.testing.assert_close(a.float(), b.float(), rtol=rtol, atol=1e-5)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=["fp32", "bf16"])
@pytest.mark.parametrize("t,n,d", [(1, 4, 48), (5, 3, 40), (33, 4, 40)])
def test_next_ops_take_the_partials(t, n, d, dtype):
    """hc_pre_norm / hc_pre (a sub-layer's fn) fed the carried partials give what they give computing their own mixes
    from the same new streams."""
    x = _case(t, n, d, seed=t + 7 * n, dtype=dtype)
    new, partials = dsv4_hc_post_mixes(x["out"], x["streams"], x["post"], x["comb"], x["next_fn"])
    args = (new, x["next_fn"], x["next_scale"], x["next_base"], ITERS, EPS, EPS)
    weight = torch.randn(d, generator=torch.Generator().manual_seed(d)).to(dtype)
    _assert_carried_equal(dsv4_hc_pre_norm(*args, weight, 1e-5, partials=partials),
                          dsv4_hc_pre_norm(*args, weight, 1e-5), dtype)
    _assert_carried_equal(dsv4_hc_pre(*args, partials=partials), dsv4_hc_pre(*args), dtype)


def test_head_and_fp8_norm_take_the_partials():
    """The head (4-row fn) and the quantized norm (D 128) fed carried partials: as without them."""
    x = _case(3, 4, 40, seed=5, head=True)
    new, partials = dsv4_hc_post_mixes(x["out"], x["streams"], x["post"], x["comb"], x["next_fn"])
    head = (new, x["next_fn"], x["next_scale"], x["next_base"], EPS, EPS)
    torch.testing.assert_close(dsv4_hc_head(*head, partials=partials), dsv4_hc_head(*head), rtol=1e-5, atol=1e-5)
    x = _case(3, 4, 128, seed=6, dtype=torch.float16)
    new, partials = dsv4_hc_post_mixes(x["out"], x["streams"], x["post"], x["comb"], x["next_fn"])
    args = (new, x["next_fn"], x["next_scale"], x["next_base"], ITERS, EPS, EPS, None, 1e-5)
    carried = dsv4_hc_pre_norm_fp8(*args, partials=partials)
    own = dsv4_hc_pre_norm_fp8(*args)
    _assert_carried_equal(carried[:3], own[:3], torch.float16)
    torch.testing.assert_close(carried[4], own[4], rtol=1e-5, atol=0)  # the multipliers: max |y| / 448
    with pytest.raises(AssertionError, match="partials must be"):  # a sub-layer's partials are not the head's
        dsv4_hc_head(new, x["next_fn"][:4], x["next_scale"][:1], x["next_base"][:4], EPS, EPS, partials=partials)


def test_one_launch_each_and_no_host_reads(monkeypatch):
    """hc_post with the next mixes is one launch, the carried hc_pre_norm one (its second launch only), beside output
    allocations only; nothing is read back on the host (graph-capturable)."""
    from test_dsv4_mhc import _OpCounter

    x = _case(3, 4, 48, seed=1)
    dsv4_hc_post_mixes(x["out"], x["streams"], x["post"], x["comb"], x["next_fn"])  # compiled (interpreted) once
    launches, reads, counter = [], [], _OpCounter()
    with monkeypatch.context() as m:
        for name in ("item", "tolist", "__bool__", "__int__", "__float__", "__index__"):
            real = getattr(torch.Tensor, name)
            m.setattr(torch.Tensor, name, lambda t, *a, _name=name, _real=real, **k: reads.append(_name) or
                      _real(t, *a, **k))
        for kernel in (kernels._dsv4_hc_mixes_kernel, kernels._dsv4_hc_pre_kernel, kernels._dsv4_hc_post_kernel,
                       kernels._dsv4_hc_post_mixes_kernel):
            real = kernel.run
            m.setattr(kernel, "run", lambda *a, _real=real, _name=kernel.fn.__name__, **k: launches.append(_name) or
                      counter.launch(_real, *a, **k))
        with counter:
            new, partials = dsv4_hc_post_mixes(x["out"], x["streams"], x["post"], x["comb"], x["next_fn"])
            dsv4_hc_pre_norm(new, x["next_fn"], x["next_scale"], x["next_base"], ITERS, EPS, EPS, None, 1e-5,
                             partials=partials)
    assert reads == []
    assert launches == ["_dsv4_hc_post_mixes_kernel", "_dsv4_hc_pre_kernel"]
    assert set(counter.ops) <= {"aten.empty", "aten.empty_like"}, counter.ops


def test_zero_tokens():
    x = _case(0, 4, 48, seed=0)
    new, partials = dsv4_hc_post_mixes(x["out"], x["streams"], x["post"], x["comb"], x["next_fn"])
    assert new.shape == (0, 4, 48) and partials.part.shape[0] == 0
    y, post, comb = dsv4_hc_pre_norm(new, x["next_fn"], x["next_scale"], x["next_base"], ITERS, EPS, EPS, None, 1e-5,
                                     partials=partials)
    assert y.shape == (0, 48) and post.shape == (0, 4) and comb.shape == (0, 4, 4)


def test_layer_carries_only_where_the_kernels_run(monkeypatch):
    """mhc.hc_post_mixes: on CPU tensors (and without a next fn) hc_post's torch path and no partials, so the callee
    computes its own mixes; where the kernels run, the kernel's streams and partials, which hc_pre_norm / hc_head
    pass on."""
    from sglang.srt.layers.norm import RMSNorm

    x = _case(4, 4, 48, seed=2)
    new, partials = mhc.hc_post_mixes(x["out"], x["streams"], x["post"], x["comb"], x["next_fn"])
    assert partials is None and torch.equal(new, hc_post_ref(x["out"], x["streams"], x["post"], x["comb"]))
    monkeypatch.setattr(mhc, "_fused", lambda name, t: getattr(kernels, name))
    new, partials = mhc.hc_post_mixes(x["out"], x["streams"], x["post"], x["comb"], None)
    assert partials is None and torch.equal(new, dsv4_hc_post(x["out"], x["streams"], x["post"], x["comb"]))
    new, partials = mhc.hc_post_mixes(x["out"], x["streams"], x["post"], x["comb"], x["next_fn"])
    assert isinstance(partials, MixPartials)
    norm = RMSNorm(48, 1e-5)
    calls = []
    real = kernels._dsv4_hc_mixes_kernel.run
    monkeypatch.setattr(kernels._dsv4_hc_mixes_kernel, "run", lambda *a, **k: calls.append(1) or real(*a, **k))
    args = (new, x["next_fn"], x["next_scale"], x["next_base"], ITERS, EPS, EPS, norm, None)
    carried = mhc.hc_pre_norm(*args, partials)
    assert calls == []  # the mixes came with the streams
    _assert_carried_equal(carried, mhc.hc_pre_norm(*args), torch.float32)
    assert calls == [1]


def test_engine_logits_with_and_without_the_carry(monkeypatch, tmp_path):
    """A two-layer tiny model (a CSA and an HCA layer: a layer's mixes carried to the next layer's and the last
    layer's to the HC head, every carry there is) in fp32 on the simulated GPU (every layer on its kernels,
    interpreted, but the routed experts: their torch loop, a third of the interpreted time, and the same rows into
    hc_post either way): a prompt's logprobs and two greedy tokens with every hc_post writing the next mixes equal
    those with each hc_pre computing its own (within 1e-6; the same chunks and summation order give the same bits at
    a few tokens)."""
    import sglang
    from benchmark_module import load_benchmark
    from sglang.srt.layers.moe.experts import RoutedExperts
    from sglang.srt.model_loader.tiny_checkpoint import TINY_CONFIG, make_tiny_checkpoint
    from sglang.srt.models import deepseek_v4
    from sglang.srt.platform import simulate_platform

    layers = 2
    config = {k: v for k, v in TINY_CONFIG.items() if k not in ("quantization_config", "expert_dtype")}
    config.update(num_hidden_layers=layers, compress_ratios=[4, 8, 0], num_hash_layers=1)
    model_path = make_tiny_checkpoint(str(tmp_path / "two-layers"), config, dtype="float32")

    def loop(self, x, topk_ids, topk_weights, add=None):
        out = self._forward_loop(x, topk_ids, topk_weights)
        return out if add is None else out + add

    monkeypatch.setattr(RoutedExperts, "_forward_fused", loop)

    dc = load_benchmark("decode_census")
    real, carried = deepseek_v4.hc_post_mixes, []

    def spy(out, streams, post, comb, next_fn):
        new, partials = real(out, streams, post, comb, next_fn)
        carried.append(partials is not None)
        return new, partials

    def run(eng) -> tuple:
        out = eng.generate(input_ids=[5, 17, 300, 42, 9, 77, 123], return_logprob=True, logprob_start_len=0,
                           sampling_params={"temperature": 0, "max_new_tokens": 2, "ignore_eos": True})
        meta = out["meta_info"]
        lps = [lp for lp, _, _ in meta["input_token_logprobs"][1:] + meta["output_token_logprobs"]]
        return out["output_ids"], torch.tensor(lps, dtype=torch.float64)

    with simulate_platform("cuda", capability=(9, 0)), dc.device_tensor_checks():
        eng = sglang.Engine(model_path=model_path, device="cpu", dtype="float32", log_level="warning",
                            max_running_requests=2, max_total_tokens=1024, attention_backend="triton",
                            disable_cuda_graph=True)
        try:
            monkeypatch.setattr(deepseek_v4, "hc_post_mixes", spy)
            with_carry = run(eng)
            monkeypatch.setattr(deepseek_v4, "hc_post_mixes", lambda o, s, p, c, fn: real(o, s, p, c, None))
            without = run(eng)
        finally:
            eng.shutdown()
    assert carried == [True] * (2 * 2 * layers)  # two hc_post a layer; the prefill and one decode step
    assert with_carry[0] == without[0]
    torch.testing.assert_close(with_carry[1], without[1], rtol=0, atol=1e-6)


# ----------------------------------------------------------------------------- GPU


@pytest.mark.gpu
@needs_cuda
@pytest.mark.parametrize("t", [1, 8, 32, 128])
def test_gpu_flash_widths_and_graph(t):
    """n 4, D 4096, bf16 streams: the new streams dsv4_hc_post's bit for bit, the partials the fp32 reference's of
    them, the carried hc_pre_norm and hc_head as computing their own; post -> pre_norm -> post -> head carried
    through a CUDA graph, replayed with new inputs, equal to plain launches bit for bit."""
    from graph_replays import assert_replays_equal

    x = _case(t, 4, 4096, seed=t, dtype=torch.bfloat16, device="cuda")
    h = _case(t, 4, 4096, seed=t + 1, device="cuda", head=True)
    head_fn, head_scale, head_base = h["next_fn"], h["next_scale"], h["next_base"]
    new, partials = dsv4_hc_post_mixes(x["out"], x["streams"], x["post"], x["comb"], x["next_fn"])
    plain = dsv4_hc_post(x["out"], x["streams"], x["post"], x["comb"])
    if t <= CARRY_MAX_ROWS:  # the rows the engine carries at: its new streams are hc_post's (H100: bit for bit)
        assert torch.equal(new, plain)
    else:  # 32-token blocks: the compiler contracts the fp32 sums differently, so the fp32 values differ by a rounding
        # at the operands' scale (seen on an H200: 2 ** -23 where the sum cancels to ~4e-6), then one bf16 rounding
        atol = FP32_EPS * x["streams"].abs().max().item()
        torch.testing.assert_close(new.float(), plain.float(), rtol=BF16_ULP, atol=atol)
    _check_partials(new, partials, x["next_fn"], gpu=True)
    args = (new, x["next_fn"], x["next_scale"], x["next_base"], ITERS, EPS, EPS)
    # past SPLIT_MIN_ROWS the ops' own mixes are bf16 MMAs, whose fp32 accumulation is coarser than the carried FMA
    # dot's (the engine carries only up to CARRY_MAX_ROWS): two bf16 roundings and 5e-3 near 0, as test_dsv4_mhc's
    tol = dict(rtol=2 * BF16_ULP, atol=5e-3) if kernels.split_mixes(new) else dict(rtol=BF16_ULP, atol=1e-4)
    for a, b in zip(dsv4_hc_pre_norm(*args, None, 1e-5, partials=partials), dsv4_hc_pre_norm(*args, None, 1e-5)):
        torch.testing.assert_close(a.float(), b.float(), **tol)
    new2, head_partials = dsv4_hc_post_mixes(x["out"], new, x["post"], x["comb"], head_fn)
    torch.testing.assert_close(dsv4_hc_head(new2, head_fn, head_scale, head_base, EPS, EPS, partials=head_partials),
                               dsv4_hc_head(new2, head_fn, head_scale, head_base, EPS, EPS), **tol)

    live = (x["streams"].clone(), x["out"].clone())

    def chain():
        new, partials = dsv4_hc_post_mixes(live[1], live[0], x["post"], x["comb"], x["next_fn"])
        y, post, comb = dsv4_hc_pre_norm(new, x["next_fn"], x["next_scale"], x["next_base"], ITERS, EPS, EPS, None,
                                         1e-5, partials=partials)
        new2, partials = dsv4_hc_post_mixes(live[1] + y, new, post, comb, head_fn)
        head = dsv4_hc_head(new2, head_fn, head_scale, head_base, EPS, EPS, partials=partials)
        return torch.cat((new2.flatten(), head.flatten(), post.flatten().bfloat16(), comb.flatten().bfloat16()))

    def inputs(seed):
        y = _case(t, 4, 4096, seed=seed, dtype=torch.bfloat16, device="cuda")
        return y["streams"], y["out"]

    assert_replays_equal(chain, chain, live, inputs, seeds=(300, 301))


_RESOURCES = r"""  # after sm90_compile.SM90_PREAMBLE
import sys
import sgl_kernel.dsv4_mhc as k

out = {}
kernel = k._dsv4_hc_post_mixes_kernel
types = {"o_ptr": "*bf16", "s_ptr": "*bf16", "out_ptr": "*bf16"}
types.update({n: "*fp32" for n in ("post_ptr", "comb_ptr", "fn_ptr", "part_ptr")})
for t in map(int, sys.argv[1:]):
    launch = k.post_mixes_launch(t, 4096)
    consts = dict(N=4, W=32, BLOCK_T=launch.block_t, BLOCK_D=launch.block_d, D_TILES=launch.d_tiles, PDL=True)
    sig = {n: "constexpr" if n in consts else types.get(n, "i32") for n in kernel.arg_names}
    attrs = {(i,): [["tt.divisibility", 16]] for i, n in enumerate(kernel.arg_names) if n.endswith("_ptr")}
    src = triton.compiler.ASTSource(fn=kernel, signature=sig, attrs=attrs,
                                    constexprs={(kernel.arg_names.index(n),): v for n, v in consts.items()})
    cubin = triton.compile(src, target=GPUTarget("cuda", 90, 32),
                           options={"num_warps": launch.num_warps}).asm["cubin"]
    out[f"post_mixes T={t} block_t={launch.block_t} warps={launch.num_warps}"] = list(usage(cubin))
print(json.dumps(out))
"""


def test_sm90_post_mixes_does_not_spill():
    """Compiled for sm90 on the CPU at Flash's widths (bf16 streams) as launched at 1 / 32 / 128 tokens (16 / 32 /
    32-token blocks, the last two tiles a program): no local-memory stack."""
    from sm90_compile import SM90_PREAMBLE, compiled_facts

    found = compiled_facts(SM90_PREAMBLE + _RESOURCES, "1", "32", "128", timeout=600)
    print(found)  # [registers, stack bytes] per launch
    assert all(regs <= 255 and stack == 0 for regs, stack in found.values()), found
