"""Client rids against the scheduler's ids: a client may reuse a rid the moment its earlier request was dropped, and
the earlier request's late answers (its abort) must not reach the new one. The TokenizerManager is real; the
scheduler is a fake on the other end of its ZMQ sockets that answers as the real one does (an abort is answered by
the aborted request's finished output, keyed by the id the tokenizer side sent)."""

from __future__ import annotations

import asyncio
import os

import pytest
import zmq
import zmq.asyncio

from sglang.srt.managers.io_struct import (AbortReq, BatchOutput, MessageCodec, ReqOutput, SchedulerReady,
                                           SchedulerStats, TokenizedGenerateReqInput, new_channel_key)
from sglang.srt.managers.tokenizer_manager import TokenizerManager
from sglang.srt.sampling.sampling_params import SamplingParams


def _output(rid: str, tokens: list, finished=None) -> ReqOutput:
    return ReqOutput(rid=rid, new_token_ids=tokens, new_logprobs=[0.0] * len(tokens),
                     new_top_logprobs=[None] * len(tokens), prompt_tokens=3, completion_tokens=len(tokens),
                     finished_reason=finished)


class FakeScheduler:
    """Receives what the TokenizerManager sends and answers with whatever the test pushes."""

    def __init__(self, ctx: zmq.asyncio.Context, scheduler_input: str, tokenizer_input: str, key: bytes) -> None:
        self.codec = MessageCodec(key)
        self.recv = ctx.socket(zmq.PULL)
        self.recv.bind(scheduler_input)
        self.send = ctx.socket(zmq.PUSH)
        self.send.connect(tokenizer_input)

    async def next(self):
        return await asyncio.wait_for(self.recv.recv_pyobj(), 10)

    async def answer(self, *outputs: ReqOutput) -> None:
        await self.send.send_multipart(self.codec.encode(BatchOutput(list(outputs), SchedulerStats(0, 0, 0.0, 0))))

    def close(self) -> None:
        self.recv.close(linger=0)
        self.send.close(linger=0)


@pytest.fixture()
def pair(tmp_path):
    ready = SchedulerReady(model_path="fake", context_length=64, vocab_size=100, max_total_tokens=64,
                           max_running_requests=4, eos_token_ids=[1], pool_report="")
    sched_in, tok_in = f"ipc://{os.path.join(tmp_path, 's')}", f"ipc://{os.path.join(tmp_path, 't')}"
    key = new_channel_key()
    tm = TokenizerManager(None, ready, sched_in, tok_in, channel_key=key)
    scheduler = FakeScheduler(tm.ctx, sched_in, tok_in, key)
    yield tm, scheduler
    scheduler.close()
    tm.close()


def test_a_reused_rid_never_gets_the_dropped_requests_abort(pair):
    tm, scheduler = pair

    async def scenario():
        params = SamplingParams(max_new_tokens=2)
        first = tm.generate([5, 6, 7], params, rid="x")
        reading = asyncio.ensure_future(first.__anext__())
        sent = await scheduler.next()
        assert isinstance(sent, TokenizedGenerateReqInput)
        await scheduler.answer(_output(sent.rid, [11]))
        chunk = await reading
        assert chunk.output_ids == [11] and not chunk.finished
        await first.aclose()  # the client went away: the tokenizer side aborts it and forgets it
        abort = await scheduler.next()
        assert isinstance(abort, AbortReq) and abort.rid == sent.rid

        # the same rid again, at once, before the scheduler has answered the abort
        second = tm.generate([5, 6, 7], params, rid="x")
        reading = asyncio.ensure_future(second.__anext__())
        again = await scheduler.next()
        assert isinstance(again, TokenizedGenerateReqInput)
        assert again.rid != sent.rid  # the scheduler can tell the two apart
        # the scheduler answers the abort (the first request's finished output), then serves the second
        await scheduler.answer(_output(sent.rid, [], {"type": "abort", "message": "request aborted"}),
                               _output(again.rid, [21]))
        assert (await reading).output_ids == [21]
        await scheduler.answer(_output(again.rid, [22], {"type": "length", "length": 2}))
        last = await second.__anext__()
        assert last.finished and last.output_ids == [21, 22]
        assert last.meta_info["id"] == "x" and last.meta_info["finish_reason"]["type"] == "length"
        await second.aclose()
        assert not tm.states

    asyncio.run(scenario())


