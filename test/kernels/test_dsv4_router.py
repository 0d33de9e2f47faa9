"""sgl_kernel.dsv4_router (the MoE router in one launch) against its torch reference dsv4_router_ref: score and hash
layers at odd widths (E 10 and 256, D 48, k 3 and 6, 1 / 5 / 63 tokens), ties in the biased scores (the lower expert
wins, ids in descending order), expert-parallel remapping and the fused shared expert's column, every launch shape
(one program per token block, D splits through the workspace and counters, 16-row dots), fp32 and bf16 weights, the
counters left zero, no host read. CPU: the Triton interpreter; GPU (skipped without CUDA): Flash widths (E 256,
D 4096, k 6) against the reference on the GPU, and a CUDA-graph replay equal to a plain launch."""

from __future__ import annotations

import pytest
import torch

from sgl_kernel import dsv4_router as router_mod
from sgl_kernel.dsv4_router import RouterLaunch, dsv4_router, dsv4_router_ref, router_launch

needs_cuda = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")
VOCAB = 97


def _layer(tokens: int, experts: int, hidden: int, top_k: int, use_hash: bool, seed: int, device="cpu",
           weight_dtype=torch.float32, x_dtype=torch.float32) -> tuple:
    """(x, weight, bias, tid2eid, input_ids) of one router, logits O(1)."""
    g = torch.Generator(device).manual_seed(seed)
    x = torch.randn(tokens, hidden, generator=g, device=device).to(x_dtype)
    weight = (torch.randn(experts, hidden, generator=g, device=device) * hidden ** -0.5 * 2).to(weight_dtype)
    if use_hash:
        tid2eid = torch.stack([torch.randperm(experts, generator=g, device=device)[:top_k] for _ in range(VOCAB)])
        return x, weight, None, tid2eid, torch.randint(0, VOCAB, (tokens,), generator=g, device=device)
    return x, weight, torch.randn(experts, generator=g, device=device) * 0.1, None, None


def _assert_equal_routes(got: tuple, want: tuple) -> None:
    (gw, gi), (ww, wi) = got, want
    assert gw.dtype == torch.float32 and gi.dtype == torch.int64 and gi.shape == wi.shape
    assert torch.equal(gi, wi)
    torch.testing.assert_close(gw, ww, rtol=2e-6, atol=2e-6)


@pytest.mark.parametrize("tokens", [1, 5, 63])
@pytest.mark.parametrize("experts,top_k", [(10, 3), (256, 6)])
@pytest.mark.parametrize("use_hash", [False, True], ids=["score", "hash"])
def test_router_equals_reference(tokens, experts, top_k, use_hash):
    args = _layer(tokens, experts, 48, top_k, use_hash, seed=tokens * experts)
    _assert_equal_routes(dsv4_router(*args, top_k, 1.5), dsv4_router_ref(*args, top_k, 1.5))


@pytest.mark.parametrize("use_hash", [False, True], ids=["score", "hash"])
def test_local_experts_and_shared_column(use_hash):
    """Expert parallelism: ids outside [4, 9) become -1 at weight 0, the others id - 4; the fused shared expert's id
    (5, this rank's sixth expert) appended at weight 1. The weights are normalised over all k global picks first."""
    args = _layer(7, 13, 48, 3, use_hash, seed=3)
    for local, shared in ((range(4, 9), None), (None, 13), (range(4, 9), 5)):
        got = dsv4_router(*args, 3, 2.5, local_experts=local, shared_expert_id=shared)
        _assert_equal_routes(got, dsv4_router_ref(*args, 3, 2.5, local_experts=local, shared_expert_id=shared))
        if shared is not None:
            assert (got[1][:, 3] == shared).all() and (got[0][:, 3] == 1).all()
        if local is not None:
            assert ((got[1][:, :3] >= -1) & (got[1][:, :3] < 5)).all()
            assert ((got[1][:, :3] == -1) == (got[0][:, :3] == 0)).all()


