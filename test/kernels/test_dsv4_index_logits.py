"""dsv4_index_logits against the engine's key formats and its own torch reference.

CPU: the Triton interpreter at small shapes (nI 4..16, dI 64/128, E 0..300), keys written by the engine's
`kv_formats` (Hadamard-rotated before quantizing, queries rotated before scoring, as the engine does), the
expected logits computed from the engine's `dequantize`. Tolerances (max |error| / max(1, max |expected|)):
1e-5 for fp32 and fp16 queries (every key code is exact in the dot dtype; only the summation order differs).
GPU (skipped without CUDA): bf16 queries at Flash shapes (nI 64, dI 128), E up to 262,144, fp8 and fp4 keys,
decode T = 1, 8, 64 and a 2048-row prefill chunk, sampled rows against the reference at 2e-3.
"""

from __future__ import annotations

import pytest
import torch

from sgl_kernel.dsv4_index_logits import dsv4_index_logits, dsv4_index_logits_ref
from sglang.srt.layers.attention.dsv4.hadamard import hadamard_rotate
from sglang.srt.mem_cache.kv_formats import DenseFormat, Fp4IndexKeyFormat, Fp8IndexKeyFormat

NEG_INF = float("-inf")


def assert_close(name: str, expected: torch.Tensor, got: torch.Tensor, tol: float) -> None:
    """NaN check first; -inf exactly where expected; finite part within tol of the expected scale."""
    assert got.shape == expected.shape, f"{name}: shape {tuple(got.shape)} != {tuple(expected.shape)}"
    assert not got.isnan().any(), f"{name}: NaN in output"
    masked = expected == NEG_INF
    assert torch.equal(got == NEG_INF, masked), f"{name}: -inf pattern differs"
    fin = ~masked
    if not fin.any():
        return
    e, g = expected[fin].double(), got[fin].double()
    assert g.isfinite().all(), f"{name}: non-finite values where finite expected"
    err = (g - e).abs().max().item()
    scale = max(1.0, e.abs().max().item())
    rel_rms = ((g - e).norm() / e.norm().clamp(min=1e-30)).item()
    assert err <= tol * scale, f"{name}: max |err| {err:.3g} (scale {scale:.3g}, rel-RMS {rel_rms:.3g}) > {tol:g}"


def key_format(kind: str, dim: int, dtype: torch.dtype):
    return {"dense": DenseFormat(dim, dtype), "fp8": Fp8IndexKeyFormat(dim), "fp4": Fp4IndexKeyFormat(dim)}[kind]


def make_case(kind: str, layout: str, T: int, H: int, D: int, E: int, q_dtype=torch.float32, seed: int = 0,
              device: str = "cpu") -> dict:
    """Pool + candidate lists the way the engine lays them out. Layouts: "rows" (row_map None, a list per
    row), "requests" (3 requests, rows grouped by request, causal visibility), "mixed" (2 lists, rows
    interleaved: every row tile straddles lists)."""
    g = torch.Generator().manual_seed(seed)
    fmt = key_format(kind, D, q_dtype)
    rotated = kind != "dense"
    num_slots = 4 * E + 37
    raw = torch.randn(num_slots, D, generator=g)
    buf = fmt.quantize(hadamard_rotate(raw) if rotated else raw)
    q = torch.randn(T, H, D, generator=g)
    q = (hadamard_rotate(q) if rotated else q).to(q_dtype)
    weights = torch.randn(T, H, generator=g) * H ** -0.5
    R = T if layout == "rows" else 3 if layout == "requests" else 2
    counts = torch.randint(0, E + 1, (R,), generator=g)
    if R:
        counts[0] = E  # the longest list defines E
    cand = torch.stack([torch.randperm(num_slots, generator=g)[:E] for _ in range(R)]) if E and R else \
        torch.zeros(R, E, dtype=torch.int64)
    cand = torch.where(torch.arange(E)[None, :] < counts[:, None], cand, -1)
    if layout == "rows":
        row_map = None
        src = torch.arange(T)
        visible = (torch.rand(T, generator=g) * (counts + 1)).long()
    else:
        src = torch.sort(torch.randint(0, R, (T,), generator=g)).values if layout == "requests" else torch.arange(T) % R
        row_map = src.clone()
        # causal: the rows of a request see a growing prefix of its list
        visible = (counts[src] - (torch.rand(T, generator=g) * 8).long()).clamp(min=0)
    if T:
        visible[0] = 0  # a row that sees nothing
    # [T, E, D] fp32, the engine's dequantization (its load does not take an empty slot set)
    keys = fmt.load(buf, cand[src].clamp(min=0)) if T * E else torch.zeros(T, E, D)
    expected = torch.einsum("thd,ted->the", q.float(), keys).relu()
    expected = torch.einsum("the,th->te", expected, weights).masked_fill(
        torch.arange(E)[None, :] >= visible[:, None], NEG_INF)
    to = lambda x: None if x is None else x.to(device)  # noqa: E731
    return dict(q=to(q), weights=to(weights), key_cache=to(buf), key_format=fmt.kernel_format, cand_slots=to(cand),
                row_map=to(row_map), visible=to(visible), expected=expected.to(device))


