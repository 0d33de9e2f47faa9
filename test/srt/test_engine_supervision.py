"""sglang.Engine(launch_subprocess=True) shares the server's supervision: a scheduler process that hangs
(SGLANG_TEST_HANG_SCHEDULER_FILE) past --watchdog-timeout, or dies, ends the call with a RuntimeError naming it
instead of leaving it waiting forever; after a hang the engine serves again."""

from __future__ import annotations

import time

import pytest

import sglang
from oracle import checkpoint, random_ids
from sglang.srt.environ import envs

PARAMS = {"temperature": 0, "max_new_tokens": 4, "ignore_eos": True}


def test_subprocess_engine_fails_calls_on_a_hung_or_dead_scheduler(tmp_path):
    hang = tmp_path / "HANG"
    with envs.SGLANG_TEST_HANG_SCHEDULER_FILE.override(str(hang)):  # read by the spawned scheduler process
        eng = sglang.Engine(launch_subprocess=True, model_path=checkpoint("tiny"), device="cpu", dtype="float32",
                            page_size=16, log_level="error", max_running_requests=4, max_total_tokens=4096,
                            watchdog_timeout=2)
    try:
        ids = random_ids(12, 7)
        want = eng.generate(input_ids=ids, sampling_params=PARAMS)["output_ids"]
        hang.write_text("")
        with pytest.raises(RuntimeError, match="--watchdog-timeout"):
            eng.generate(input_ids=ids, sampling_params=PARAMS)
        hang.unlink()
        again, deadline = None, time.time() + 120
        while again is None and time.time() < deadline:  # refused until the scheduler completes a step again
            try:
                again = eng.generate(input_ids=ids, sampling_params=PARAMS)
            except RuntimeError as e:
                assert "--watchdog-timeout" in str(e)
                time.sleep(0.2)
        assert again is not None and again["output_ids"] == want
        eng._remote.proc.kill()
        eng._remote.proc.join(timeout=30)
        with pytest.raises(RuntimeError, match="the scheduler process died"):
            eng.generate(input_ids=ids, sampling_params=PARAMS)
    finally:
        eng.shutdown()