def test_ties_go_to_the_lower_expert():
    """Experts 2, 5, 7 and 9 share one weight row and one bias (equal biased scores), above the others: top-3 picks
    2, 5, 7 in that order, where torch.topk may return any three of the four. With expert 9's bias a little higher it
    comes first. Kernel and reference alike, the kernel through every launch shape."""
    x, weight, bias, _, _ = _layer(5, 10, 48, 3, False, seed=1)
    weight[[5, 7, 9]] = weight[2].clone()
    bias[[2, 5, 7, 9]] = 10.0  # far above the other experts (scores + bias < 10)
    want = torch.tensor([2, 5, 7]).expand(5, 3)
    for launch in (None, RouterLaunch(1, 16, 64), RouterLaunch(2, 4, 16, split_d=3)):
        assert torch.equal(dsv4_router(x, weight, bias, None, None, 3, 1.0, launch=launch)[1], want)
    assert torch.equal(dsv4_router_ref(x, weight, bias, None, None, 3, 1.0)[1], want)
    bias[9] = 10.5
    want = torch.tensor([9, 2, 5]).expand(5, 3)
    assert torch.equal(dsv4_router(x, weight, bias, None, None, 3, 1.0)[1], want)
    assert torch.equal(dsv4_router_ref(x, weight, bias, None, None, 3, 1.0)[1], want)


def test_ids_in_descending_biased_order():
    """The picks come out sorted: the slot order the experts' sums follow is the same on every path."""
    x, weight, bias, _, _ = _layer(9, 256, 48, 6, False, seed=2)
    _, ids = dsv4_router(x, weight, bias, None, None, 6, 1.0)
    scores = torch.nn.functional.softplus(x @ weight.T).sqrt() + bias
    picked = scores.gather(1, ids)
    assert (picked[:, :-1] >= picked[:, 1:]).all()
    assert torch.equal(ids.sort(dim=1).values, torch.topk(scores, 6).indices.sort(dim=1).values)


@pytest.mark.parametrize("launch", [
    RouterLaunch(4, 16, 64),  # every expert in one program
    RouterLaunch(2, 4, 16, split_d=3),  # partials over expert blocks and D splits, summed by the last program
    RouterLaunch(16, 16, 16, split_d=2),  # 16-row dots (tl.dot), a split
    RouterLaunch(16, 16, 32),  # 16-row dots over every expert
], ids=["whole", "split", "dot-split", "dot-whole"])
@pytest.mark.parametrize("use_hash", [False, True], ids=["score", "hash"])
def test_launch_shapes_equal_reference(launch, use_hash):
    args = _layer(23, 10, 48, 3, use_hash, seed=4)
    _assert_equal_routes(dsv4_router(*args, 3, 1.5, launch=launch, shared_expert_id=10),
                         dsv4_router_ref(*args, 3, 1.5, shared_expert_id=10))


def test_bf16_weight_and_activations():
    """The weight as stored in 16 bits (read as is, products in fp32) and bf16 activations."""
    args = _layer(5, 10, 48, 3, False, seed=5, weight_dtype=torch.bfloat16, x_dtype=torch.bfloat16)
    _assert_equal_routes(dsv4_router(*args, 3, 1.5), dsv4_router_ref(*args, 3, 1.5))
    _assert_equal_routes(dsv4_router(*args, 3, 1.5, launch=RouterLaunch(16, 16, 16)), dsv4_router_ref(*args, 3, 1.5))


def test_softplus_in_range_ends():
    """Logits far below zero (softplus ~ exp: a plain log(1 + e) would lose e's digits) and past torch's
    threshold 20 (softplus = the logit), each picked by a hash table."""
    x = torch.ones(2, 16)
    weight = torch.stack([torch.full((16,), v / 16) for v in (-30.0, -12.0, -3.0, 0.5, 19.0, 25.0)])
    tid2eid = torch.tensor([[0, 1, 2], [3, 4, 5]])
    args = (x, weight, None, tid2eid, torch.tensor([0, 1]))
    got, want = dsv4_router(*args, 3, 1.0), dsv4_router_ref(*args, 3, 1.0)
    assert torch.equal(got[1], want[1])
    torch.testing.assert_close(got[0], want[0], rtol=1e-6, atol=0)


