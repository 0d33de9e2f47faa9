"""step_profile: the trace summary over synthetic events (busy intervals merged, launch and sync API names counted
inside the steps only), a real CPU profile, and the profile columns of bench_one_batch and bench_speculative."""

from __future__ import annotations

import importlib.util
import json
import os
import re
import sys

import pytest
import torch

from oracle import TINY
from sglang.srt.utils.step_profile import (STEP_MARK, TraceEvent, is_launch, is_sync, merged_length, profile_steps,
                                           summarize, trace_events)

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
COLUMNS = ("wall ms/step", "GPU ms/step", "busy", "launches/step", "syncs/step")


def mark(start: float, end: float) -> TraceEvent:
    return TraceEvent(STEP_MARK, "user_annotation", start, end)


def host(name: str, at: float) -> TraceEvent:
    return TraceEvent(name, "cuda_runtime", at, at + 1)


def test_merged_length_counts_overlaps_once():
    assert merged_length([]) == 0
    assert merged_length([(20, 30), (0, 10), (5, 15), (30, 31), (40, 40)]) == 15 + 11


@pytest.mark.parametrize("name", ["cudaLaunchKernel", "cudaLaunchKernel_ptsz_v7000", "cudaLaunchKernelExC_v11060",
                                  "cuLaunchKernel", "cuLaunchKernelEx", "cudaLaunchCooperativeKernel",
                                  "cudaGraphLaunch", "hipLaunchKernel", "hipExtModuleLaunchKernel"])
def test_launch_names(name):
    assert is_launch(name) and not is_sync(name)


@pytest.mark.parametrize("name", ["cudaStreamSynchronize", "cudaDeviceSynchronize", "cudaEventSynchronize",
                                  "cudaMemcpy", "cudaMemcpy_ptds", "cuMemcpyDtoH_v2", "cuCtxSynchronize",
                                  "hipStreamSynchronize", "cudaFree"])
def test_sync_names(name):
    assert is_sync(name) and not is_launch(name)


@pytest.mark.parametrize("name", ["cudaMemcpyAsync", "cudaStreamWaitEvent", "cudaEventRecord", "cudaEventQuery",
                                  "aten::mm", "cudaMalloc", "void launch_kernel<float>(float*)"])
def test_neither_launch_nor_sync(name):
    assert not is_launch(name) and not is_sync(name)


def synthetic_trace() -> list:
    """Two steps (0-100, 120-200 us) whose last GPU work ends at 230; the profiler's own sync comes after."""
    return [
        mark(0, 100), mark(120, 200),
        TraceEvent(STEP_MARK, "gpu_user_annotation", 0, 230),  # the GPU twin of a mark spans gaps: not work
        TraceEvent("ProfilerStep#1", "user_annotation", 0, 101),
        TraceEvent("kernel_before", "kernel", -20, 5),  # queued before the window: clipped to [0, 5]
        TraceEvent("gemm", "kernel", 10, 40), TraceEvent("norm", "kernel", 30, 60),  # overlap: 10-60
        TraceEvent("Memcpy DtoH (Device -> Pinned)", "gpu_memcpy", 55, 70),  # 10-70
        TraceEvent("Memset (Device)", "gpu_memset", 140, 145),
        TraceEvent("attention", "kernel", 150, 230),
        TraceEvent("aten::mm", "cpu_op", 8, 20),
        host("cudaLaunchKernel", 9), host("cudaLaunchKernel_ptsz", 25), TraceEvent("cuLaunchKernelEx", "cuda_driver",
                                                                                     121, 122),
        host("cudaGraphLaunch", 130), host("cudaMemcpyAsync", 50), host("cudaStreamSynchronize", 51),
        host("cudaMemcpy", 190), host("cudaStreamWaitEvent", 131),
        host("cudaLaunchKernel", -10), host("cudaDeviceSynchronize", 240),  # outside the steps: not counted
    ]


