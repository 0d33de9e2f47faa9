"""/health and /health_generate read the scheduler's state: 503 while its process is dead or its latest steps all
failed (then /health runs one token itself, so a server whose failures have passed comes back to 200 without
traffic). The HTTP app is driven with a fake tokenizer manager; the engine side is test/srt/test_step_isolation.py."""

from __future__ import annotations

from types import SimpleNamespace

import pytest
from fastapi.testclient import TestClient

from sglang.srt.entrypoints.http_server import create_app
from sglang.srt.managers.io_struct import UNHEALTHY_AFTER_FAILED_STEPS, SchedulerStats
from sglang.srt.managers.tokenizer_manager import RequestError
from sglang.srt.server_args import ServerArgs


def stats(failed_steps: int) -> SchedulerStats:
    return SchedulerStats(num_running_reqs=0, num_waiting_reqs=0, token_usage=0.0, num_generated_tokens=0,
                          consecutive_failed_steps=failed_steps)


class FakeTokenizerManager:
    """What /health and /health_generate read; generate() is one step that serves (or fails) as told."""

    def __init__(self, failed_steps, dead_reason, step_ok: bool) -> None:
        self.last_stats = None if failed_steps is None else stats(failed_steps)
        self.dead_reason, self.step_ok, self.num_steps = dead_reason, step_ok, 0
        self.ready = SimpleNamespace(eos_token_ids=[1])

    def unavailable(self):
        return self.dead_reason

    async def generate(self, input_ids, params):
        self.num_steps += 1
        if not self.step_ok:
            self.last_stats = stats(self.last_stats.consecutive_failed_steps + 1)
            raise RequestError("internal error in the model step", 500)
        self.last_stats = stats(0)
        yield None


@pytest.mark.parametrize("failed_steps, alive, dead_reason, step_ok, status, probes", [
    (None, True, None, True, 200, 0), (UNHEALTHY_AFTER_FAILED_STEPS - 1, True, None, False, 200, 0),
    (UNHEALTHY_AFTER_FAILED_STEPS, True, None, False, 503, 1),  # its own probe failed too
    (UNHEALTHY_AFTER_FAILED_STEPS, True, None, True, 200, 1),  # the failures have passed: back in rotation
    (0, False, None, True, 503, 0), (0, True, "the scheduler process died", True, 503, 0),
])
def test_health_reads_the_scheduler_state(failed_steps, alive, dead_reason, step_ok, status, probes):
    tm = FakeTokenizerManager(failed_steps, dead_reason, step_ok)
    proc = SimpleNamespace(is_alive=lambda: alive, exitcode=None if alive else -9,
                           describe_exit=lambda: "the scheduler process died (exit code -9)")
    client = TestClient(create_app(tm, ServerArgs(model_path="m"), scheduler_proc=proc))  # no lifespan needed
    assert client.get("/health").status_code == status
    assert tm.num_steps == probes
    assert client.get("/health_generate").status_code == (200 if alive and not dead_reason and step_ok else 503)
