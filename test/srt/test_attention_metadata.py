"""Per-request index tensors of the DeepSeek-V4 attention metadata are built and -1 padded on the device from
host-known lengths (no device reads): compressed-entry lists [B, E_max] with requests of different lengths, with none
needing padding, and with no entries at all; window slots of rows near position 0; the batch-vectorised compression
plan equals its request-by-request definition on random batches (decode-like and chunk-like). Both backends share
this metadata through one base class and differ only in their cache ops: the kernels and their torch references."""

from __future__ import annotations

from types import SimpleNamespace

import pytest
import torch

from sglang.srt.layers.attention.dsv4.backend_base import DeepseekV4AttnBackendBase, DSV4AttnOps
from sglang.srt.layers.attention.dsv4.metadata import build_compress_plan, build_entry_slots, build_window_slots
from sglang.srt.layers.attention.dsv4.torch_backend import TorchAttnBackend
from sglang.srt.layers.attention.dsv4.triton_backend import TritonAttnBackend
from sglang.srt.mem_cache.kv_formats import DenseFormat, Fp8KVFormat

PAGE = 8


def _batch(seq_lens: list, positions: list, row_req: list):
    req_to_token = torch.arange(4 * 64).view(4, 64) + 1000  # request r's token i lives at slot 1000 + 64 r + i
    return SimpleNamespace(seq_lens_cpu=seq_lens, positions=torch.tensor(positions),
                           req_pool_indices=torch.arange(len(seq_lens)), row_req=torch.tensor(row_req),
                           req_to_token_pool=SimpleNamespace(req_to_token=req_to_token))


