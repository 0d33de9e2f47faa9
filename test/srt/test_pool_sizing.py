"""Bytes per token of the DeepSeek-V4 pools: the published sizes for the real configs, and pool planning."""

from __future__ import annotations

import pytest
import torch

from sglang.srt.configs.deepseek_v4 import DeepseekV4Config
from sglang.srt.configs.hub_configs import FLASH, PRO
from sglang.srt.mem_cache.kv_formats import make_index_key_format, make_kv_format
from sglang.srt.mem_cache.pool_sizing import bytes_per_token, plan_pools


def report(raw: dict, kv: str, index: str):
    config = DeepseekV4Config.from_dict(raw)
    kv_fmt = make_kv_format(kv, config.head_dim, config.qk_rope_head_dim, torch.bfloat16)
    idx_fmt = make_index_key_format(index, config.index_head_dim, torch.bfloat16)
    return bytes_per_token(config, kv_fmt.bytes_per_entry, idx_fmt.bytes_per_entry, config.num_hidden_layers + 1)


@pytest.mark.parametrize("raw, fp8_fp4, bf16", [(FLASH, 3514, 6880), (PRO, 5031, 9848)])
def test_published_bytes_per_token(raw, fp8_fp4, bf16):
    # docs/dsv4-architecture.md 9.5: FP8 main (584 B) + FP4 index keys (68 B), and bf16 (1024 B + 256 B).
    assert round(report(raw, "fp8_e4m3", "fp4").growth) == fp8_fp4
    assert round(report(raw, "bfloat16", "auto").growth) == bf16


def test_report_rows_and_format():
    r = report(FLASH, "fp8_e4m3", "fp4")
    rows = {row.pool: row for row in r.compressed}
    assert rows["c4 kv"].layers == 21 and rows["c128 kv"].layers == 20 and rows["c4 indexer keys"].entry_bytes == 68
    assert rows["c4 kv"].entry_bytes == 584 and r.window.layers == 44
    text = r.format()
    assert "c128 kv" in text and "3514.25" in text


def test_fp8_index_keys():
    assert report(FLASH, "fp8_e4m3", "fp8").compressed[-1].entry_bytes == 132


def test_plan_pools_respects_budget_and_window_floor():
    config = DeepseekV4Config.from_dict(FLASH)
    plan = plan_pools(config, page_size=256, max_running_requests=8, context_length=65536, chunked_prefill_size=8192,
                      swa_full_tokens_ratio=0.1, budget_bytes=8 << 30, kv_entry_bytes=584, index_entry_bytes=68,
                      num_window_layers=44)
    assert plan.total_bytes <= 8 << 30
    assert plan.max_total_tokens % 256 == 0 and plan.shape.num_pages == plan.max_total_tokens // 256 + 1
    assert plan.shape.num_swa_slots - 1 >= 8 * 128 + 8192
    assert "max context" in plan.format()
    with pytest.raises(ValueError, match="holds no full page"):
        plan_pools(config, page_size=256, max_running_requests=256, context_length=1 << 20, chunked_prefill_size=8192,
                   swa_full_tokens_ratio=0.1, budget_bytes=1 << 30, kv_entry_bytes=584, index_entry_bytes=68,
                   num_window_layers=44)
