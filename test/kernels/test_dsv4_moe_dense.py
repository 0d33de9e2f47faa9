"""The fused MoE's dense-weight path (sgl_kernel.dsv4_moe.dsv4_moe_dense: unquantized bf16 / fp16 / fp32 experts,
the routed experts' kernel on GPUs where torch has no grouped GEMM for them) against its torch reference
(dsv4_moe_ref.fused_moe_dense_ref, one expert at a time in fp32): odd widths (hidden 48, intermediate 42: neither a
power of two nor a whole tile), 1 / 5 / 63 tokens, other ranks' pairs (-1), the clamp engaged, tile shapes past the
widths, a merged w13's halves as strided views; no host read (graph-capturable). CPU: the Triton interpreter; GPU
(skipped without CUDA): Flash widths in bf16 and fp32 against the grouped GEMM's path and captured as a CUDA graph."""

from __future__ import annotations

import pytest
import torch

from sgl_kernel.dsv4_moe import MoeConfig, MoeLaunch, dense_config, dsv4_moe_dense
from sgl_kernel.dsv4_moe_ref import fused_moe_dense_ref

needs_cuda = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")


def _weights(num_experts: int, hidden: int, inter: int, seed: int, dtype=torch.float32, device="cpu") -> tuple:
    g = torch.Generator(device).manual_seed(seed)

    def draw(*shape):
        return (torch.randn(*shape, generator=g, device=device) * hidden ** -0.5).to(dtype)

    return draw(num_experts, inter, hidden), draw(num_experts, inter, hidden), draw(num_experts, hidden, inter)


def _routing(tokens: int, top_k: int, num_experts: int, seed: int, foreign: bool, device="cpu") -> tuple:
    g = torch.Generator().manual_seed(seed)
    ids = torch.stack([torch.randperm(num_experts, generator=g)[:top_k] for _ in range(tokens)])
    weights = torch.rand(tokens, top_k, generator=g)
    if foreign:  # expert parallelism: a third of the pairs are another rank's, at NaN weight (it would show)
        ids = torch.where(torch.rand(tokens, top_k, generator=g) < 0.33, -1, ids)
        ids[0] = -1  # a token with no pair on this rank
        weights = torch.where(ids < 0, float("nan"), weights)
    return ids.to(device), weights.to(device)


def _assert_close(got, ref, tol: float) -> None:
    assert torch.isfinite(got).all()
    torch.testing.assert_close(got.float(), ref, rtol=tol, atol=tol * max(ref.abs().max().item(), 1e-6))


@pytest.mark.parametrize("tokens", [1, 5, 63])
@pytest.mark.parametrize("foreign", [False, True], ids=["all-local", "other-ranks-pairs"])
def test_dense_equals_reference_at_odd_widths(tokens, foreign):
    """fp32, hidden 48 and intermediate 42 (not powers of two, not whole tiles, 42 fp32 rows not whole 16-byte units:
    the widths torch's grouped GEMM refuses), top-3 of 8 experts, 1 to 63 tokens (16-row and 64-row blocks)."""
    w1, w3, w2 = _weights(8, 48, 42, seed=tokens)
    ids, weights = _routing(tokens, 3, 8, seed=tokens, foreign=foreign)
    x = torch.randn(tokens, 48, generator=torch.Generator().manual_seed(1))
    got = dsv4_moe_dense(x, ids, weights, w1, w3, w2, 10.0)
    ref = fused_moe_dense_ref(x, ids, torch.where(ids < 0, 0.0, weights), w1, w3, w2, 10.0)
    assert got.dtype == torch.float32 and got.shape == (tokens, 48)
    _assert_close(got, ref, 1e-5)
    if foreign:
        assert (got[0] == 0).all()  # no pair on this rank: nothing added


