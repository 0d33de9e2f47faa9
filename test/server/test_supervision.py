"""The HTTP side never leaves a request waiting on a scheduler that stopped answering, and bounds what clients can
pile up: the real TokenizerManager and app, over a fake scheduler on the other end of its ZMQ sockets (it answers
only what a test pushes, so a hung or silent scheduler is exact). A receive loop that dies fails every pending request
and /health; the watchdog fails requests when no step is reported for --watchdog-timeout and recovers with the next
step; --max-queued-requests answers 429 with Retry-After; a consumer that stops reading is cut off and its request
aborted; background responses are bounded. The same against a real server: test_hardening_supervision.py."""

from __future__ import annotations

import asyncio
import os

import httpx
import pytest

from sglang.srt.entrypoints.http_server import create_app
from sglang.srt.managers import tokenizer_manager
from sglang.srt.managers.io_struct import AbortReq, SchedulerReady, TokenizedGenerateReqInput, new_channel_key
from sglang.srt.managers.tokenizer_manager import RequestError, TokenizerManager
from sglang.srt.sampling.sampling_params import SamplingParams
from sglang.srt.server_args import ServerArgs
from test_tokenizer_manager_rids import FakeScheduler, _output

BODY = {"input_ids": [5, 6, 7], "sampling_params": {"max_new_tokens": 2}}
LENGTH = {"type": "length", "length": 2}


@pytest.fixture()
def make(tmp_path):
    """make(max_running=4, **TokenizerManager kwargs) -> (tm, FakeScheduler)."""
    made = []

    def build(max_running: int = 4, **kwargs):
        ready = SchedulerReady(model_path="fake", context_length=64, vocab_size=100, max_total_tokens=64,
                               max_running_requests=max_running, eos_token_ids=[1], pool_report="")
        n = len(made)
        sched_in, tok_in = (f"ipc://{os.path.join(tmp_path, f'{side}{n}')}" for side in "st")
        key = new_channel_key()
        tm = TokenizerManager(None, ready, sched_in, tok_in, channel_key=key, **kwargs)
        made.append((tm, FakeScheduler(tm.ctx, sched_in, tok_in, key)))
        return made[-1]

    yield build
    for tm, scheduler in made:
        scheduler.close()
        tm.close()


def serve(tm: TokenizerManager, scenario) -> None:
    """Run scenario(client) against the app over `tm`, lifespan included."""
    async def main():
        app = create_app(tm, ServerArgs(model_path="fake"))
        async with app.router.lifespan_context(app):
            transport = httpx.ASGITransport(app=app)
            async with httpx.AsyncClient(transport=transport, base_url="http://server", timeout=60) as client:
                await asyncio.wait_for(scenario(client), 60)  # a hang fails the test instead of stalling it

    asyncio.run(main())


async def until(condition, timeout: float = 30.0) -> None:
    deadline = asyncio.get_running_loop().time() + timeout
    while not await condition():
        assert asyncio.get_running_loop().time() < deadline, "condition not met in time"
        await asyncio.sleep(0.05)


async def requests_sent(scheduler: FakeScheduler, n: int) -> list:
    sent = [await scheduler.next() for _ in range(n)]
    assert all(isinstance(s, TokenizedGenerateReqInput) for s in sent), sent
    return sent


def test_a_dead_receive_loop_fails_every_pending_request_and_health(make, monkeypatch):
    tm, scheduler = make()

    async def scenario(client):
        pending = [asyncio.create_task(client.post("/generate", json=BODY)) for _ in range(3)]
        sent = await requests_sent(scheduler, 3)
        assert (await client.get("/health")).status_code == 200

        def broken(batch):
            raise RuntimeError("injected: the receive loop dies")

        monkeypatch.setattr(tm, "_dispatch", broken)
        await scheduler.answer(_output(sent[0].rid, [11]))  # the loop dies handling it
        for r in await asyncio.gather(*pending):
            assert r.status_code == 503 and "stopped receiving from the scheduler" in r.json()["message"], r.text
        health = await client.get("/health")
        assert health.status_code == 503 and "stopped receiving" in health.text
        refused = await client.post("/generate", json=BODY)
        assert refused.status_code == 503 and "restart the server" in refused.json()["message"]
        aborted = [await scheduler.next() for _ in range(3)]  # the scheduler still ran them: freed there
        assert all(isinstance(a, AbortReq) for a in aborted) and {a.rid for a in aborted} == {s.rid for s in sent}

    serve(tm, scenario)


def test_watchdog_fails_requests_of_a_silent_scheduler_and_recovers(make):
    tm, scheduler = make(watchdog_timeout=0.5)

    async def scenario(client):
        first = asyncio.create_task(client.post("/generate", json=BODY))
        (sent,) = await requests_sent(scheduler, 1)
        r = await first  # no step is ever reported: the watchdog fails it
        assert r.status_code == 503 and "watchdog" in r.json()["message"], r.text
        abort = await scheduler.next()  # and aborts it, so a scheduler that goes on frees it
        assert isinstance(abort, AbortReq) and abort.rid == sent.rid
        health = await client.get("/health")
        assert health.status_code == 503 and "--watchdog-timeout" in health.text
        refused = await client.post("/generate", json=BODY)
        assert refused.status_code == 503 and "no step" in refused.json()["message"]

        await scheduler.answer()  # a step completes: serving resumes
        await until(lambda: _status(client, "/health", 200))
        second = asyncio.create_task(client.post("/generate", json=BODY))
        (sent,) = await requests_sent(scheduler, 1)
        await scheduler.answer(_output(sent.rid, [11, 12], LENGTH))
        r = await second
        assert r.status_code == 200 and r.json()["output_ids"] == [11, 12]

    serve(tm, scenario)