def test_summary_of_a_cuda_trace():
    p = summarize(synthetic_trace(), gpu_trace=True)
    busy_us = 5 + 60 + 5 + 80
    assert p.steps == 2
    assert p.wall_ms_per_step == pytest.approx(230 / 2 / 1e3)
    assert p.gpu_ms_per_step == pytest.approx(busy_us / 2 / 1e3)
    assert p.gpu_busy == pytest.approx(busy_us / 230)
    assert p.kernels_per_step == 4 / 2
    assert p.launches_per_step == 4 / 2
    assert p.syncs_per_step == 2 / 2
    text = p.columns()
    assert "n/a" not in text and "busy  65.2%" in text
    # GPU work by name, clipped to the window, longest first, per step
    names = [name for name, _, _ in p.top_kernels]
    assert names == ["attention", "gemm", "norm", "Memcpy DtoH (Device -> Pinned)", "kernel_before",
                     "Memset (Device)"]
    assert p.top_kernels[0][1:] == pytest.approx((80 / 2 / 1e3, 0.5)) and p.top_kernels[4][1] == pytest.approx(5e-3 / 2)
    assert p.collective_ms_per_step == 0 and "collectives" not in text


def test_idle_gaps_name_the_work_around_them_and_the_host_meanwhile():
    """The GPU's idle intervals of the window (5-10, 70-140, 145-150 us): their sum is the wall time less the busy
    time; the longest names the GPU work before and after it and the host records overlapping it, most first."""
    p = summarize(synthetic_trace(), gpu_trace=True)
    idle = p.idle
    assert idle.idle_ms_per_step == pytest.approx(p.wall_ms_per_step - p.gpu_ms_per_step)
    assert idle.gaps_per_step == 0.5  # only 70-140 reaches GAP_MIN_US
    assert [g.ms for g in idle.largest] == pytest.approx([0.070, 0.005, 0.005])
    first = idle.largest[0]
    assert (first.before, first.after) == ("Memcpy DtoH (Device -> Pinned)", "Memset (Device)")
    assert [name for name, _ in first.host] == ["ProfilerStep#1", "cuLaunchKernelEx", "cudaGraphLaunch",
                                                "cudaStreamWaitEvent"]
    assert first.host[0][1] == pytest.approx(0.031)
    lines = idle.lines()
    assert lines[0] == "GPU idle 0.040 ms/step in 0.5 gaps >= 20 us/step; largest:"
    assert "0.070 ms after Memcpy DtoH" in lines[1] and "ProfilerStep#1 0.031" in lines[1]
    # summed by the work that ended each gap: Memset 70 us, gemm and attention 5 us each, per step of two
    assert idle.by_next[0] == ("Memset (Device)", pytest.approx(0.035), 0.5)
    assert sorted(name for name, _, _ in idle.by_next[1:]) == ["attention", "gemm"]
    assert lines[-1].startswith("  idle before, by the work that ended it: Memset (Device) 0.035 ms in 0.5")
    # a gap at the window's end (the steps outlast their GPU work) names no work after it
    tail = summarize([e for e in synthetic_trace() if e.name != "attention"], gpu_trace=True).idle
    assert tail.largest[1].after == "" and tail.largest[1].ms == pytest.approx(0.055)
    assert summarize([e for e in synthetic_trace() if e.activity == "user_annotation"], gpu_trace=True).idle is None


def test_collective_kernels_are_summed():
    """NCCL's kernels (the TP all-reduce, DP attention's all-gather / reduce-scatter) get their own per-step sum."""
    trace = synthetic_trace() + [
        TraceEvent("ncclDevKernel_AllReduce_Sum_bf16_RING_LL(ncclDevKernelArgsStorage<4096ul>)", "kernel", 60, 80),
        TraceEvent("ncclDevKernel_ReduceScatter_Sum_bf16_RING_LL(ncclDevKernelArgsStorage<4096ul>)", "kernel", 160,
                   166)]
    p = summarize(trace, gpu_trace=True)
    assert p.collective_ms_per_step == pytest.approx((20 + 6) / 2 / 1e3)
    assert "collectives ms/step  0.013" in p.columns()


