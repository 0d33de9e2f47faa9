"""The scheduler's torch profiler (managers/scheduler_profiler.py) through sglang.Engine in-process: a profile
records the scheduler steps between start and stop (or num_steps of them) into a gzipped Chrome trace holding the
model's ops; wrong requests are refused with a ValueError naming the problem, and a refused or finished profile
leaves the engine serving."""

from __future__ import annotations

import gzip
import json
import os

import pytest

import sglang
from sglang.srt.managers.scheduler_profiler import ProfileConfig


@pytest.fixture(scope="module")
def engine():
    eng = sglang.Engine(model_path="tiny-deepseek-v4", device="cpu", dtype="float32", log_level="warning")
    yield eng
    eng.shutdown()


def _trace_ops(path: str) -> set:
    with gzip.open(path, "rt") as f:
        events = json.load(f)["traceEvents"]
    return {e.get("name") for e in events}


def _generate(engine, tokens: int) -> dict:
    return engine.generate(input_ids=[5, 6, 7], sampling_params={"max_new_tokens": tokens, "temperature": 0,
                                                                 "ignore_eos": True})


def test_profile_until_stop_records_the_steps(engine, tmp_path):
    message = engine.start_profile(output_dir=str(tmp_path), profile_prefix="run", with_stack=False)
    assert "CPU" in message and "GPU" not in message  # the default asks for what a CPU has
    _generate(engine, 4)
    message = engine.stop_profile()
    (trace,) = [p for p in os.listdir(tmp_path) if p.endswith(".trace.json.gz")]
    assert trace.startswith("run-") and trace.endswith("-TP-0.trace.json.gz") and trace in message
    steps = engine.scheduler.profiler.steps
    assert steps >= 4 and f"({steps} scheduler steps recorded)" in message  # a prefill and 3+ decodes
    ops = _trace_ops(str(tmp_path / trace))
    assert {"aten::mm", "aten::embedding"} & ops, sorted(ops)[:40]  # the model's forward is in it
    assert not engine.scheduler.profiler.active


def test_profile_of_num_steps_stops_by_itself(engine, tmp_path):
    engine.start_profile(output_dir=str(tmp_path), num_steps=2, activities=["CPU"])
    _generate(engine, 6)  # more steps than the profile's
    profiler = engine.scheduler.profiler
    assert not profiler.active and profiler.steps == 2
    assert [os.path.basename(p) for p in profiler.last_paths] == os.listdir(tmp_path)
    with pytest.raises(ValueError, match="no profile is running"):
        engine.stop_profile()


def test_bad_profile_requests_are_refused(engine, tmp_path):
    with pytest.raises(ValueError, match="activities"):
        engine.start_profile(activities=["TPU"])
    with pytest.raises(ValueError, match="activities"):
        engine.start_profile(activities=[])
    with pytest.raises(ValueError, match="num_steps"):
        engine.start_profile(num_steps=0)
    with pytest.raises(ValueError, match="need a CUDA device"):
        engine.start_profile(activities=["CPU", "MEM"])
    blocker = tmp_path / "file"
    blocker.write_text("")
    with pytest.raises(ValueError, match="output_dir"):
        engine.start_profile(output_dir=str(blocker / "sub"))
    assert not engine.scheduler.profiler.active
    engine.start_profile(output_dir=str(tmp_path), activities=["CPU"])
    with pytest.raises(ValueError, match="already running"):
        engine.start_profile(output_dir=str(tmp_path))
    engine.stop_profile()
    assert _generate(engine, 2)["meta_info"]["completion_tokens"] == 2  # still serving


def test_config_defaults_come_from_the_environment(tmp_path, monkeypatch):
    from sglang.srt.environ import envs

    with envs.SGLANG_TORCH_PROFILER_DIR.override(str(tmp_path)), envs.SGLANG_PROFILE_WITH_STACK.override("0"):
        config = ProfileConfig.make()
    assert config.output_dir == str(tmp_path) and not config.with_stack and config.record_shapes
    monkeypatch.delenv(envs.SGLANG_PROFILE_WITH_STACK.name, raising=False)  # conftest.py sets it for every test
    assert ProfileConfig.make().with_stack  # unset: stacks are recorded
    assert config.activities == ("CPU", "GPU") and config.num_steps is None