async def _status(client, path: str, status: int) -> bool:
    return (await client.get(path)).status_code == status


def test_watchdog_counts_only_requests_the_scheduler_owes(make):
    """Steps reported without output for a request keep it alive past the timeout; a finished request whose output
    waits for its consumer owes the scheduler nothing."""
    tm, scheduler = make(watchdog_timeout=1.5)

    async def scenario():
        tm.start()
        gen = tm.generate([5, 6, 7], SamplingParams(max_new_tokens=2))
        reading = asyncio.ensure_future(gen.__anext__())
        (sent,) = await requests_sent(scheduler, 1)
        for _ in range(35):  # 3.5 s of steps that do not serve it (a long prefill of another request)
            await scheduler.answer()
            await asyncio.sleep(0.1)
        await scheduler.answer(_output(sent.rid, [11]))
        assert (await reading).output_ids == [11]
        await scheduler.answer(_output(sent.rid, [12], LENGTH))
        await asyncio.sleep(3.5)  # its last output waits unread
        assert tm.unavailable() is None
        last = await gen.__anext__()
        assert last.finished and last.output_ids == [11, 12]

    asyncio.run(asyncio.wait_for(scenario(), 60))


def test_full_queue_is_429_with_retry_after(make):
    tm, scheduler = make(max_running=2, max_queued_requests=1)

    async def scenario(client):
        accepted = [asyncio.create_task(client.post("/generate", json=BODY)) for _ in range(3)]
        sent = await requests_sent(scheduler, 3)
        for body in (BODY, {**BODY, "stream": True}):  # a stream is refused before it starts
            r = await client.post("/generate", json=body)
            assert r.status_code == 429 and r.headers["retry-after"] == "1", r.text
            err = r.json()
            assert err["type"] == "RateLimitError" and err["code"] == 429 and "--max-queued-requests" in err["message"]
            assert err["error"]["message"] == err["message"]
        await scheduler.answer(_output(sent[0].rid, [11, 12], LENGTH))
        assert (await accepted[0]).status_code == 200
        late = asyncio.create_task(client.post("/generate", json=BODY))  # room again
        sent = sent[1:] + await requests_sent(scheduler, 1)
        await scheduler.answer(*(_output(s.rid, [11, 12], LENGTH) for s in sent))
        assert [r.status_code for r in await asyncio.gather(*accepted[1:], late)] == [200] * 3

    serve(tm, scenario)


def test_a_consumer_that_stops_reading_is_cut_off_and_aborted(make):
    tm, scheduler = make()
    tm.max_buffered_tokens = 4

    async def scenario():
        tm.start()
        gen = tm.generate([5, 6, 7], SamplingParams(max_new_tokens=50))
        reading = asyncio.ensure_future(gen.__anext__())
        (sent,) = await requests_sent(scheduler, 1)
        await scheduler.answer(_output(sent.rid, [10]))
        assert (await reading).output_ids == [10]
        for token in range(11, 17):  # nobody reads: 4 tokens wait, the 5th cuts it off
            await scheduler.answer(_output(sent.rid, [token]))
        abort = await scheduler.next()
        assert isinstance(abort, AbortReq) and abort.rid == sent.rid
        seen = [(await gen.__anext__()).output_ids[-1] for _ in range(4)]  # what waited is delivered, then the error
        assert seen == [11, 12, 13, 14]
        with pytest.raises(RequestError, match="did not read its stream") as e:
            await gen.__anext__()
        assert e.value.status_code == tokenizer_manager.SLOW_CLIENT_STATUS
        assert not tm.states

    asyncio.run(asyncio.wait_for(scenario(), 60))


def test_a_scheduler_that_takes_no_message_is_a_503(make, monkeypatch):
    tm, _ = make()
    monkeypatch.setattr(tokenizer_manager, "SEND_TIMEOUT_S", 0.2)

    async def scenario():
        tm.start()
        sent = []

        def never(msg):  # its input queue is full
            sent.append(msg)
            return asyncio.get_running_loop().create_future()

        monkeypatch.setattr(tm.send, "send_pyobj", never)
        with pytest.raises(RequestError, match="has taken no message") as e:
            await tm.generate([5, 6, 7], SamplingParams(max_new_tokens=2)).__anext__()
        assert e.value.status_code == 503 and not tm.states
        assert [type(m) for m in sent] == [TokenizedGenerateReqInput]  # never sent: no abort follows it

    asyncio.run(asyncio.wait_for(scenario(), 60))


def test_background_responses_are_bounded(app, monkeypatch):
    tm, client = app
    store = client.app.state.responses
    store.max_background = 2
    tm.script, tm.token_delay = "Sunny all week.", 0.5
    body = {"model": "scripted", "input": "weather?", "background": True}
    first, second = (client.post("/v1/responses", json=body).json() for _ in range(2))
    r = client.post("/v1/responses", json=body)
    assert r.status_code == 429 and r.headers["retry-after"] == "1" and r.json()["param"] == "background", r.text
    assert client.post(f"/v1/responses/{first['id']}/cancel").json()["status"] == "cancelled"
    third = client.post("/v1/responses", json=body)
    assert third.status_code == 200 and third.json()["status"] == "queued"
    client.post(f"/v1/responses/{second['id']}/cancel")

    def full():
        raise RequestError("the server is at capacity", 429, headers={"Retry-After": "1"})

    monkeypatch.setattr(tm, "check_queue", full, raising=False)  # a full queue refuses a background request too
    client.post(f"/v1/responses/{third.json()['id']}/cancel")
    r = client.post("/v1/responses", json=body)
    assert r.status_code == 429 and "capacity" in r.json()["message"]