def run(op, case: dict, out=None) -> torch.Tensor:
    T, E = case["q"].shape[0], case["cand_slots"].shape[1]
    if out is None:
        out = torch.full((T, E), float("nan"), device=case["q"].device)
    args = {k: v for k, v in case.items() if k != "expected"}
    assert op(out=out, **args) is out
    return out


CPU_CASES = [  # kind, layout, T, H, D, E, q dtype
    ("dense", "rows", 5, 6, 64, 130, torch.float32),
    ("dense", "requests", 9, 4, 64, 300, torch.float32),
    ("dense", "mixed", 6, 16, 64, 70, torch.float16),
    ("fp8", "rows", 4, 16, 64, 200, torch.float32),
    ("fp8", "requests", 11, 6, 64, 150, torch.float32),
    ("fp8", "mixed", 5, 4, 64, 90, torch.float16),
    ("fp8", "requests", 3, 8, 128, 65, torch.float16),
    ("fp4", "rows", 3, 4, 64, 300, torch.float32),
    ("fp4", "requests", 10, 16, 64, 129, torch.float16),
    ("fp4", "mixed", 7, 6, 64, 64, torch.float32),
    ("fp4", "rows", 2, 12, 128, 33, torch.float32),
]


@pytest.mark.parametrize("kind,layout,T,H,D,E,q_dtype", CPU_CASES,
                         ids=[f"{c[0]}-{c[1]}-T{c[2]}-H{c[3]}-D{c[4]}-E{c[5]}-{str(c[6])[6:]}" for c in CPU_CASES])
def test_matches_engine_formats(kind, layout, T, H, D, E, q_dtype):
    case = make_case(kind, layout, T, H, D, E, q_dtype, seed=T * 1000 + E)
    assert_close("kernel", case["expected"], run(dsv4_index_logits, case), 1e-5)
    assert_close("reference", case["expected"], run(dsv4_index_logits_ref, case), 1e-5)


@pytest.mark.parametrize("layout", ["rows", "mixed"])
@pytest.mark.parametrize("kind", ["fp8", "fp4"])
def test_other_launch_configs(kind, layout):
    """Every tiling the benchmark sweep may pick computes the same logits (FP4 gather decode, 4-row tiles,
    32-candidate blocks, one block per program)."""
    case = make_case(kind, layout, 9, 6, 64, 150, seed=11)
    for cfg in (dict(BLOCK_T=1 if layout == "rows" else 4, BLOCK_E=32, E_BLOCKS=1, FP4_GATHER=True, num_warps=4,
                     num_stages=2),
                dict(BLOCK_T=1 if layout == "rows" else 2, BLOCK_E=64, E_BLOCKS=2, FP4_GATHER=True, num_warps=8,
                     num_stages=3)):
        out = run(lambda **kw: dsv4_index_logits(**kw, launch_config=cfg), case)
        assert_close(f"{cfg}", case["expected"], out, 1e-5)