@pytest.mark.parametrize("dtype", [torch.float16, torch.bfloat16])
def test_dense_half_precision_and_clamp(dtype):
    """16-bit activations and weights (exact products, fp32 sums), the intermediate rows stored in the activations'
    dtype as the grouped GEMM's are (the reference keeps them fp32: the tolerance is that rounding); limit 0.5
    engages the clamp on most rows."""
    w1, w3, w2 = _weights(6, 48, 42, seed=2, dtype=dtype)
    ids, weights = _routing(5, 2, 6, seed=3, foreign=False)
    x = torch.randn(5, 48, generator=torch.Generator().manual_seed(4)).to(dtype)
    got = dsv4_moe_dense(x, ids, weights, w1, w3, w2, 0.5)
    assert got.dtype == dtype
    _assert_close(got, fused_moe_dense_ref(x, ids, weights, w1, w3, w2, 0.5), 2e-3 if dtype == torch.float16 else 2e-2)


@pytest.mark.parametrize("config", [
    MoeConfig(16, MoeLaunch(16, 16, scaled_dot=False), MoeLaunch(32, 16, scaled_dot=False)),  # many K tiles
    MoeConfig(32, MoeLaunch(64, 128, scaled_dot=False), MoeLaunch(128, 64, scaled_dot=False)),  # tiles past widths
], ids=["narrow", "wide"])
def test_dense_launch_variants_equal_reference(config):
    w1, w3, w2 = _weights(8, 48, 42, seed=5)
    ids, weights = _routing(23, 3, 8, seed=6, foreign=True)
    x = torch.randn(23, 48, generator=torch.Generator().manual_seed(7))
    got = dsv4_moe_dense(x, ids, weights, w1, w3, w2, 10.0, config=config)
    _assert_close(got, fused_moe_dense_ref(x, ids, torch.where(ids < 0, 0.0, weights), w1, w3, w2, 10.0), 1e-5)


def test_dense_takes_a_merged_w13_as_views():
    """Weights pass with their strides: a merged [E, 2I, D] w13's halves, and a transposed copy of w2."""
    w1, w3, w2 = _weights(4, 48, 42, seed=8)
    w13 = torch.cat((w1, w3), dim=1)
    w2_t = w2.transpose(1, 2).contiguous().transpose(1, 2)  # [E, D, I] with inputs strided
    ids, weights = _routing(5, 2, 4, seed=9, foreign=False)
    x = torch.randn(5, 48, generator=torch.Generator().manual_seed(10))
    got = dsv4_moe_dense(x, ids, weights, w13[:, :42], w13[:, 42:], w2_t, 10.0)
    _assert_close(got, fused_moe_dense_ref(x, ids, weights, w1, w3, w2, 10.0), 1e-5)


def test_dense_launches_by_pairs_per_expert():
    """Decode blocks of 16 rows, prefill 64 / 128 (moe_config's rule); K tiles of 128 bytes of a row."""
    assert dense_config(6, 256, torch.bfloat16).block_m == 16
    assert dense_config(64 * 256, 256, torch.float32).block_m == 64
    assert dense_config(4096 * 6, 256, torch.bfloat16).block_m == 128
    assert dense_config(6, 256, torch.bfloat16).gate_up.block_k == 64
    assert dense_config(6, 256, torch.float32).down.block_k == 32


def test_zero_tokens_and_bad_inputs():
    w1, w3, w2 = _weights(4, 48, 42, seed=0)
    assert dsv4_moe_dense(torch.zeros(0, 48), torch.zeros(0, 2, dtype=torch.int64), torch.zeros(0, 2), w1, w3, w2,
                          10.0).shape == (0, 48)
    ids, weights = torch.zeros(3, 2, dtype=torch.int64), torch.zeros(3, 2)
    with pytest.raises(ValueError, match="do not fit x"):
        dsv4_moe_dense(torch.zeros(3, 40), ids, weights, w1, w3, w2, 10.0)
    with pytest.raises(ValueError, match="do not fit x"):
        dsv4_moe_dense(torch.zeros(3, 48), ids, weights, w1, w3[:, :40], w2, 10.0)
    with pytest.raises(ValueError, match="do not fit x"):
        dsv4_moe_dense(torch.zeros(3, 48), ids, weights[:, :1], w1, w3, w2, 10.0)
    with pytest.raises(ValueError, match="weights in x's dtype"):
        dsv4_moe_dense(torch.zeros(3, 48).half(), ids, weights, w1, w3, w2, 10.0)


