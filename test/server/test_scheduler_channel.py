"""The scheduler -> tokenizer channel, which listens on TCP under DP attention over several nodes: a message is
unpickled only once its HMAC-SHA256 tag verifies with the launch's key. Raw bytes, a pickle whose __reduce__ runs
code, a message tagged with another key and a signed message of the wrong type are dropped (logged, rate-limited),
never run and never crash the receiver; a signed BatchOutput is accepted. The TCP endpoint is on --dist-init-addr's
host. The two-node server test (test_server_tensor_parallel.py) attacks a real server's port too."""

from __future__ import annotations

import asyncio
import logging
import os
import pickle

import zmq
import zmq.asyncio

from server_process import free_port
from sglang.srt.managers.io_struct import (BatchOutput, MessageCodec, SchedulerReady, SchedulerStats, TAG_SIZE,
                                           new_channel_key)
from sglang.srt.managers.scheduler_process import port_args_for
from sglang.srt.managers.tokenizer_manager import TokenizerManager
from sglang.srt.server_args import ServerArgs


class Evil:
    """Unpickling this makes the directory `path`: proof that the receiver ran code it was sent."""

    def __init__(self, path: str) -> None:
        self.path = path

    def __reduce__(self):
        return os.mkdir, (self.path,)


def _batch(dp_rank: int = 0, running: int = 0) -> BatchOutput:
    return BatchOutput([], SchedulerStats(running, 0, 0.0, 0, dp_rank=dp_rank))


def test_codec_unpickles_only_what_the_key_signed(tmp_path, caplog):
    marker = str(tmp_path / "ran")
    evil = pickle.dumps(Evil(marker))
    codec = MessageCodec(new_channel_key())
    caplog.set_level(logging.WARNING, logger="sglang.srt.managers.io_struct")

    assert codec.decode(codec.encode(_batch(running=3)), BatchOutput).stats.num_running_reqs == 3
    attacks = [[b"hello"], [evil], [b"\0" * TAG_SIZE, evil], [b"x", b"y", b"z"],
               MessageCodec(new_channel_key()).encode(Evil(marker)),  # another launch's key
               codec.encode({"not": "a batch"})]  # signed, but not what the channel carries
    for frames in attacks:
        assert codec.decode(frames, BatchOutput) is None
    assert not os.path.exists(marker) and codec.dropped == len(attacks)
    assert "not a [tag, payload] message" in caplog.text
    pickle.loads(evil)  # the payload was live: unpickled, it runs
    assert os.path.exists(marker)


def test_dropped_messages_are_logged_at_most_once_per_interval(caplog):
    now = [100.0]
    codec = MessageCodec(new_channel_key(), log_every_s=10.0, clock=lambda: now[0])
    caplog.set_level(logging.WARNING, logger="sglang.srt.managers.io_struct")
    for _ in range(5):
        codec.decode([b"junk"])
    assert [r.getMessage().split(";")[0] for r in caplog.records] == ["dropped 1 message(s) on the scheduler channel"]
    now[0] += 10.0
    codec.decode([b"junk"])
    assert caplog.records[-1].getMessage().startswith("dropped 5 message(s)") and len(caplog.records) == 2


def test_tokenizer_manager_drops_unsigned_messages_on_its_tcp_port(tmp_path, caplog):
    """A real TokenizerManager bound on TCP as node 0's is: an attacker's messages change nothing and the loop goes
    on; a rank's signed output arrives."""
    marker = str(tmp_path / "ran")
    key = new_channel_key()
    ready = SchedulerReady(model_path="fake", context_length=64, vocab_size=100, max_total_tokens=64,
                           max_running_requests=4, eos_token_ids=[1], pool_report="")
    remote = f"tcp://127.0.0.1:{free_port()}"
    tm = TokenizerManager(None, ready, f"ipc://{tmp_path / 's'}", f"ipc://{tmp_path / 't'}",
                          tokenizer_input_remote=remote, channel_key=key)
    caplog.set_level(logging.WARNING, logger="sglang.srt.managers.io_struct")

    async def scenario():
        tm.start()
        attacker, rank = tm.ctx.socket(zmq.PUSH), tm.ctx.socket(zmq.PUSH)
        try:
            attacker.connect(remote)
            rank.connect(remote)
            await attacker.send(b"\x80\x05 not a pickle")
            await attacker.send_pyobj(Evil(marker))  # what recv_pyobj would have run
            await attacker.send_multipart([b"\0" * TAG_SIZE, pickle.dumps(Evil(marker))])
            await attacker.send_multipart(MessageCodec(new_channel_key()).encode(_batch(dp_rank=1, running=9)))
            await rank.send_multipart(MessageCodec(key).encode(_batch(dp_rank=1, running=7)))
            for _ in range(1000):
                if tm.codec.dropped == 4 and 1 in tm.group_stats:
                    break
                await asyncio.sleep(0.01)
            assert tm.codec.dropped == 4 and tm.group_stats[1].num_running_reqs == 7
            assert not tm._loop_task.done()  # the receiving loop is still running
        finally:
            attacker.close(linger=0)
            rank.close(linger=0)

    try:
        asyncio.run(scenario())
    finally:
        tm.close()
    assert not os.path.exists(marker)
    assert "dropped 1 message(s) on the scheduler channel" in caplog.text


def test_remote_endpoint_is_on_the_dist_init_host_and_each_launch_has_its_key(tmp_path):
    args = ServerArgs(model_path="m", tp_size=2, dp_size=2, enable_dp_attention=True, nnodes=2,
                      dist_init_addr="10.1.2.3:29500")
    a, b = port_args_for(args, str(tmp_path)), port_args_for(args, str(tmp_path))
    assert a.tokenizer_input_remote == "tcp://10.1.2.3:29501"
    assert len(a.channel_key) == 32 and a.channel_key != b.channel_key
    assert "channel_key" not in repr(a)  # never in a log line
    assert port_args_for(ServerArgs(model_path="m"), str(tmp_path)).tokenizer_input_remote is None
