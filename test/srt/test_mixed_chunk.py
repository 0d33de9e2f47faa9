"""How a step is built while prompts prefill (managers/scheduler.py): with mixed chunks (the default) running requests
decode one row each beside the prefill chunks; --disable-mixed-chunk runs the chunks alone and the running requests
wait; --max-prefill-tokens bounds what the requests after a step's first add. Either way the outputs are the same
tokens (fp32 engine, greedy). About 10 s on CPU."""

from __future__ import annotations

import logging
import re

import pytest

from oracle import engine, random_ids
from sglang.srt.managers.schedule_batch import Req
from sglang.srt.sampling.sampling_params import SamplingParams
from sglang.srt.server_args import ServerArgs

GREEDY = {"temperature": 0, "max_new_tokens": 6, "ignore_eos": True}


def steps_of(eng, prompts: list) -> tuple:
    """Run `prompts` to the end, the second and third arriving once the first decodes; returns (each prefilling
    step as [(rid, rows)], the outputs)."""
    sched, seen = eng.scheduler, []
    run_batch = sched.run_batch

    def record(batch):
        seen.append([(r.rid, n) for r, n in zip(batch.reqs, batch.extend_lens)])
        return run_batch(batch)

    sched.run_batch = record
    reqs = [Req(f"r{i}", ids, SamplingParams.from_dict(GREEDY)) for i, ids in enumerate(prompts)]
    try:
        sched.add_request(reqs[0])
        while not reqs[0].output_ids:
            sched.step()
        for req in reqs[1:]:
            sched.add_request(req)
        while not all(r.finished for r in reqs):
            sched.step()
    finally:
        sched.run_batch = run_batch
    return seen, [r.output_ids for r in reqs]


@pytest.fixture(scope="module")
def mixed_run():
    eng = engine("tiny", chunked_prefill_size=64)
    try:
        yield steps_of(eng, PROMPTS)
    finally:
        eng.shutdown()


PROMPTS = [random_ids(20, seed=1), random_ids(150, seed=2), random_ids(30, seed=3)]


def test_decode_rows_ride_along_prefill_chunks(mixed_run):
    seen, _ = mixed_run
    arrival = next(i for i, step in enumerate(seen) if any(rid == "r1" for rid, _ in step))
    # r0 decodes one row in every step that prefills r1's chunks (64-token budget: its row, then 63 prompt tokens)
    assert seen[arrival] == [("r0", 1), ("r1", 63)]
    assert all(("r0", 1) in step for step in seen[arrival:arrival + 3])


def test_each_prefilling_step_logs_its_chunks_and_decode_rows(caplog):
    """Upstream's "Prefill batch." line for every step with a prompt chunk, with the decoding rows that ride along
    and the step's wall time."""
    eng = engine("tiny", chunked_prefill_size=64)
    try:
        with caplog.at_level(logging.INFO, logger="sglang.srt.managers.batch_log"):
            seen, _ = steps_of(eng, PROMPTS)
            lines = [r.getMessage() for r in caplog.records if r.getMessage().startswith("Prefill batch.")]
            eng.scheduler.log_prefill_batches = False  # a server's warm-up and its non-sending ranks
            steps_of(eng, PROMPTS[:1])
            assert len([r for r in caplog.records if r.getMessage().startswith("Prefill batch.")]) == len(lines)
    finally:
        eng.shutdown()
    fields = [dict((k.strip(), float(v)) for k, v in re.findall(r"#?([a-z -]+): ([\d.]+)", line)) for line in lines]
    assert fields[0]["new-seq"] == 1 and fields[0]["new-token"] == 20 and fields[0]["decode-rows"] == 0
    arrival = next(f for f in fields if f["decode-rows"] > 0)  # r1's first chunk beside r0's row
    assert (arrival["new-seq"], arrival["new-token"], arrival["decode-rows"]) == (1, 63, 1)
    assert sum(f["new-token"] for f in fields) == sum(map(len, PROMPTS))
    assert all(f["cached-token"] == 0 and f["step"] > 0 and f["running-req"] >= 1 for f in fields)
    assert len(lines) == sum(any(n > 1 for _, n in step) for step in seen)  # every chunk here is > 1 token


def test_without_mixed_chunks_running_requests_wait_and_outputs_are_the_same(mixed_run):
    seen_mixed, outputs_mixed = mixed_run
    eng = engine("tiny", chunked_prefill_size=64, enable_mixed_chunk=False)
    try:
        seen, outputs = steps_of(eng, PROMPTS)
    finally:
        eng.shutdown()
    assert outputs == outputs_mixed
    arrival = next(i for i, step in enumerate(seen) if any(rid == "r1" for rid, _ in step))
    prefilling = seen[arrival:arrival + 3]  # r1's 150 tokens in chunks of 64, 64, 22 (+ r2's first 42)
    assert [step[0] for step in prefilling] == [("r1", 64), ("r1", 64), ("r1", 22)]
    assert all(rid != "r0" for step in prefilling for rid, _ in step)  # r0 waits while prompts prefill
    assert all(rid != "r0" for step in seen[1:] for rid, _ in step)  # and decodes in decode steps only


def test_max_prefill_tokens_bounds_the_requests_after_the_first():
    eng = engine("tiny", chunked_prefill_size=256, max_prefill_tokens=40)
    try:
        sched = eng.scheduler
        seen = []
        run_batch = sched.run_batch
        sched.run_batch = lambda batch: seen.append(list(batch.extend_lens)) or run_batch(batch)
        reqs = [Req(f"q{i}", random_ids(n, seed=10 + i), SamplingParams.from_dict(GREEDY))
                for i, n in enumerate((30, 25, 25))]
        for req in reqs:
            sched.add_request(req)
        while not all(r.finished for r in reqs):
            sched.step()
        sched.run_batch = run_batch
    finally:
        eng.shutdown()
    # the first request whole (30), the second only the 10 left of 40; then q0's decode row, the second's 15 left
    # and the third's 25 (40 over the two)
    assert seen[0] == [30, 10] and seen[1] == [1, 15, 25]


def test_a_lone_chunk_may_exceed_max_prefill_tokens():
    """upstream's rule: the bound applies over requests; one request's chunk is bounded by --chunked-prefill-size."""
    eng = engine("tiny", chunked_prefill_size=64, max_prefill_tokens=16)
    try:
        out = eng.generate(input_ids=[random_ids(100, seed=7)], sampling_params=GREEDY)
        assert len(out[0]["output_ids"]) == 6
    finally:
        eng.shutdown()


def test_bad_max_prefill_tokens_is_refused():
    with pytest.raises(ValueError, match="--max-prefill-tokens must be positive"):
        ServerArgs(model_path="tiny-deepseek-v4", max_prefill_tokens=0).validate()


@pytest.mark.parametrize("argv, mixed", [([], True), (["--enable-mixed-chunk"], True),
                                         (["--disable-mixed-chunk"], False)])
def test_mixed_chunk_flags(argv, mixed):
    import argparse

    parser = argparse.ArgumentParser()
    ServerArgs.add_cli_args(parser)
    args = ServerArgs.from_cli_args(parser.parse_args(["--model-path", "tiny-deepseek-v4", *argv]))
    assert args.enable_mixed_chunk is mixed and args.max_prefill_tokens == 16384