def test_cpu_trace_has_no_gpu_numbers():
    events = [e for e in synthetic_trace() if e.activity in ("user_annotation", "cpu_op")]
    for gpu_trace in (False, True):  # True: a CUDA profile without GPU records (no CUPTI) is not "0 launches"
        p = summarize(events, gpu_trace=gpu_trace)
        assert p.steps == 2 and p.wall_ms_per_step == pytest.approx(200 / 2 / 1e3)
        assert all(v is None for v in (p.gpu_ms_per_step, p.gpu_busy, p.kernels_per_step, p.launches_per_step,
                                       p.syncs_per_step))
        assert p.columns().count("n/a") == 4
    # Host calls of a CPU trace are not reported, even when a name looks like one.
    assert summarize(events + [host("cudaLaunchKernel", 10)], gpu_trace=False).launches_per_step is None


def test_trace_without_steps_is_an_error():
    with pytest.raises(ValueError, match="record_function"):
        summarize([TraceEvent("gemm", "kernel", 0, 1)], gpu_trace=True)


def test_profile_steps_on_cpu():
    calls = []
    x = torch.randn(32, 32)

    def step():
        calls.append(1)
        return (x @ x).sum().item()

    p = profile_steps(step, 3, torch.device("cpu"))
    assert len(calls) == 4  # the profiler's warm-up step is run, not reported
    assert p.steps == 3 and p.wall_ms_per_step > 0 and p.gpu_busy is None and p.launches_per_step is None
    with pytest.raises(ValueError, match="steps"):
        profile_steps(step, 0, torch.device("cpu"))


def test_raw_records_agree_with_prof_events():
    from torch.profiler import ProfilerActivity, profile, record_function

    x = torch.randn(32, 32)
    with profile(activities=[ProfilerActivity.CPU]) as prof:
        for _ in range(2):
            with record_function(STEP_MARK):
                (x @ x).sum().item()
    fast, slow = summarize(trace_events(prof), False), summarize(trace_events(prof, raw=False), False)
    assert fast.steps == slow.steps == 2
    assert fast.wall_ms_per_step == pytest.approx(slow.wall_ms_per_step, abs=1e-5)


def _check_columns(lines: list, n: int) -> None:
    assert len(lines) == n, lines
    for line in lines:
        assert all(c in line for c in COLUMNS), line
        assert ("n/a" in line) == (not torch.cuda.is_available()), line