def test_counters_stay_zero_and_calls_repeat():
    args = _layer(63, 256, 48, 6, False, seed=6)
    launch = RouterLaunch(8, 32, 16, split_d=2)
    first = dsv4_router(*args, 6, 1.5, launch=launch)
    assert not router_mod._counters[torch.device("cpu")].any()
    second = dsv4_router(*args, 6, 1.5, launch=launch)
    assert torch.equal(first[0], second[0]) and torch.equal(first[1], second[1])


def test_decode_launch_spreads_the_weight():
    """One token: ~128 programs share the weight's read (4 experts x a D split each); prefill: no split."""
    one = router_launch(1, 256, 4096)
    assert (one.block_t, one.block_e) == (1, 4) and 256 // one.block_e * one.split_d >= 128
    assert router_launch(32, 256, 4096).block_t == 16
    assert router_launch(8192, 256, 4096).split_d == 1


def test_zero_tokens_and_bad_inputs():
    x, weight, bias, _, _ = _layer(3, 10, 48, 3, False, seed=7)
    w, ids = dsv4_router(x[:0], weight, bias, None, None, 3, 1.0, shared_expert_id=10)
    assert w.shape == ids.shape == (0, 4)
    with pytest.raises(ValueError, match="either a bias or a hash table"):
        dsv4_router(x, weight, None, None, None, 3, 1.0)
    with pytest.raises(ValueError, match="0 < top_k <= E"):
        dsv4_router(x, weight, bias, None, None, 11, 1.0)
    with pytest.raises(ValueError, match="weight"):
        dsv4_router(x[:, :40], weight, bias, None, None, 3, 1.0)
    with pytest.raises(ValueError, match="input_ids"):
        dsv4_router(x, weight, None, torch.zeros(5, 3, dtype=torch.long), None, 3, 1.0)


def test_router_reads_nothing_back(monkeypatch):
    """Graph-capturable: no .item(), .tolist(), bool(), int(), float() or index use of a tensor on the host."""
    args = _layer(5, 10, 48, 3, True, seed=8)
    dsv4_router(*args, 3, 1.5, local_experts=range(2, 6), shared_expert_id=4)  # interpreted once outside the guard
    reads = []
    with monkeypatch.context() as m:
        for name in ("item", "tolist", "__bool__", "__int__", "__float__", "__index__"):
            real = getattr(torch.Tensor, name)
            m.setattr(torch.Tensor, name, lambda t, *a, _name=name, _real=real, **k: reads.append(_name) or
                      _real(t, *a, **k))
        bool(torch.tensor(1))  # the guard sees a read (positive control)
        dsv4_router(*args, 3, 1.5, local_experts=range(2, 6), shared_expert_id=4)
    assert reads == ["__bool__"]