@pytest.mark.parametrize("kind", ["dense", "fp8", "fp4"])
def test_writes_every_element_of_a_strided_out(kind):
    case = make_case(kind, "requests", 7, 4, 64, 100, seed=3)
    block = torch.full((7, 140), 123.0)
    out = block[:, 20:120]  # a view with row stride 140, as from a pooled workspace
    run(dsv4_index_logits, case, out)
    assert_close("strided out", case["expected"], out, 1e-5)
    assert (block[:, :20] == 123.0).all() and (block[:, 120:] == 123.0).all()


@pytest.mark.parametrize("kind,layout", [("fp8", "requests"), ("fp4", "rows"), ("dense", "mixed")])
def test_reference_rows_do_not_depend_on_the_rows_beside_them(kind, layout):
    """The torch backend calls the reference on row chunks of a pooled workspace: each row's logits must equal
    those of one pass bit for bit."""
    case = make_case(kind, layout, 11, 6, 64, 150, seed=8)
    one_pass = run(dsv4_index_logits_ref, case)
    shared = ("key_cache", "key_format") + (("cand_slots",) if case["row_map"] is not None else ())
    for lo, hi in ((0, 1), (3, 7), (7, 11)):
        part = {k: v if k in shared or v is None else v[lo:hi] for k, v in case.items()}
        assert torch.equal(run(dsv4_index_logits_ref, part), one_pass[lo:hi])


def test_only_the_kernel_limits_the_head_dim():
    """dI = 96 (not a power of two) is a valid dense row; the reference takes it, the kernel asserts."""
    case = make_case("dense", "rows", 3, 4, 96, 20, seed=2)
    assert_close("reference dI=96", case["expected"], run(dsv4_index_logits_ref, case), 1e-5)
    with pytest.raises(AssertionError, match="power of two"):
        run(dsv4_index_logits, case)


@pytest.mark.parametrize("T,E", [(4, 0), (0, 50), (1, 1)])
def test_degenerate_shapes(T, E):
    case = make_case("fp8", "rows", T, 4, 64, E, seed=5)
    out = run(dsv4_index_logits, case)
    assert_close("kernel", case["expected"], out, 1e-5)


