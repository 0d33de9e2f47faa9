"""The scheduler's profiler on a GPU (skipped without CUDA; run through the device tool): the GPU activity records
the model's kernels, MEM writes a memory snapshot, CUDA graph replays are profiled too, and the engine keeps serving
afterwards."""

from __future__ import annotations

import gzip
import json
import os

import pytest
import torch

from oracle import engine

pytestmark = [pytest.mark.gpu,
              pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU (device tool)")]


def test_gpu_profile_records_kernels_and_memory(tmp_path):
    eng = engine("tiny", device="cuda", dtype="bfloat16")
    params = {"temperature": 0, "max_new_tokens": 8, "ignore_eos": True}
    eng.generate(input_ids=[5, 6, 7], sampling_params=params)  # warm: graphs captured before the profile
    eng.start_profile(output_dir=str(tmp_path), activities=["CPU", "GPU", "MEM"], with_stack=False)
    eng.generate(input_ids=[5, 6, 7], sampling_params=params)
    message = eng.stop_profile()
    files = sorted(os.listdir(tmp_path))
    assert [f for f in files if f.endswith("-TP-0.trace.json.gz")] and [f for f in files if f.endswith(
        "-TP-0-memory.pickle")], (files, message)
    trace = next(f for f in files if f.endswith(".trace.json.gz"))
    with gzip.open(tmp_path / trace, "rt") as f:
        events = json.load(f)["traceEvents"]
    kernels = [e for e in events if e.get("cat") == "kernel"]
    print(f"{len(events)} events, {len(kernels)} kernels: {message}")
    assert len(kernels) > 50  # a prefill and 7 decode steps of a 2-layer model
    assert eng.generate(input_ids=[5, 6, 7], sampling_params=params)["meta_info"]["completion_tokens"] == 8