@pytest.mark.gpu
@needs_cuda
@pytest.mark.parametrize("weight_dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("tokens", [1, 8, 32, 128])
@pytest.mark.parametrize("use_hash", [False, True], ids=["score", "hash"])
def test_gpu_flash_widths(tokens, weight_dtype, use_hash):
    """Flash widths (E 256, D 4096, k 6), bf16 activations, the fp32 weight the engine keeps and a bf16 one: against
    the reference on the GPU (cuBLAS logits, other sums): the same ids wherever the k-th and (k+1)-th biased scores
    differ by more than 1e-4 (both sides' rounding), weights within 1e-5; then, with the engine's remapping and
    shared column, the call captured as a CUDA graph, replayed with new inputs, equals it launched plainly."""
    from graph_replays import assert_replays_equal

    x, weight, bias, tid2eid, input_ids = _layer(tokens, 256, 4096, 6, use_hash, seed=0, device="cuda",
                                                 weight_dtype=weight_dtype, x_dtype=torch.bfloat16)
    got_w, got_i = dsv4_router(x, weight, bias, tid2eid, input_ids, 6, 1.5)
    want_w, want_i = dsv4_router_ref(x, weight, bias, tid2eid, input_ids, 6, 1.5)
    if use_hash:
        clear = torch.ones(tokens, dtype=torch.bool, device="cuda")
    else:
        biased = torch.nn.functional.softplus(x.float() @ weight.float().T).sqrt() + bias
        top = biased.topk(7).values
        clear = top[:, 5] - top[:, 6] > 1e-4
    assert clear.float().mean() > 0.9
    assert torch.equal(got_i[clear], want_i[clear])
    torch.testing.assert_close(got_w[clear], want_w[clear], rtol=1e-5, atol=1e-5)
    live = (x.clone(),) if use_hash else (x.clone(), bias.clone())

    def run():
        b = None if use_hash else live[1]
        w, ids = dsv4_router(live[0], weight, b, tid2eid, input_ids, 6, 1.5, local_experts=range(64, 128),
                             shared_expert_id=64)
        return torch.cat((w, ids.to(w.dtype)), dim=1)  # ids < 2^24: exact

    run()  # the first call of this size allocates the counters, outside capture
    assert_replays_equal(run, run, live, lambda seed: _layer(tokens, 256, 4096, 6, use_hash, seed, device="cuda",
                                                             x_dtype=torch.bfloat16)[0::2][:len(live)],
                         seeds=(1, 2))


@pytest.mark.gpu
@needs_cuda
def test_gpu_gate_takes_the_kernel():
    from sglang.srt.layers.moe import router

    assert router._fused_kernel() is dsv4_router


_SM90 = r"""  # after sm90_compile.SM90_PREAMBLE
from sgl_kernel import dsv4_router as r

kernel = r._router_kernel
out = {}
for tokens in (1, 8, 32, 4096):
    cfg = r.router_launch(tokens, 256, 4096)
    for use_hash, w_type in ((False, "fp32"), (False, "bf16"), (True, "bf16")):  # weights kept fp32 or bf16
        if True:
            dot = cfg.block_t >= 16
            consts = dict(BLOCK_T=cfg.block_t, BLOCK_E=cfg.block_e, BLOCK_D=cfg.block_d, E_PAD=256,
                          ROUTE_T=min(cfg.block_t, 16), TOPK=6, K_PAD=8, HASH=use_hash, SHARED=True, USE_DOT=dot,
                          NATIVE=dot and w_type == "bf16")
            types = {"x_ptr": "*bf16", "w_ptr": "*" + w_type, "bias_ptr": "*fp32", "tid_ptr": "*i64",
                     "ids_in_ptr": "*i64", "ws_ptr": "*fp32", "cnt_ptr": "*i32", "out_w_ptr": "*fp32",
                     "out_id_ptr": "*i64", "scale": "fp32"}
            sig = {n: "constexpr" if n in consts else types.get(n, "i32") for n in kernel.arg_names}
            attrs = {(i,): [["tt.divisibility", 16]] for i, n in enumerate(kernel.arg_names)
                     if n.endswith("_ptr") or n in ("D", "stride_x", "stride_w", "d_per_split")}
            src = triton.compiler.ASTSource(fn=kernel, signature=sig, attrs=attrs,
                                            constexprs={(kernel.arg_names.index(n),): v for n, v in consts.items()})
            c = triton.compile(src, target=GPUTarget("cuda", 90, 32), options={"num_warps": cfg.num_warps})
            regs, stack = usage(c.asm["cubin"])
            out[f"T={tokens} {'hash' if use_hash else 'score'} w={w_type}"] = [regs, stack, c.metadata.shared]
print(json.dumps(out))
"""


def test_router_compiles_for_sm90():
    """The engine's launches at Flash widths (1 to 4,096 tokens; a score layer with an fp32 or a bf16 weight, a hash
    layer with a bf16 one) compile for sm90 on the CPU (Triton's bundled ptxas) without spilling: registers / stack
    bytes / shared memory printed."""
    from sm90_compile import SM90_PREAMBLE, compiled_facts

    found = compiled_facts(SM90_PREAMBLE + _SM90, timeout=900)
    for case, (regs, stack, shared) in found.items():
        print(f"{case}: {regs} registers, stack {stack} B, shared {shared} B")
    assert all(stack == 0 for _, stack, _ in found.values()), found