def test_entry_slots_padded_per_request():
    forward_batch = _batch([17, 4, 9], [16, 3, 8], [0, 1, 2])
    slots = build_entry_slots(forward_batch, ratio=4, page_size=PAGE)
    assert slots.shape == (3, 4)  # E_max = 17 // 4
    counts = (slots >= 0).sum(dim=1).tolist()
    assert counts == [4, 1, 2] and (slots[1, 1:] == -1).all() and (slots[2, 2:] == -1).all()
    # entry w of request b sits on the page of its first token w * 4, two entries per page of 8 tokens
    full = 1000 + 64 * 0 + 4 * torch.arange(4)
    assert torch.equal(slots[0], (full // PAGE) * 2 + torch.arange(4) % 2)


def test_entry_slots_without_padding_and_without_entries():
    same = build_entry_slots(_batch([8, 8], [7, 7], [0, 1]), ratio=4, page_size=PAGE)
    assert same.shape == (2, 2) and (same >= 0).all()
    none = build_entry_slots(_batch([3, 1], [2, 0], [0, 1]), ratio=4, page_size=PAGE)
    assert none.shape == (2, 0)


def test_window_slots_before_position_zero_are_minus_one():
    forward_batch = _batch([3, 6], [2, 5], [0, 1])
    full_to_swa = torch.arange(2000)  # identity mapping for the test
    win = build_window_slots(forward_batch, window=4, full_to_swa=full_to_swa)
    assert win.tolist() == [[-1, 1000, 1001, 1002], [1066, 1067, 1068, 1069]]


def _plan_by_loop(forward_batch, ratio, overlap, page_size, num_draft_tokens, num_ring_rows):
    """The compression plan written request by request (the definition the vectorised builder must equal)."""
    from sglang.srt.mem_cache.deepseek_v4_pool import ring_size

    ring = ring_size(ratio, overlap, num_draft_tokens)
    offsets = torch.arange(2 * ratio if overlap else ratio) - (ratio if overlap else 0)
    rows, windows, reqs, dst, src, row0 = [], [], [], [], [], 0
    for b, (s, e, r) in enumerate(zip(forward_batch.extend_prefix_lens_cpu, forward_batch.extend_seq_lens_cpu,
                                      forward_batch.req_pool_indices_cpu)):
        n = s + e
        for w in range(s // ratio, n // ratio):
            p = w * ratio + offsets
            fresh_row, ring_row = num_ring_rows + row0 + (p - s), r * ring + p % ring
            rows.append(torch.where(p < 0, -1, torch.where(p >= s, fresh_row, ring_row)))
            windows.append(w)
            reqs.append(b)
        for q in range(max(s, n - ring), n):
            dst.append(r * ring + q % ring)
            src.append(row0 + q - s)
        row0 += e
    w = torch.tensor(windows, dtype=torch.int64)
    req_to_token = forward_batch.req_to_token_pool.req_to_token
    full = req_to_token[forward_batch.req_pool_indices[torch.tensor(reqs, dtype=torch.int64)], w * ratio]
    slots = (full // page_size) * (page_size // ratio) + w % (page_size // ratio)
    source = torch.stack(rows) if rows else torch.empty(0, len(offsets), dtype=torch.int64)
    return source, slots, w * ratio, torch.tensor(dst, dtype=torch.int64), torch.tensor(src, dtype=torch.int64)


@pytest.mark.parametrize("ratio,overlap", [(4, True), (128, False), (8, False)])
def test_compress_plan_equals_the_per_request_definition(ratio, overlap):
    g = torch.Generator().manual_seed(ratio)
    req_to_token = torch.randperm(6 * 1024, generator=g).view(6, 1024)
    for trial in range(40):
        bs = int(torch.randint(1, 6, (1,), generator=g))
        prefix = torch.randint(0, 700, (bs,), generator=g).tolist()
        extend = torch.randint(1, 300 if trial % 2 else 4, (bs,), generator=g).tolist()
        pool_idx = torch.randperm(6, generator=g)[:bs].tolist()
        forward_batch = SimpleNamespace(extend_prefix_lens_cpu=prefix, extend_seq_lens_cpu=extend,
                                        req_pool_indices_cpu=pool_idx, req_pool_indices=torch.tensor(pool_idx),
                                        positions=torch.zeros(1, dtype=torch.int64),
                                        req_to_token_pool=SimpleNamespace(req_to_token=req_to_token))
        ring_rows = int(torch.randint(0, 50, (1,), generator=g))
        plan = build_compress_plan(forward_batch, ratio, overlap, 256, 4, ring_rows)
        source, slots, positions, dst, src = _plan_by_loop(forward_batch, ratio, overlap, 256, 4, ring_rows)
        assert plan.num_new == len(source)
        for got, want in ((plan.source_rows, source), (plan.entry_slots, slots), (plan.entry_positions, positions),
                          (plan.ring_dst, dst), (plan.ring_src, src)):
            assert torch.equal(got, want)


def test_backends_differ_only_in_ops_the_kernels_and_their_references():
    assert TorchAttnBackend.__bases__ == TritonAttnBackend.__bases__ == (DeepseekV4AttnBackendBase,)
    torch_ops, triton_ops = TorchAttnBackend.load_ops(), TritonAttnBackend.load_ops()
    for field in DSV4AttnOps.__dataclass_fields__:
        ref, kernel = getattr(torch_ops, field), getattr(triton_ops, field)
        assert ref.__module__ == "sgl_kernel.dsv4_attention_ref" and ref.__name__ == kernel.__name__ + "_ref", field
        assert kernel.__module__.startswith("sgl_kernel.dsv4_"), field


def test_fp8_kv_format_without_rope_part_is_rejected():
    """The kernels' fp8_rope_dim = 0 means a dense cache, so an fp8_kv format without RoPE dims has no kernel form."""
    pool = SimpleNamespace(kv_format=Fp8KVFormat(128, 0), index_format=DenseFormat(64, torch.float32), device="cpu")
    with pytest.raises(ValueError, match="rope_dim > 0"):
        TorchAttnBackend(None, pool, None, PAGE)
    pool.kv_format = Fp8KVFormat(128, 64)
    assert TorchAttnBackend(None, pool, None, PAGE).fp8_rope_dim == 64
