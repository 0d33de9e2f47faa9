"""The decode step's bytes floor (sglang.srt.utils.bytes_floor) and kernel accounting (step_profile): parameters by
stored format on the quantized tiny model against an independent sum, the cache bytes and expert touches, the kernel
table grouped by short name from synthetic profiler events, kernels attributed to layers by their GPU ranges, and
bench_one_batch's --kernel-table and floor rows."""

from __future__ import annotations

import json
import math
import sys

import pytest
import torch
from torch import nn

from oracle import TINY, engine
from sglang.srt.configs.deepseek_v4 import DeepseekV4Config
from sglang.srt.utils.bytes_floor import (CacheBytes, ExpertLayer, ModelBytes, cache_bytes, copy_bandwidth_gbps,
                                          decode_floor, model_bytes, uniform_touched)
from sglang.srt.utils.step_profile import (HEAD_MARK, LAYER_MARK, STEP_MARK, KernelRow, LayerKernels, StepProfile,
                                           TraceEvent, attribute_kernels, layer_ranges, record_steps, short_name,
                                           summarize)


@pytest.mark.parametrize("name, short", [
    ("void at::native::vectorized_elementwise_kernel<4, at::native::CUDAFunctor_add<float>, "
     "at::detail::Array<char*, 3> >(int, at::native::CUDAFunctor_add<float>, at::detail::Array<char*, 3>)",
     "at::native::vectorized_elementwise_kernel"),
    ("void at::native::(anonymous namespace)::cunn_SoftMaxForward<4, float>(float*, float const*, int)",
     "at::native::(anonymous namespace)::cunn_SoftMaxForward"),
    ("void at::native::elementwise_kernel<128, 2, at::native::gpu_kernel_impl_nocast<at::native::direct_copy_kernel"
     "_cuda(at::TensorIteratorBase&)::{lambda()#3}::operator()() const::{lambda(float)#1}>(at::TensorIteratorBase&, "
     "at::native::direct_copy_kernel_cuda(at::TensorIteratorBase&)::{lambda()#3}::operator()() const::{lambda(float)"
     "#1} const&)::{lambda(int)#1}>(int, at::native::gpu_kernel_impl_nocast<at::native::direct_copy_kernel_cuda(at::"
     "TensorIteratorBase&)::{lambda()#3}::operator()() const::{lambda(float)#1}>(at::TensorIteratorBase&, at::native"
     "::direct_copy_kernel_cuda(at::TensorIteratorBase&)::{lambda()#3}::operator()() const::{lambda(float)#1} const&)"
     "::{lambda(int)#1})", "at::native::elementwise_kernel"),
    ("_dsv4_rmsnorm_kernel", "_dsv4_rmsnorm_kernel"),
    ("sm90_xmma_gemm_bf16bf16_bf16f32_f32_tn_n_tilesize128x128x64_warpgroupsize1x1x1_execute_segment_k_off_kernel__"
     "5x_cublas", "sm90_xmma_gemm_bf16bf16_bf16f32_f32_tn_n_tilesize128x128x64_warpgroupsize1x1x1_execute_segment_k_"
     "off_kernel__5x_cublas"),
    ("Memcpy DtoD (Device -> Device)", "Memcpy DtoD (Device -> Device)"),
])
def test_short_names(name, short):
    assert short_name(name) == short


def mark(start: float, end: float) -> TraceEvent:
    return TraceEvent(STEP_MARK, "user_annotation", start, end)


def kernel(name: str, start: float, end: float) -> TraceEvent:
    return TraceEvent(name, "kernel", start, end)


ADD = "void at::native::vectorized_elementwise_kernel<4, at::native::CUDAFunctor_add<float> >(int)"
MUL = "void at::native::vectorized_elementwise_kernel<4, at::native::MulFunctor<float> >(int)"


def test_kernel_table_groups_by_short_name():
    """Every kernel of the steps, grouped by short name: runs and ms per step, share of the summed GPU time."""
    trace = [mark(0, 100), mark(100, 200), kernel(ADD, 0, 10), kernel(MUL, 20, 30), kernel("gemm", 40, 80),
             kernel(ADD, 110, 120), kernel("gemm", 130, 170), TraceEvent("Memset (Device)", "gpu_memset", 180, 190)]
    p = summarize(trace, gpu_trace=True, kernel_table=True)
    assert p.kernel_table == (
        KernelRow("gemm", 1.0, 0.04, 80 / 120), KernelRow("at::native::vectorized_elementwise_kernel", 1.5, 0.015,
                                                          30 / 120),
        KernelRow("Memset (Device)", 0.5, 0.005, 10 / 120))
    assert sum(k.share for k in p.kernel_table) == pytest.approx(1.0)
    assert summarize(trace, gpu_trace=True).kernel_table == ()  # only on request
    assert summarize([e for e in trace if e.activity != "kernel"], gpu_trace=False, kernel_table=True).kernel_table \
        == ()


