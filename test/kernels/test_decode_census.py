"""benchmark/kernels/decode_census.py: the counting rule on single ops, and one decode step of the tiny model on the
simulated GPU, whose census adds up (per layer to the total) and shows every layer on its GPU path."""

from __future__ import annotations

import json
import os

import pytest
import torch

from benchmark_module import load_benchmark

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))


dc = load_benchmark("decode_census")


def _count(fn) -> dict:
    census = dc.Census()
    census.active = True
    with dc.counting(census):
        fn()
    return dict(census.current.by_site)


def test_counting_rule_views_allocations_and_no_op_casts_launch_nothing():
    x = torch.randn(3, 8)
    free = _count(lambda: (x.view(8, 3), x[1:], x.t(), x.float(), x.contiguous(), torch.empty(4), x.reshape(24)))
    assert free == {}
    paid = _count(lambda: (x.to(torch.bfloat16), x + 1, x.t().contiguous(), torch.zeros(3), x[[0, 2]]))
    assert sorted(k.split(" @ ")[0] for k in paid) == ["_to_copy", "add", "clone", "index", "zeros"], paid
    assert all(k.endswith(" @ ?") for k in paid)  # no frame in python/sglang or sgl_kernel


def test_call_site_is_the_innermost_engine_frame():
    from sglang.srt.layers.attention.dsv4.hadamard import hadamard_rotate

    x = torch.randn(2, 8)
    sites = _count(lambda: hadamard_rotate(x))
    assert sites and all("sgl_kernel/dsv4_formats_ref.py:" in k or "dsv4/hadamard.py:" in k for k in sites), sites


def test_device_tensor_checks_only_inside_the_simulation():
    from sglang.srt.platform import simulate_platform

    x = torch.zeros(2)
    with simulate_platform("cuda"), dc.device_tensor_checks():
        assert x.is_cuda
    assert not x.is_cuda
    with dc.device_tensor_checks():  # no simulated GPU: CPU tensors stay CPU tensors
        assert not x.is_cuda


@pytest.fixture(scope="module")
def census():
    torch.set_num_threads(1)
    return dc.take_census(input_len=9)


def test_decode_census_adds_up(census, tmp_path):
    scopes = census.scopes
    layers = [s for name, s in scopes.items() if name != dc.OUTSIDE]
    assert [s.name for s in layers] == [f"layer {i}" for i in range(4)]
    assert [s.kind for s in layers] == ["SWA hash", "CSA hash", "HCA", "CSA"]
    assert census.total == sum(s.total for s in scopes.values())
    for s in scopes.values():
        assert sum(s.by_site.values()) == s.total + s.host_reads
        assert s.host_reads == 0  # the captured step reads nothing back
    out = tmp_path / "census.json"
    out.write_text(json.dumps(dc.to_json(census)))
    data = json.loads(out.read_text())
    assert data["total"] == census.total == sum(s["total"] for s in data["scopes"])
    assert any(line.startswith("CSA") for line in dc.report(census))


def _launches(scope, kernel: str) -> int:
    return sum(n for k, n in scope.by_site.items() if k.split(" @ ")[0] == kernel)


def test_decode_census_carries_the_mixes(census):
    """Each hc_post writes the next sub-layer's mixes (the next layer's, the HC head's after the last layer): only
    the first layer's first hc_pre computes its own, so a layer's mHC is 2 + 2 launches (3 + 3 without the carry)
    and the HC head one."""
    for name, s in census.scopes.items():
        if name == dc.OUTSIDE:
            assert _launches(s, "_dsv4_hc_mixes_kernel") == 0 and _launches(s, "_dsv4_hc_pre_kernel") == 1
            continue
        assert _launches(s, "_dsv4_hc_post_mixes_kernel") == 2 and _launches(s, "_dsv4_hc_post_kernel") == 0, name
        assert _launches(s, "_dsv4_hc_pre_kernel") == 2, name
        assert _launches(s, "_dsv4_hc_mixes_kernel") == (1 if name == "layer 0" else 0), name


def test_decode_census_takes_the_gpu_paths(census):
    """Every layer runs sgl_kernel's attention and mHC kernels (mHC dispatches on `x.is_cuda`), the CSA layers the
    indexer's, and the metadata is built outside the layers, in one launch."""
    for name, s in census.scopes.items():
        kernels = {k.split(" @ ")[0] for k in s.by_site}
        if name == dc.OUTSIDE:
            assert "_dsv4_hc_pre_kernel" in kernels  # the HC head
            # the attention metadata and the step's slot writes: one launch each, no torch op of theirs
            assert {"_dsv4_decode_metadata_kernel", "_dsv4_write_slots_kernel"} <= kernels
            assert not [k for k in s.by_site if "attention/dsv4/" in k or "deepseek_v4_allocator.py" in k], s.by_site
            assert sum(n for k, n in s.by_site.items() if k.startswith("_dsv4_decode_metadata_kernel")) == 1
            continue
        assert {"_dsv4_sparse_attention_kernel", "_dsv4_store_kv_kernel", "_dsv4_hc_pre_kernel",
                "_dsv4_hc_post_mixes_kernel"} <= kernels, (name, kernels)
        if s.kind.startswith("CSA"):
            assert {"_dsv4_index_logits_kernel", "_topk_level_kernel", "_dsv4_compress_kernel"} <= kernels


def test_aot_check_plans_every_kernel_the_decode_step_launches(census):
    """Drift guard of sgl_kernel.aot_check's launch plan: every Triton kernel the tiny engine's decode step launches
    is among the plan's launches (by kernel name) on the NVIDIA and AMD targets."""
    import subprocess
    import sys

    env = {k: v for k, v in os.environ.items() if k != "TRITON_INTERPRET"}
    run = subprocess.run([sys.executable, "-m", "sgl_kernel.aot_check", "--list", "--dedupe", "path", "--target",
                          "sm90", "gfx950"], env=env, capture_output=True, text=True, timeout=600)
    assert run.returncode == 0, run.stderr[-2000:]
    planned = {}
    for line in run.stdout.splitlines():
        target, kernel = line.split("\t")[:2]
        planned.setdefault(target, set()).add(kernel)
    launched = {k.split(" @ ")[0] for s in census.scopes.values() for k, n in s.by_site.items()}
    triton_kernels = {k for k in launched if k.startswith("_") and k.endswith("_kernel")}
    assert {"_dsv4_sparse_attention_kernel", "_router_kernel", "_dsv4_compressor_proj_kernel"} <= triton_kernels
    for target, kernels in planned.items():
        assert triton_kernels <= kernels, (target, sorted(triton_kernels - kernels))


def test_prefill_census_counts_the_prompt_forward():
    """--prefill: the eager forward that prefills one prompt, scoped by layer; past the rows whose mixes hc_post
    carries (16) every sub-layer computes its own (the mixes, hc_pre's finish, an hc_post without the next mixes)."""
    torch.set_num_threads(1)
    census = dc.take_census(input_len=40, prefill_forward=True)
    layers = [s for name, s in census.scopes.items() if name != dc.OUTSIDE]
    assert [s.kind for s in layers] == ["SWA hash", "CSA hash", "HCA", "CSA"]
    assert census.total == sum(s.total for s in census.scopes.values())
    mhc = ("_dsv4_hc_mixes_kernel", "_dsv4_hc_pre_kernel", "_dsv4_hc_post_kernel", "_dsv4_hc_post_mixes_kernel")
    for s in layers:
        assert [_launches(s, k) for k in mhc] == [2, 2, 2, 0], s.name
    assert dc.report(census, what="prefill forward, 40 tokens")[0].startswith("prefill forward, 40 tokens: ")
