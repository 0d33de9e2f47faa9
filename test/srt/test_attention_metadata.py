"""Per-request index tensors of the DeepSeek-V4 attention metadata are built and -1 padded on the device from
host-known lengths (no device reads): compressed-entry lists [B, E_max] with requests of different lengths, with none
needing padding, and with no entries at all; window slots of rows near position 0."""

from __future__ import annotations

from types import SimpleNamespace

import torch

from sglang.srt.layers.attention.dsv4.metadata import build_entry_slots, build_window_slots

PAGE = 8


def _batch(seq_lens: list, positions: list, row_req: list):
    req_to_token = torch.arange(4 * 64).view(4, 64) + 1000  # request r's token i lives at slot 1000 + 64 r + i
    return SimpleNamespace(seq_lens_cpu=seq_lens, positions=torch.tensor(positions),
                           req_pool_indices=torch.arange(len(seq_lens)), row_req=torch.tensor(row_req),
                           req_to_token_pool=SimpleNamespace(req_to_token=req_to_token))


def test_entry_slots_padded_per_request():
    fb = _batch([17, 4, 9], [16, 3, 8], [0, 1, 2])
    slots = build_entry_slots(fb, ratio=4, page_size=PAGE)
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
    fb = _batch([3, 6], [2, 5], [0, 1])
    full_to_swa = torch.arange(2000)  # identity mapping for the test
    win = build_window_slots(fb, window=4, full_to_swa=full_to_swa)
    assert win.tolist() == [[-1, 1000, 1001, 1002], [1066, 1067, 1068, 1069]]