def test_bench_one_batch_prints_profile(monkeypatch, capsys, tmp_path):
    """Each result once, in one table per pass (timed runs, host phases, prefill and decode profiles), the profile
    tables after every profiled pass; the GPU columns only where there is a GPU trace, their absence said once."""
    from sglang import bench_one_batch

    out = tmp_path / "r.jsonl"
    monkeypatch.setattr(sys, "argv", ["bench_one_batch", "--model-path", "tiny-deepseek-v4", "--batch-size", "1",
                                      "2", "--input-len", "16", "--output-len", "4", "--profile-steps", "2",
                                      "--prefill-repeats", "2", "--profile-prefill", "--result-filename", str(out)])
    bench_one_batch.main()
    printed = capsys.readouterr().out.splitlines()
    rows = [ln for ln in printed if ln.startswith("batch")]
    kinds = ["| prefill ", "| model FLOPs |", "| host step", "| host prefill step", "| prefill profile |",
             "| decode profile |", "| floor |"]
    tables = {k: [ln for ln in rows if k in ln and (k != "| prefill " or "profile" not in ln)] for k in kinds}
    assert sum(map(len, tables.values())) == len(rows) == 14, rows  # seven tables of two shapes: each result once
    for k, lines in tables.items():
        assert [int(re.match(r"batch\s+(\d+)", ln).group(1)) for ln in lines] == [1, 2], k
        between = printed[printed.index(lines[0]) + 1:printed.index(lines[1])]
        assert all(ln.startswith("    ") for ln in between), (k, between)  # only a row's top kernels
    assert all("2 runs)" in ln and "decode median" in ln for ln in tables["| prefill "])
    for k in ("| host step", "| host prefill step"):
        assert all(p in tables[k][0] for p in ("allocate", "batch", "metadata", "forward", "sample", "wait", "finish",
                                               "other"))
    gpu = torch.cuda.is_available()
    for ln in tables["| prefill profile |"] + tables["| decode profile |"]:
        assert "wall ms/step" in ln and all((c in ln) == gpu for c in COLUMNS[1:]), ln
    assert not any("n/a" in ln for ln in printed)
    assert sum("not measured (no GPU trace on CPU)" in ln for ln in printed) == (0 if gpu else 1)
    assert printed.index(tables["| decode profile |"][0]) > printed.index(tables["| prefill profile |"][-1])
    assert printed.index(tables["| floor |"][0]) > printed.index(tables["| decode profile |"][-1])
    records = [json.loads(ln) for ln in out.read_text().splitlines()]
    assert [r["batch_size"] for r in records] == [1, 2]
    for r in records:
        for phases in (r["host_phases"], r["prefill_host_phases"]):
            parts = sum(phases[k] for k in ("allocate_ms", "batch_ms", "metadata_ms", "forward_ms", "sample_ms",
                                            "wait_ms", "finish_ms", "other_ms"))
            assert phases["forward_ms"] > 0 and parts == pytest.approx(phases["step_ms"], rel=1e-6)
        prefill = r["prefill_host_phases"]  # an eager extend: its batch and metadata are built on the host
        assert prefill["allocate_ms"] > 0 and prefill["batch_ms"] > 0 and prefill["metadata_ms"] > 0
        assert r["median_decode_latency_s"] > 0 and r["profile"]["steps"] == 2
        assert r["profile"]["wall_ms_per_step"] > 0
        assert len(r["prefill_latencies_s"]) == 2 and r["prefill_profile"]["steps"] == 1
        assert r["prefill_latency_s"] == pytest.approx(sum(r["prefill_latencies_s"]) / 2)  # the median of two
        assert (r["profile"]["launches_per_step"] is None) == (not torch.cuda.is_available())


def test_bench_one_batch_decode_na_only_without_decode_steps():
    from sglang.bench_one_batch import BenchResult

    row = BenchResult(1, 16, 1, 0.01, 1600.0, float("nan"), float("nan")).columns()
    assert row.endswith("| decode median      n/a") and "nan" not in row
    assert "n/a" not in BenchResult(1, 16, 4, 0.01, 1600.0, 0.002, 500.0).columns()


def test_bench_one_batch_refuses_zero_prefill_repeats(monkeypatch):
    from sglang import bench_one_batch

    monkeypatch.setattr(sys, "argv", ["bench_one_batch", "--model-path", "tiny-deepseek-v4", "--prefill-repeats", "0"])
    with pytest.raises(SystemExit):
        bench_one_batch.parse_args()


def _bench_speculative():
    spec = importlib.util.spec_from_file_location("bench_speculative", os.path.join(ROOT, "benchmark",
                                                                                    "bench_speculative.py"))
    bench = importlib.util.module_from_spec(spec)
    sys.modules[spec.name] = bench  # its dataclass resolves string annotations through the module
    spec.loader.exec_module(bench)
    return bench


def test_bench_speculative_default_config_is_in_the_repository():
    """Run without --config, the benchmark takes the standard Flash slice from benchmark/configs/."""
    config = _bench_speculative().parse_args([]).config
    assert os.path.isfile(config) and os.path.relpath(config, ROOT) == os.path.join(
        "benchmark", "configs", "flash-slice-4l32e.config.json")


