"""dsv4_topk_slots against torch.topk, and logits + top-k against the engine's torch indexer.

CPU (Triton interpreter): with distinct logits the chosen slot SET equals the reference's, exactly; -1
padding when fewer than k finite logits (k > visible, E == 0, nothing visible); ties keep the lowest
columns (the same picks whatever the chunking); several select levels (small k -> 256-value chunks).
End to end: `dsv4_index_logits` then `dsv4_topk_slots` pick, per row, the same slots as
`TorchAttnBackend.forward_indexer` (the references, over the engine's row chunks) for dense, fp8 and fp4 (rotated)
keys.
GPU (skipped without CUDA): k = 512 / 1024 over up to 262,144 candidates, T = 1, 8, 64 and a 2048-row chunk.
"""

from __future__ import annotations

from types import SimpleNamespace

import pytest
import torch

from sgl_kernel.dsv4_index_logits import dsv4_index_logits
from sgl_kernel.dsv4_topk import dsv4_topk_slots, dsv4_topk_slots_ref, topk_config
from sglang.srt.layers.attention.dsv4.hadamard import hadamard_rotate
from sglang.srt.layers.attention.dsv4.logits_workspace import IndexerLogitsWorkspace
from sglang.srt.layers.attention.dsv4.metadata import DSV4Metadata, RatioMetadata
from sglang.srt.layers.attention.dsv4.torch_backend import TorchAttnBackend
from sglang.srt.mem_cache.kv_formats import DenseFormat, Fp4IndexKeyFormat, Fp8IndexKeyFormat

NEG_INF = float("-inf")


def row_sets(slots: torch.Tensor) -> list:
    out = []
    for r in slots.tolist():
        chosen = [s for s in r if s >= 0]
        assert len(chosen) == len(set(chosen)), "a slot chosen twice"
        assert all(s == -1 for s in r[len(chosen):]), "-1 padding must follow the picks"
        out.append(set(chosen))
    return out


def distinct_case(T: int, E: int, layout: str, seed: int, device: str = "cpu") -> tuple:
    """Distinct logits (a shuffled grid of exact fp32 values, negative and positive), -inf past visible."""
    g = torch.Generator().manual_seed(seed)
    R = T if layout == "rows" else 3
    logits = (torch.randperm(T * E, generator=g).float() * 0.37 - 0.1 * T * E).view(T, E)
    visible = torch.randint(0, E + 1, (T,), generator=g)
    logits = logits.masked_fill(torch.arange(E)[None, :] >= visible[:, None], NEG_INF)
    cand = torch.randperm(R * E + 11, generator=g)[:R * E].view(R, E)
    row_map = None if layout == "rows" else torch.randint(0, R, (T,), generator=g)
    to = lambda x: None if x is None else x.to(device)  # noqa: E731
    return to(logits), to(cand), to(row_map), visible


CASES = [  # T, E, k, layout: chunk = max(256, 8 * next_pow2(k)), so small k runs several levels
    (3, 300, 16, "rows"),  # 2 levels
    (4, 1000, 16, "requests"),  # 2 levels
    (2, 5000, 32, "rows"),  # 3 levels: 5000 -> 20 x 32 = 640 -> 3 x 32 = 96 -> out
    (5, 40, 64, "rows"),  # k > E
    (3, 200, 5, "requests"),  # k not a power of two
    (1, 1, 1, "rows"),
    (6, 90, 24, "requests"),
]


SELECT = {"chunk8k": dict(CHUNK_PER_K=8), "chunk4k": dict(CHUNK_PER_K=4), "chunk16k": dict(CHUNK_PER_K=16)}


@pytest.mark.parametrize("select", list(SELECT))
@pytest.mark.parametrize("T,E,k,layout", CASES, ids=[f"T{c[0]}-E{c[1]}-k{c[2]}-{c[3]}" for c in CASES])
def test_distinct_logits_same_set_as_topk(T, E, k, layout, select):
    logits, cand, row_map, visible = distinct_case(T, E, layout, seed=T * E + k)
    got = dsv4_topk_slots(logits, cand, row_map, k, launch_config=SELECT[select])
    ref = dsv4_topk_slots_ref(logits, cand, row_map, k)
    assert got.shape == (T, k) and got.dtype == torch.int64
    assert row_sets(got) == row_sets(ref)
    assert ((got >= 0).sum(1) == visible.clamp(max=k)).all()