def gpu_range(name: str, start: float, end: float) -> TraceEvent:
    return TraceEvent(name, "gpu_user_annotation", start, end)


def test_kernels_attributed_to_their_layer_ranges():
    """A kernel inside a layer's (or the LM head's) GPU range is that layer's; the rest of the step is outside."""
    trace = [mark(0, 100), gpu_range(STEP_MARK, 0, 120),
             kernel("embed", 1, 2),
             gpu_range(f"{LAYER_MARK}0", 3, 20), kernel("a", 3, 5), kernel("b", 6, 10), kernel("c", 12, 20),
             gpu_range(f"{LAYER_MARK}1", 21, 40), kernel("a", 21, 30), kernel("b", 31, 40),
             gpu_range(HEAD_MARK, 41, 60), kernel("gemm", 41, 60),
             kernel("sample", 70, 80), kernel("copy", 90, 120),
             kernel("earlier", -10, -2)]  # before the step: not counted
    got = attribute_kernels(trace)
    assert got == LayerKernels((3, 2), 1, 3, 9)
    assert "2.5 per layer (min 2, max 3, 2 layers) | LM head 1 | outside the layers 3 | total 9" in got.columns()
    host_only = [e for e in trace if e.activity != "kernel"]
    assert attribute_kernels(host_only) is None  # a CPU trace has no kernels to attribute
    assert attribute_kernels([e for e in trace if not e.name.startswith(LAYER_MARK)]) is None  # no layer ranges
    with pytest.raises(ValueError, match="record_function"):
        attribute_kernels([kernel("a", 0, 1)])


def test_layer_ranges_wrap_each_layer_and_go_away():
    """layer_ranges() opens one host range per layer forward and one around the head, nested in the step; none
    after the block."""
    layers = nn.ModuleList(nn.Linear(8, 8) for _ in range(3))
    head = nn.Linear(8, 4)
    x = torch.randn(2, 8)

    def step():
        h = x
        for layer in layers:
            h = layer(h)
        return head(h)

    def host_ranges(events):
        return [e.name for e in events if e.activity == "user_annotation" and e.name != STEP_MARK
                and not e.name.startswith("ProfilerStep")]

    with layer_ranges(layers, head):
        events = record_steps(step, 1, torch.device("cpu"))
    assert host_ranges(events) == [f"{LAYER_MARK}0", f"{LAYER_MARK}1", f"{LAYER_MARK}2", HEAD_MARK]
    step_mark = next(e for e in events if e.name == STEP_MARK)
    assert all(step_mark.start_us <= e.start_us <= e.end_us <= step_mark.end_us for e in events
               if e.name.startswith((LAYER_MARK, HEAD_MARK)))
    assert host_ranges(record_steps(step, 1, torch.device("cpu"))) == []  # the hooks are removed


def test_uniform_touched():
    assert uniform_touched(256, 6, 1) == pytest.approx(6)
    assert uniform_touched(8, 8, 3) == pytest.approx(8)
    assert uniform_touched(256, 6, 32) == pytest.approx(256 * (1 - (250 / 256) ** 32))
    assert uniform_touched(256, 6, 10_000) == pytest.approx(256)


def test_cache_bytes_by_layer_kind():
    """Tiny config: layers SWA, CSA, HCA 8, CSA (window 16, index_topk 4). Per request of n tokens: min(n, 16)
    window entries per layer; CSA: n // 4 indexer keys and min(n // 4, 4) entries; HCA: n // 8 entries."""
    config = DeepseekV4Config.from_dict(TINY)
    kv, idx = 100, 7
    got = cache_bytes(config, [10, 40], kv, idx)
    assert got == CacheBytes(window=4 * (10 + 16) * kv, compressed=(2 * (2 + 4) + (1 + 5)) * kv,
                             index_keys=2 * (2 + 10) * idx)
    assert got.total == got.window + got.compressed + got.index_keys