def test_abort_matching_names_client_rids_and_sends_scheduler_ids(pair):
    tm, scheduler = pair

    async def scenario():
        gens = [tm.generate([5], SamplingParams(max_new_tokens=4), rid=r, group=g)
                for r, g in (("a-0", "a"), ("a-1", "a"), ("b", None))]
        readers = [asyncio.ensure_future(g.__anext__()) for g in gens]
        sids = {}
        for _ in gens:
            msg = await scheduler.next()
            sids[msg.rid.split(".")[0]] = msg.rid
        assert sorted(await tm.abort_matching("a")) == ["a-0", "a-1"]
        aborted = {(await scheduler.next()).rid for _ in range(2)}
        assert aborted == {sids["a-0"], sids["a-1"]}
        assert await tm.abort_matching("a") == []  # already aborting: not again
        # an aborted request's rid is free at once, before the scheduler has answered its abort
        reuse = tm.generate([5], SamplingParams(max_new_tokens=4), rid="a-0")
        reusing = asyncio.ensure_future(reuse.__anext__())
        fresh = await scheduler.next()
        assert isinstance(fresh, TokenizedGenerateReqInput) and fresh.rid != sids["a-0"]
        reusing.cancel()
        await asyncio.gather(reusing, return_exceptions=True)
        await reuse.aclose()
        assert (await scheduler.next()).rid == fresh.rid  # its abort
        await scheduler.answer(*(_output(s, [], {"type": "abort", "message": "request aborted"}) for s in aborted))
        for reader in readers[:2]:
            chunk = await reader
            assert chunk.finished and chunk.meta_info["finish_reason"]["type"] == "abort"
        with pytest.raises(Exception, match="already in use"):
            await tm.generate([5], SamplingParams(max_new_tokens=4), rid="b").__anext__()
        readers[2].cancel()  # the last client goes away
        await asyncio.gather(readers[2], return_exceptions=True)
        for g in gens:
            await g.aclose()
        assert not tm.states
        assert (await scheduler.next()).rid == sids["b"]  # its abort

    asyncio.run(scenario())


def test_a_rid_held_by_a_gone_client_is_freed_at_once(pair):
    """A rid whose running request has lost its client (its handler has not noticed yet) is taken over at once: the
    old request is aborted in the scheduler and its handler ends with 499; while the client is there, a 400."""
    tm, scheduler = pair

    async def scenario():
        gone = False

        async def client_gone():
            return gone

        params = SamplingParams(max_new_tokens=4)
        first = tm.generate([5, 6], params, rid="y", client_gone=client_gone)
        reading = asyncio.ensure_future(first.__anext__())
        sent = await scheduler.next()
        with pytest.raises(Exception, match="already in use"):
            await tm.generate([5], params, rid="y").__anext__()
        gone = True
        second = tm.generate([7], params, rid="y")
        reading2 = asyncio.ensure_future(second.__anext__())
        abort = await scheduler.next()
        assert isinstance(abort, AbortReq) and abort.rid == sent.rid
        again = await scheduler.next()
        assert isinstance(again, TokenizedGenerateReqInput) and again.rid != sent.rid
        with pytest.raises(Exception, match="client disconnected") as e:
            await reading
        assert e.value.status_code == 499
        await scheduler.answer(_output(sent.rid, [], {"type": "abort", "message": "request aborted"}),
                               _output(again.rid, [31], {"type": "length", "length": 1}))
        last = await reading2
        assert last.finished and last.output_ids == [31] and last.meta_info["id"] == "y"
        await first.aclose()
        await second.aclose()
        assert not tm.states
        with pytest.raises(asyncio.TimeoutError):  # nothing else was sent: no second abort of the first request
            await asyncio.wait_for(scheduler.recv.recv_pyobj(), 0.3)

    asyncio.run(scenario())


def test_a_group_rid_and_a_single_rid_exclude_each_other(pair):
    """/generate with n samples holds its rid as their group (/abort_request with it aborts them all), so a single
    request may not take that rid meanwhile, nor may samples of a group named as a running single request."""
    tm, scheduler = pair

    async def scenario():
        params = SamplingParams(max_new_tokens=4)
        sample = tm.generate([5], params, rid="g-0", group="g")
        reading = asyncio.ensure_future(sample.__anext__())
        sent = await scheduler.next()
        with pytest.raises(Exception, match="'g' is already in use"):
            await asyncio.wait_for(tm.generate([5], params, rid="g").__anext__(), 5)
        single = tm.generate([5], params, rid="s")
        reading2 = asyncio.ensure_future(single.__anext__())
        sent2 = await scheduler.next()
        with pytest.raises(Exception, match="'s' is already in use"):
            await asyncio.wait_for(tm.generate([5], params, rid="s-1", group="s").__anext__(), 5)
        assert sorted(await tm.abort_matching("g")) == ["g-0"]  # the group alone, as before
        assert (await scheduler.next()).rid == sent.rid
        await scheduler.answer(_output(sent.rid, [], {"type": "abort", "message": "request aborted"}),
                               _output(sent2.rid, [8], {"type": "length", "length": 1}))
        assert (await reading).finished and (await reading2).finished
        await sample.aclose()
        await single.aclose()
        assert not tm.states

    asyncio.run(scenario())