VISIBLE_CASES = [  # T, E, k, layout: the levels' chunks past visible not read, their survivors not written
    (4, 5000, 32, "rows"),  # 3 levels (chunk 256)
    (3, 70000, 3, "requests"),  # k not dividing the chunk: 274 -> 4 -> 1 chunks
    (5, 300, 16, "rows"),
]


@pytest.mark.parametrize("T,E,k,layout", VISIBLE_CASES, ids=[f"T{c[0]}-E{c[1]}-k{c[2]}" for c in VISIBLE_CASES])
def test_visible_bounds_what_is_read(T, E, k, layout):
    """With `visible`, logits past each row's visible entries may hold anything (here NaN, +inf and values above
    every visible one): the picks are those of the visible logits alone, as the reference's."""
    logits, cand, row_map, visible = distinct_case(T, E, layout, seed=T + E + k)
    visible[0] = min(E, 2 * k + 1)  # a short row: most chunks of every level past it
    visible[-1] = E
    hidden = torch.arange(E)[None, :] >= visible[:, None]
    junk = torch.tensor([float("nan"), float("inf"), 1e30]).repeat(E // 3 + 1)[:E]
    dirty = torch.where(hidden, junk[None, :].expand(T, E), logits.masked_fill(hidden, 0.0))
    clean = logits.masked_fill(hidden, NEG_INF)
    got = dsv4_topk_slots(dirty, cand, row_map, k, visible=visible.int())
    assert row_sets(got) == row_sets(dsv4_topk_slots_ref(dirty, cand, row_map, k, visible=visible))
    assert row_sets(got) == row_sets(dsv4_topk_slots_ref(clean, cand, row_map, k))
    assert ((got >= 0).sum(1) == visible.clamp(max=k)).all()


def test_chunk_size_is_a_function_of_k():
    assert topk_config(16)[1] == 256 and topk_config(512)[1] == 4096 and topk_config(1024)[1] == 8192


@pytest.mark.parametrize("E", [0, 37])
def test_nothing_to_pick_gives_all_minus_one(E):
    logits = torch.full((3, E), NEG_INF)
    cand = torch.arange(3 * E).view(3, E)
    assert (dsv4_topk_slots(logits, cand, None, 8) == -1).all()
    assert (dsv4_topk_slots_ref(logits, cand, None, 8) == -1).all()


@pytest.mark.parametrize("select", list(SELECT))
def test_nan_and_inf_are_never_picked(select):
    logits = torch.tensor([[1.0, float("nan"), float("inf"), -2.0, NEG_INF, 0.5, -0.25]])
    cand = torch.arange(10, 17)[None, :]
    got = dsv4_topk_slots(logits, cand, None, 6, launch_config=SELECT[select])
    assert row_sets(got) == row_sets(dsv4_topk_slots_ref(logits, cand, None, 6)) == [{10, 13, 15, 16}]


@pytest.mark.parametrize("select", list(SELECT))
@pytest.mark.parametrize("E,k", [(700, 16), (120, 7)])
def test_ties_keep_lowest_columns_deterministically(E, k, select):
    g = torch.Generator().manual_seed(E)
    logits = torch.randint(-3, 4, (4, E), generator=g).float()  # heavy ties
    cand = torch.arange(4 * E).view(4, E)
    got = dsv4_topk_slots(logits, cand, None, k, launch_config=SELECT[select])
    assert torch.equal(got, dsv4_topk_slots(logits, cand, None, k, launch_config=SELECT[select]))
    # top-k by (value desc, column asc): a stable sort of -value
    order = torch.sort(-logits, dim=1, stable=True).indices[:, :k]
    assert row_sets(got) == row_sets(cand.gather(1, order))
    ref = dsv4_topk_slots_ref(logits, cand, None, k)  # any tie-break: the same multiset of values
    assert torch.equal(torch.sort(logits.gather(1, got - cand[:, :1])).values,
                       torch.sort(logits.gather(1, ref - cand[:, :1])).values)


# ------------------------------------------------------------------------------- end to end vs the engine


def engine_layout(seq_lens: list, new_tokens: list, seed: int) -> tuple:
    """entry_slots [B, E_max] (distinct pool slots, -1 past floor(len/4)), row_req and row_visible of the
    rows of this forward (the last new_tokens[b] positions of request b)."""
    g = torch.Generator().manual_seed(seed)
    counts = [n // 4 for n in seq_lens]
    e_max = max(counts)
    perm = torch.randperm(sum(counts) + 13, generator=g)
    entry = torch.full((len(seq_lens), e_max), -1, dtype=torch.int64)
    start = 0
    for b, c in enumerate(counts):
        entry[b, :c] = perm[start:start + c]
        start += c
    row_req = torch.cat([torch.full((m,), b) for b, m in enumerate(new_tokens)])
    pos = torch.cat([torch.arange(n - m, n) for n, m in zip(seq_lens, new_tokens)])
    return entry, row_req, torch.div(pos + 1, 4, rounding_mode="floor"), int(perm.max()) + 1


def engine_forward_indexer(fmt, buf, rotated, q, weights, entry, row_req, row_visible, new_tokens, k):
    """The engine's torch indexer on a stand-in pool and batch (prefill mode, rows grouped by request)."""
    backend = TorchAttnBackend.__new__(TorchAttnBackend)  # only the ops, the pool and the logits workspace are used
    backend.ops = TorchAttnBackend.load_ops()
    backend.logits_workspace = IndexerLogitsWorkspace(4 * entry.shape[1] * 6, "cpu")  # chunks of 6 rows
    backend.pool = SimpleNamespace(index_keys_rotated=rotated, index_k={0: buf}, index_format=fmt)
    indexer = SimpleNamespace(ratio=4, index_topk=k, layer_id=0, rotate=hadamard_rotate)
    md = DSV4Metadata(window_slots=None, out_swa_loc=None,
                      ratios={4: RatioMetadata(ratio=4, entry_slots=entry, row_visible=row_visible, plan=None)})
    forward_batch = SimpleNamespace(attn_metadata=md, row_req=row_req, extend_seq_lens_cpu=new_tokens,
                                    capacity_static=False)  # the general path: pooled logits, row chunks
    return backend.forward_indexer(indexer, q, weights, forward_batch)


@pytest.mark.parametrize("kind", ["dense", "fp8", "fp4"])
@pytest.mark.parametrize("k", [16, 40])
def test_logits_then_topk_equals_engine_indexer(kind, k):
    H, D = 8, 64
    # a long prefill chunk, a short prefill, two decode rows
    seq_lens, new_tokens = [301, 64, 500, 9], [23, 17, 1, 1]
    entry, row_req, row_visible, num_slots = engine_layout(seq_lens, new_tokens, seed=k)
    g = torch.Generator().manual_seed(len(kind) + k)
    fmt = {"dense": DenseFormat(D, torch.float32), "fp8": Fp8IndexKeyFormat(D), "fp4": Fp4IndexKeyFormat(D)}[kind]
    rotated = kind != "dense"
    raw = torch.randn(num_slots, D, generator=g)
    buf = fmt.quantize(hadamard_rotate(raw) if rotated else raw)
    T = row_req.shape[0]
    q = torch.randn(T, H, D, generator=g)
    weights = torch.randn(T, H, generator=g) * H ** -0.5
    expected = engine_forward_indexer(fmt, buf, rotated, q, weights, entry, row_req, row_visible, new_tokens, k)
    logits = torch.empty(T, entry.shape[1])
    dsv4_index_logits(hadamard_rotate(q) if rotated else q, weights, buf, fmt.kernel_format, entry, row_req,
                      row_visible, logits)
    assert row_sets(dsv4_topk_slots(logits, entry, row_req, k)) == row_sets(expected)


# ------------------------------------------------------------------------------------------------ GPU

needs_cuda = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU (device tool)")


@pytest.mark.gpu
@needs_cuda
@pytest.mark.parametrize("k", [512, 1024])
@pytest.mark.parametrize("T,E", [(1, 262144), (8, 262144), (64, 262144), (64, 16384), (2048, 16896), (4, 700)])
def test_gpu_distinct_logits(T, E, k):
    torch.manual_seed(T + k)
    dev = "cuda"
    logits = torch.rand(T, E, device=dev).argsort(dim=1).float() - E / 3  # distinct per row, exact (E < 2^24)
    visible = torch.randint(E // 2, E + 1, (T,), device=dev)
    visible[0] = min(E, k // 2)  # a row with fewer visible than k
    logits = logits.masked_fill(torch.arange(E, device=dev)[None, :] >= visible[:, None], NEG_INF)
    cand = torch.randint(0, 1 << 30, (2, E), device=dev)
    row_map = torch.arange(T, device=dev) % 2
    got = dsv4_topk_slots(logits, cand, row_map, k)
    ref = dsv4_topk_slots_ref(logits, cand, row_map, k)
    assert torch.equal(torch.sort(got, dim=1).values, torch.sort(ref, dim=1).values)


@pytest.mark.gpu
@needs_cuda
@pytest.mark.parametrize("kind", ["fp8", "fp4"])
def test_gpu_logits_then_topk(kind):
    """Flash shapes end to end: every pick's reference logit clears the reference k-th value (up to rounding)."""
    from sgl_kernel.dsv4_index_logits import dsv4_index_logits_ref

    torch.manual_seed(11)
    T, E, H, D, k, dev = 8, 65536, 64, 128, 512, "cuda"
    fmt = {"fp8": Fp8IndexKeyFormat(D), "fp4": Fp4IndexKeyFormat(D)}[kind]
    buf = fmt.quantize(hadamard_rotate(torch.randn(T * E, D, device=dev)))
    cand = torch.randperm(T * E, device=dev).view(T, E)
    args = dict(q=hadamard_rotate(torch.randn(T, H, D, device=dev)).to(torch.bfloat16),
                weights=torch.randn(T, H, device=dev) * H ** -0.5, key_cache=buf, key_format=fmt.kernel_format,
                cand_slots=cand, row_map=torch.arange(T, device=dev),
                visible=torch.randint(100, E + 1, (T,), device=dev))
    logits = dsv4_index_logits(out=torch.empty(T, E, device=dev), **args)
    ref = dsv4_index_logits_ref(out=torch.empty(T, E, device=dev), **args)
    got = dsv4_topk_slots(logits, cand, args["row_map"], k)
    kth = ref.topk(k, dim=1).values[:, -1:]
    picked = torch.isin(cand, got[got >= 0])  # slots are unique over the whole pool
    assert (picked.sum(1) == args["visible"].clamp(max=k)).all()
    scale = ref.masked_fill(ref == NEG_INF, 0).abs().amax(1, keepdim=True)
    assert ((ref >= kth - 1e-4 * scale) | ~picked).all()


@pytest.mark.gpu
@needs_cuda
@pytest.mark.parametrize("T,seen", [(1, 256), (32, 256), (128, 4096), (8, 262144)])
def test_gpu_visible_at_the_capacity_width(T, seen):
    """A decode graph's call: 262,144-entry lists (1M tokens), each row seeing `seen` of them, the rest of the
    logits never written (garbage from a previous use): the picks of the visible logits alone."""
    torch.manual_seed(T + seen)
    dev, E, k = "cuda", 262144, 512
    visible = torch.randint(max(1, seen // 2), seen + 1, (T,), device=dev)
    visible[0] = min(seen, k // 2)
    clean = (torch.rand(T, E, device=dev).argsort(dim=1).float() - E / 3).masked_fill(
        torch.arange(E, device=dev)[None, :] >= visible[:, None], NEG_INF)
    dirty = torch.where(clean == NEG_INF, torch.full_like(clean, 1e30), clean)
    cand = torch.randint(0, 1 << 30, (T, E), device=dev)
    got = dsv4_topk_slots(dirty, cand, None, k, visible=visible)
    ref = dsv4_topk_slots_ref(clean, cand, None, k)
    assert torch.equal(torch.sort(got, dim=1).values, torch.sort(ref, dim=1).values)
