"""utils/compile_watch.py: a Triton compile after the server's warm-up is logged with the variant's specialisations
and counted; the hook never skips the compile and chains the one it replaced."""

from __future__ import annotations

import logging

import triton

from sglang.srt.utils.compile_watch import LOG_PREFIX, describe_variant, unwatch, watch_compiles

# what Triton passes as `compile` (jit.py _call_hook): parameter types, constexprs and attributes by argument index
COMPILE = {"signature": {"x_ptr": "*bf16", "s_ptr": "*fp32", "rows": "constexpr", "stride_sc": "i32",
                         "n": "i32", "BLOCK": "constexpr"},
           "constants": {(2,): 1, (5,): 128}, "configs": [{(0,): [["tt.divisibility", 16]],
                                                         (3,): [["tt.divisibility", 16]]}],
           "num_warps": 4, "num_stages": 3}


def test_describe_variant_names_each_specialisation():
    assert describe_variant("_k", COMPILE) == (
        "_k[warps=4, stages=3](x_ptr:*bf16/16, s_ptr:*fp32, rows=1, stride_sc:i32/16, n:i32, BLOCK=128)")


def test_watch_logs_counts_and_chains(caplog):
    calls = []
    previous = triton.knobs.runtime.jit_cache_hook
    triton.knobs.runtime.jit_cache_hook = lambda **kw: calls.append(kw["fn"]) or False
    try:
        watch = watch_compiles()
        assert triton.knobs.runtime.jit_cache_hook is watch
        fn = type("Info", (), {"name": "_k"})()
        with caplog.at_level(logging.WARNING):
            skip = watch(key="k", repr="_k[...]", fn=fn, compile=COMPILE, is_manual_warmup=False,
                         already_compiled=False)
            watch(key="k2", repr="_j[...]", fn=type("Info", (), {"name": "_j"})(), compile={})  # other hook args
        assert skip is False and watch.total == 2 and watch.counts["_k"] == 1 and len(calls) == 2
        lines = [r.getMessage() for r in caplog.records if LOG_PREFIX in r.getMessage()]
        assert "stride_sc:i32/16" in lines[0] and lines[1].endswith("_j[...]")
        unwatch(watch)
        assert triton.knobs.runtime.jit_cache_hook is not watch
    finally:
        triton.knobs.runtime.jit_cache_hook = previous
