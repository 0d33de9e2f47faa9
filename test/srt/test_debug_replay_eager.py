"""scripts/debug_replay_eager.py, the tool that locates where two runs part (replay / eager / backends), on CPU:
two runs of one path report no difference; a MoE output perturbed at one decode step is reported at that step as
the first differing recorded tensor, and the pools it then changes are listed after it."""

from __future__ import annotations

import argparse
import importlib.util
import os

import pytest

_PATH = os.path.join(os.path.dirname(__file__), "..", "..", "scripts", "debug_replay_eager.py")


@pytest.fixture(scope="module")
def tool():
    spec = importlib.util.spec_from_file_location("debug_replay_eager", _PATH)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def _args() -> argparse.Namespace:
    return argparse.Namespace(config="tiny", kv_cache_dtype="fp8_e4m3", dtype="bfloat16", device="cpu", radix=False,
                              warm=False)


def test_same_path_twice_reports_no_difference(tool):
    a, lps_a = tool.run_side(_args(), "torch:replay")
    b, lps_b = tool.run_side(_args(), "torch:eager")
    assert lps_a == lps_b and len(a) == len(b)
    assert tool.first_difference(a, b) is None
    decode = [s for s in a if "layers.2.ffn #13" in s]  # static decode forwards were recorded, op by op
    assert decode and "sparse_attention #0" in decode[0] and "compressed_kv[2]" in decode[0]


def test_perturbed_step_is_located(tool):
    calls = {"n": 0}

    def perturb(eng):
        moe = dict(eng.model_runner.model.named_modules())["layers.2.ffn"]

        def hook(module, inputs, out):
            if out.shape[0] in (1, 2, 3, 4, 8):  # decode forwards (the static path pads to these sizes)
                calls["n"] += 1
                if calls["n"] == 3:
                    out[0, 0] += 0.5
        moe.register_forward_hook(hook)

    a, _ = tool.run_side(_args(), "torch:eager")
    b, _ = tool.run_side(_args(), "torch:eager", setup=perturb)
    step, diffs = tool.first_difference(a, b)
    assert calls["n"] >= 3
    assert diffs[0][0] == "layers.2.ffn #13" and "rows [0], 1 elements, max |diff| 0.5" in diffs[0][1]
    names = [name for name, _ in diffs]
    assert names.index("layers.2 #14") < names.index("window_kv[3]")  # outputs in forward order, then the pools
    assert tool.first_difference(a[:step], b[:step]) is None