def test_decode_floor_sums_what_a_step_reads():
    mb = ModelBytes({"float8_e4m3fn": 1000, "float32": 500, "bfloat16": 2000}, embedding=1024, embedding_row=8,
                    lm_head=900, experts=(ExpertLayer(0, 50, 9, 0, 8, True), ExpertLayer(1, 40, 8, 0, 8, False)))
    config = DeepseekV4Config.from_dict(TINY)  # 8 experts, 2 per token
    floor = decode_floor(mb, config, 3, 10, 100, 7, {0: 5, 1: 4}, 2.0, "cuda", 0.004)
    weights = 3500 - 1024 + 3 * 8
    cache = cache_bytes(config, [10] * 3, 100, 7).total
    assert floor.weight_bytes == weights and floor.lm_head_bytes == 900
    assert floor.expert_bytes == (5 + 1) * 50 + 4 * 40 and floor.experts_touched == 4.5 and floor.experts_counted
    assert floor.total_bytes == weights + floor.expert_bytes + cache
    assert floor.floor_ms == pytest.approx(floor.total_bytes / 2e9 * 1e3)
    assert floor.fraction == pytest.approx(floor.floor_ms / 4.0)
    assert "fraction of the floor" in floor.columns() and "counted" in floor.columns()
    # No count: the uniform-routing estimate; no bandwidth or no timed step: n/a
    est = decode_floor(mb, config, 3, 10, 100, 7, None, None, "cpu", float("nan"))
    assert est.expert_bytes == pytest.approx((uniform_touched(8, 2, 3) + 1) * 50 + uniform_touched(8, 2, 3) * 40)
    assert not est.experts_counted and est.floor_ms is None and est.fraction is None and est.step_ms is None
    assert est.columns().count("n/a") == 3 and "uniform estimate" in est.columns()


def test_copy_bandwidth_on_cpu():
    gbps = copy_bandwidth_gbps(torch.device("cpu"), 8 << 20, iters=3)
    assert 0.01 < gbps < 10_000


@pytest.fixture
def kept_on_cpu(monkeypatch):
    """The GPU's choice on CPU: FP8 linears and MXFP4 experts kept, their Triton kernels run by the interpreter."""
    import sglang.srt.model_loader.model_builder as model_builder

    monkeypatch.setenv("TRITON_INTERPRET", "1")
    monkeypatch.setattr(model_builder, "fp8_linears_supported", lambda device: True)
    monkeypatch.setattr(model_builder, "mxfp4_experts_supported", lambda device: True)


def test_model_bytes_of_the_quantized_tiny_model(kept_on_cpu):
    """Every parameter by stored format, against an independent sum of the parameters' storages; the MXFP4 experts'
    bytes per expert from the config (codes: half a byte per weight; scales: a byte per 32)."""
    eng = engine("tiny", quantize=True, disable_cuda_graph=True)
    try:
        model, config = eng.model_runner.model, eng.model_runner.model_config
        mb = model_bytes(model)
        storages = {}
        for name, p in model.named_parameters():
            kind = "experts" if ".ffn.experts." in name else str(p.dtype).removeprefix("torch.")
            storages[p.untyped_storage().data_ptr()] = (kind, p.untyped_storage().nbytes())
        independent: dict = {}
        for kind, size in storages.values():
            independent[kind] = independent.get(kind, 0) + size
        assert mb.expert_total == independent.pop("experts")
        assert mb.by_dtype == independent
        assert {"float8_e4m3fn", "float32"} <= set(mb.by_dtype)  # FP8 linears and their fp32 scales
        d, i = config.hidden_size, config.moe_intermediate_size
        per_expert = 3 * d * i // 2 + 3 * d * i // 32
        assert [(e.bytes_per_expert, e.stored, e.routed, e.shared_fused) for e in mb.experts] == \
            [(per_expert, config.n_routed_experts, config.n_routed_experts, False)] * config.num_hidden_layers
        assert mb.lm_head == config.vocab_size * d * model.head.weight.element_size()
        assert mb.embedding_row * config.vocab_size == mb.embedding
    finally:
        eng.shutdown()


def test_bench_one_batch_floor_and_kernel_table(monkeypatch, capsys, tmp_path):
    """--kernel-table is off by default; the floor rows follow the profiles, one per batch, in the JSON too, the
    experts counted in the attribution step (estimated without a profile)."""
    from sglang import bench_one_batch

    base = ["bench_one_batch", "--model-path", "tiny-deepseek-v4", "--batch-size", "1", "3", "--input-len", "24",
            "--output-len", "3", "--prefill-repeats", "1"]
    monkeypatch.setattr(sys, "argv", base)
    assert bench_one_batch.parse_args()[0].kernel_table is False
    for profile_steps in (1, 0):
        out = tmp_path / f"r{profile_steps}.jsonl"
        monkeypatch.setattr(sys, "argv", base + ["--kernel-table", "--profile-steps", str(profile_steps),
                                                 "--result-filename", str(out)])
        bench_one_batch.main()
        printed = capsys.readouterr().out.splitlines()
        floors = [ln for ln in printed if "| floor |" in ln]
        assert [ln.split("|")[0].split()[1] for ln in floors] == ["1", "3"]
        heading = printed.index(floors[0]) - 1
        assert printed[heading].startswith("bytes floor of a decode step") and "a CPU memcpy" in printed[heading]
        records = [json.loads(ln) for ln in out.read_text().splitlines()]
        rates = [ln for ln in printed if "GFLOP/token" in ln]  # the prefill by the model's FLOPs, no rate off a GPU
        assert len(rates) == 2 and "no matmul rate off a GPU" in printed[printed.index(rates[0]) - 1]
        for r in records:
            assert r["prefill_tflops"] == pytest.approx(r["batch_size"] * 24 * r["prefill_gflop_per_token"] / 1e3
                                                        / r["prefill_latency_s"])
            assert r["prefill_matmul_fraction"] is None
            f = r["floor"]
            assert f["experts_counted"] == (profile_steps > 0) and f["copy_device"] == "cpu"
            assert f["context_len"] == 24 + 3 // 2 and f["fraction"] == pytest.approx(
                f["floor_ms"] / (r["median_decode_latency_s"] * 1e3))
            assert r["layer_kernels"] is None  # no GPU trace on CPU
            if profile_steps:
                assert r["profile"]["kernel_table"] == []  # no GPU kernels on CPU
        counted = records[0]["floor"]["experts_touched"]
        if profile_steps:  # one token, 2 of 8 experts per layer (hash layers included)
            assert counted == 2
        else:
            assert counted == pytest.approx(uniform_touched(8, 2, 1))