def test_dense_reads_nothing_back(monkeypatch):
    """Graph-capturable: the sort, both kernels' launches and the sums read no tensor on the host (.item(),
    .tolist(), bool(), int(), float(), index use: the calls through which host code waits for the device)."""
    w1, w3, w2 = _weights(8, 48, 42, seed=11)
    ids, weights = _routing(5, 3, 8, seed=12, foreign=True)
    x = torch.randn(5, 48, generator=torch.Generator().manual_seed(13))
    dsv4_moe_dense(x, ids, weights, w1, w3, w2, 10.0)  # compiled (interpreted) once outside the guard
    reads = []
    with monkeypatch.context() as m:
        for name in ("item", "tolist", "__bool__", "__int__", "__float__", "__index__"):
            real = getattr(torch.Tensor, name)
            m.setattr(torch.Tensor, name, lambda t, *a, _name=name, _real=real, **k: reads.append(_name) or
                      _real(t, *a, **k))
        bool(torch.tensor(1))  # the guard sees a read (positive control)
        dsv4_moe_dense(x, ids, weights, w1, w3, w2, 10.0)
    assert reads == ["__bool__"]


@pytest.mark.gpu
@needs_cuda
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32])
@pytest.mark.parametrize("tokens", [1, 8, 32, 4096])
def test_gpu_dense_flash_widths_equal_grouped_path(dtype, tokens):
    """Flash widths (hidden 4096, intermediate 2048, top-6 of 256 experts): the dense-weight Triton path against the
    grouped path (RoutedExperts, torch._grouped_mm; in fp32 on the GPU it has none, so the fp32 reference on the
    weights) and the fp32 reference: relative error below 1% in bf16, 1e-5 in fp32 (IEEE dots); then the
    call captured as a CUDA graph, replayed with new routing, equals it launched plainly."""
    from graph_replays import assert_replays_equal

    from sglang.srt.layers.moe.experts import RoutedExperts

    w1, w3, w2 = _weights(256, 4096, 2048, seed=0, dtype=dtype, device="cuda")
    ids, weights = _routing(tokens, 6, 256, seed=1, foreign=False, device="cuda")
    x = (torch.randn(tokens, 4096, device="cuda") * 0.5).to(dtype)
    got = dsv4_moe_dense(x, ids, weights, w1, w3, w2, 10.0).float()
    ref = fused_moe_dense_ref(x, ids, weights, w1, w3, w2, 10.0)
    err = ((got - ref).norm() / ref.norm()).item()
    print(f"{dtype} tokens {tokens}: relative error {err:.2e} vs the fp32 reference")
    assert err < (1e-2 if dtype == torch.bfloat16 else 1e-5)
    if dtype == torch.bfloat16:
        with torch.device("meta"):
            experts = RoutedExperts(256, 4096, 2048, 10.0)
        experts.w1, experts.w3, experts.w2 = (torch.nn.Parameter(w, requires_grad=False) for w in (w1, w3, w2))
        with torch.no_grad():
            grouped = experts._forward_grouped(x, ids, weights).float()
        err = ((got - grouped).norm() / grouped.norm()).item()
        print(f"{dtype} tokens {tokens}: relative error {err:.2e} vs the grouped GEMM")
        assert err < 1e-2
    if tokens <= 32:
        live = (ids.clone(), weights.clone())
        assert_replays_equal(lambda: dsv4_moe_dense(x, *live, w1, w3, w2, 10.0),
                             lambda: dsv4_moe_dense(x, *live, w1, w3, w2, 10.0), live,
                             lambda seed: _routing(tokens, 6, 256, seed=seed, foreign=seed % 2 == 0, device="cuda"),
                             seeds=(2, 3))