def test_bench_speculative_prints_profile(monkeypatch, capsys, tmp_path):
    """A dry run in the hub's formats (--quantize): the predictable checkpoint is written once (FP8 / MXFP4 stored),
    every draft is accepted (3 steps: accept length 4), and each batch's speed-up line and JSON row come out."""
    bench = _bench_speculative()
    config = tmp_path / "tiny.json"
    config.write_text(json.dumps(TINY))
    out = tmp_path / "spec.json"
    monkeypatch.setattr(sys, "argv", ["bench_speculative", "--config", str(config), "--work-dir", str(tmp_path),
                                      "--batch", "2", "--prompt-len", "16", "--new-tokens", "9", "--steps", "3",
                                      "--profile-steps", "2", "--quantize", "--out", str(out)])
    bench.main()
    printed = capsys.readouterr().out.splitlines()
    _check_columns([ln for ln in printed if ln.startswith("speculative=")], 2)
    ckpt = tmp_path / "tiny-predictable-fp8-mxfp4"
    with open(ckpt / "config.json") as f:
        assert json.load(f)["expert_dtype"] == "fp4"
    result = json.loads(out.read_text())
    rows = result["rows"]
    assert [(r["speculative"], r["batch"]) for r in rows] == [(False, 2), (True, 2)]
    assert all(r["profile"]["steps"] == 2 and r["decode_tok_s"] > 0 for r in rows)
    assert result["quantized"] and rows[1]["accept_length"] == 4.0  # the predictable draft: every draft accepted
    (summary,) = result["speed_up"]
    assert summary["speed_up"] == rows[1]["decode_tok_s"] / rows[0]["decode_tok_s"]
    assert (summary["gpu_bound_limit"] is None) == (not torch.cuda.is_available())
    assert sum(ln.startswith("batch   2: plain") for ln in printed) == 1


def test_bench_speculative_gpu_bound_limit():
    """cycle cost = cycle GPU ms / plain step GPU ms; the GPU-bound limit = accept length / cycle cost."""
    bench = _bench_speculative()
    prof = dict(gpu_ms_per_step=2.0, launches_per_step=10.0, kernels_per_step=700.0)
    plain = dict(batch=1, decode_tok_s=100.0, accept_length=None, profile=prof)
    spec = dict(batch=1, decode_tok_s=150.0, accept_length=4.0, profile=dict(prof, gpu_ms_per_step=5.0,
                                                                           kernels_per_step=2600.0))
    s = bench.speed_up(plain, spec)
    assert (s.speed_up, s.cycle_cost, s.gpu_bound_limit, s.cycle_kernels) == (1.5, 2.5, 1.6, 2600.0)
    assert "GPU-bound limit 1.60x" in s.line() and "n/a" not in s.line()


class _OldKinetoRecord:
    """A kineto record of torch < 2.12: name and device, no activity_type()."""

    def __init__(self, name: str, on_gpu: bool) -> None:
        self._name, self._on_gpu = name, on_gpu

    def name(self) -> str:
        return self._name

    def device_type(self):
        return torch.autograd.DeviceType.CUDA if self._on_gpu else torch.autograd.DeviceType.CPU


def test_activity_without_activity_type():
    from sglang.srt.utils.step_profile import STEP_MARK, activity_of

    cases = [(STEP_MARK, False, "user_annotation"), (STEP_MARK, True, "gpu_user_annotation"),
             ("cudaLaunchKernel", False, "cpu_op"), ("ampere_bf16_gemm", True, "kernel"),
             ("Memcpy HtoD (Pinned -> Device)", True, "gpu_memcpy"), ("Memset (Device)", True, "gpu_memset")]
    for name, on_gpu, activity in cases:
        assert activity_of(_OldKinetoRecord(name, on_gpu)) == activity, name