def test_profile_report_prints_kernels_per_layer_and_the_table():
    from sglang.bench_one_batch import BenchResult, profile_report

    class Args:
        profile_steps, kernel_table = 2, True

    table = (KernelRow("gemm", 24.0, 0.5, 0.75), KernelRow("at::native::vectorized_elementwise_kernel", 100.0, 0.1,
                                                           0.25))
    profile = StepProfile(2, 1.0, 0.6, 0.6, 130.0, 3.0, 0.0, (("void gemm<1>()", 0.5, 24.0),), 0.0, table)
    r = BenchResult(1, 16, 4, 0.01, 1600.0, 0.002, 500.0, profile=profile,
                    layer_kernels=LayerKernels((10, 12), 4, 104, 130))
    lines = profile_report([r], Args, torch.device("cuda"), engine_layers=2)
    text = "\n".join(lines)
    assert "kernels/step 130.0 | kernels/layer 65.0 (kernels/step / 2 layers)" in text
    assert "11.0 per layer (min 10, max 12, 2 layers) | LM head 4 | outside the layers 104" in text
    rows = [ln for ln in lines if ln.endswith(("gemm", "vectorized_elementwise_kernel"))]
    assert len(rows) == 2 and "75.0%" in rows[0] and "100.0x" in rows[1]
    assert "void gemm<1>()" not in text  # the table replaces the top kernels
    Args.kernel_table = False
    r.profile = StepProfile(2, 1.0, 0.6, 0.6, 130.0, 3.0, 0.0, (("void gemm<1>()", 0.5, 24.0),), 0.0)
    assert "void gemm<1>()" in "\n".join(profile_report([r], Args, torch.device("cuda"), engine_layers=2))
    assert math.isclose(sum(k.share for k in table), 1.0)


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU (device tool)")
def test_gpu_bench_attributes_graph_kernels_to_layers(monkeypatch, capsys, tmp_path):
    """On a GPU, decode replays CUDA graphs: the eager run of the captured forward puts every layer's kernels in its
    range (the profiler's GPU twins), the LM head's in its own, and the floor divides by a device copy."""
    from sglang import bench_one_batch

    out = tmp_path / "r.jsonl"
    monkeypatch.setattr(sys, "argv", ["bench_one_batch", "--model-path", "tiny-deepseek-v4", "--batch-size", "1", "3",
                                      "--input-len", "64", "--output-len", "8", "--profile-steps", "2",
                                      "--prefill-repeats", "1", "--cuda-graph-bs", "1", "2", "4", "--kernel-table",
                                      "--result-filename", str(out)])
    bench_one_batch.main()
    print("\n".join(ln for ln in capsys.readouterr().out.splitlines() if "kernel" in ln or "floor" in ln))
    for r in (json.loads(ln) for ln in out.read_text().splitlines()):
        layers, profile, floor = r["layer_kernels"], r["profile"], r["floor"]
        assert layers is not None and len(layers["per_layer"]) == 4 and min(layers["per_layer"]) > 0, layers
        assert layers["lm_head"] > 0 and layers["outside"] >= 0
        assert sum(layers["per_layer"]) + layers["lm_head"] + layers["outside"] == layers["total"]
        print(f"batch {r['batch_size']}: graph step {profile['kernels_per_step']} kernels, eager attribution "
              f"{layers['total']}")
        assert profile["kernel_table"] and sum(k["share"] for k in profile["kernel_table"]) == pytest.approx(1.0)
        assert sum(k["runs_per_step"] for k in profile["kernel_table"] if not k["name"].startswith("Mem")) == \
            pytest.approx(profile["kernels_per_step"])
        assert floor["copy_device"] == "cuda" and floor["copy_gbps"] > 100 and 0 < floor["fraction"] < 1.5