@pytest.mark.parametrize("kind,layout", [("fp8", "rows"), ("fp4", "requests"), ("dense", "mixed")])
def test_fill_invisible_false_writes_only_what_a_row_tile_sees(kind, layout):
    """fill_invisible=False: every visible logit as before; the blocks past a row tile's visible entries keep what
    `out` held (the kernel: 64-candidate blocks past every visible entry of a tile; the reference: past each
    row's)."""
    case = make_case(kind, layout, 9, 6, 64, 300, seed=12)
    visible = case["visible"]
    seen = torch.arange(300)[None, :] < visible[:, None]
    for op, untouched in ((dsv4_index_logits, torch.arange(300)[None, :] >= ((visible[:, None] + 63) // 64) * 64),
                          (dsv4_index_logits_ref, ~seen)):
        if layout != "rows" and op is dsv4_index_logits:  # 8-row tiles: a block is written if any row sees it
            untouched = torch.zeros_like(untouched)
        out = run(lambda **kw: op(**kw, fill_invisible=False), case, torch.full((9, 300), 7.0))
        assert_close(op.__name__, case["expected"].masked_fill(~seen, 0.0), out.masked_fill(~seen, 0.0), 1e-5)
        assert (out[untouched] == 7.0).all()
    assert untouched.any()


def test_nothing_visible_is_all_neg_inf():
    case = make_case("fp4", "requests", 5, 4, 64, 80, seed=6)
    case["visible"] = torch.zeros(5, dtype=torch.int64)
    assert (run(dsv4_index_logits, case) == NEG_INF).all()


# ------------------------------------------------------------------------------------------------ GPU

needs_cuda = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU (device tool)")


def gpu_case(kind: str, T: int, E: int, prefill: bool, seed: int) -> dict:
    """Flash shapes: nI 64, dI 128, bf16 queries; decode = a list per row, prefill = 2 requests (causal)."""
    torch.manual_seed(seed)
    H, D, dev = 64, 128, "cuda"
    fmt = key_format(kind, D, torch.bfloat16)
    num_slots = E + 4099
    buf = fmt.quantize(hadamard_rotate(torch.randn(num_slots, D, device=dev)))
    q = hadamard_rotate(torch.randn(T, H, D, device=dev)).to(torch.bfloat16)
    weights = torch.randn(T, H, device=dev) * H ** -0.5
    if prefill:  # two requests: rows [0, T/2 + 3) and the rest, the second one ending at E entries
        cand = torch.stack([torch.randperm(num_slots, device=dev)[:E] for _ in range(2)])
        row_map = (torch.arange(T, device=dev) >= T // 2 + 3).long()
        pos = torch.arange(T, device=dev) + 4 * E - T
        visible = torch.div(pos + 1, 4, rounding_mode="floor")
    else:
        cand = torch.randint(0, num_slots, (T, E), device=dev)
        row_map = torch.arange(T, device=dev)
        visible = torch.randint(E // 2, E + 1, (T,), device=dev)
        visible[0] = E
    return dict(q=q, weights=weights, key_cache=buf, key_format=fmt.kernel_format, cand_slots=cand, row_map=row_map,
                visible=visible)


def check_sampled_rows(case: dict, out: torch.Tensor, rows: list) -> None:
    rows = torch.tensor(sorted(set(rows)), device=out.device)
    sub = dict(case, q=case["q"][rows], weights=case["weights"][rows], row_map=case["row_map"][rows],
               visible=case["visible"][rows])
    ref = dsv4_index_logits_ref(out=torch.empty(len(rows), out.shape[1], device=out.device), **sub)
    assert_close("gpu rows", ref, out[rows], 2e-3)


@pytest.mark.gpu
@needs_cuda
@pytest.mark.parametrize("kind", ["fp8", "fp4"])
@pytest.mark.parametrize("T,E", [(1, 262144), (8, 65536), (64, 262144)])
def test_gpu_decode(kind, T, E):
    case = gpu_case(kind, T, E, prefill=False, seed=T)
    out = torch.empty(T, E, device="cuda")
    dsv4_index_logits(out=out, **case)
    check_sampled_rows(case, out, [0, T // 2, T - 1])


@pytest.mark.gpu
@needs_cuda
@pytest.mark.parametrize("kind", ["fp8", "fp4"])
def test_gpu_prefill_chunk(kind):
    T, E = 2048, 16896
    case = gpu_case(kind, T, E, prefill=True, seed=7)
    out = torch.empty(T, E, device="cuda")
    dsv4_index_logits(out=out, **case)
    check_sampled_rows(case, out, [0, 1, 777, T // 2 + 2, T // 2 + 3, T // 2 + 4, T - 1])



@pytest.mark.gpu
@needs_cuda
@pytest.mark.parametrize("kind", ["fp8", "fp4"])
def test_gpu_fill_invisible_false_at_the_capacity_width(kind):
    """A decode graph's call: 262,144-entry lists, rows seeing 256 to 4,096: the visible logits as the reference's,
    the blocks past each row's visible entries untouched."""
    T, E = 32, 262144
    case = gpu_case(kind, T, E, prefill=False, seed=5)
    case["visible"] = torch.randint(256, 4097, (T,), device="cuda")
    out = torch.full((T, E), 7.0, device="cuda")
    dsv4_index_logits(out=out, fill_invisible=False, **case)
    seen = torch.arange(E, device="cuda")[None, :] < case["visible"][:, None]
    beyond = torch.arange(E, device="cuda")[None, :] >= ((case["visible"][:, None] + 63) // 64) * 64
    assert (out[beyond] == 7.0).all()
    rows = [0, 7, T - 1]
    ref = dsv4_index_logits_ref(out=torch.empty(len(rows), E, device="cuda"),
                                **dict(case, q=case["q"][rows], weights=case["weights"][rows],
                                       row_map=case["row_map"][rows], visible=case["visible"][rows]))
    assert_close("visible", ref.masked_fill(~seen[rows], 0.0), out[rows].masked_fill(~seen[rows], 0.0), 2e-3)
