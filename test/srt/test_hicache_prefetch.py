"""The file tier's reads happen while a request waits, behind the scheduler (mem_cache/file_prefetch.py): with a read
held back, the running request keeps decoding; --hicache-storage-prefetch-policy decides the waiting request's
admission (wait_complete: once the read landed, with the file's prefix; best_effort: at once, without it, or with it
when the read landed while the request waited for a slot; timeout: once its deadline passed, on a test clock,
without it); its outputs equal a cold run's (no cached token) under each policy; a request aborted before or during
its read, or admitted before it, frees every host slot it reserved; a read that raises is a logged miss. Two
requests waiting on one prefix on file share its read: each file read once, either aborted without touching the
other's, one needing more reading only the rest. A queued prompt is hashed on a reader thread, not the scheduler's.
The restart case (a second engine on the directory) is test_hicache.py's test_file_tier_outlives_the_server.

One engine for the module (a file tier on a temporary directory); the reader replaced by one that runs reads only
when the test releases them, the hashing run where it is submitted. About 11 s of wall time on 2 cores, half of it
the engine's start."""

from __future__ import annotations

import json
import threading
from collections import Counter

import pytest

from oracle import engine, random_ids
from sglang.srt.managers.io_struct import SchedulerStats
from sglang.srt.managers.schedule_batch import Req
from sglang.srt.mem_cache import file_tier
from sglang.srt.mem_cache.file_prefetch import ThreadedReader
from sglang.srt.mem_cache.host_tier import HostTierStats
from sglang.srt.metrics.collector import MetricsCollector
from sglang.srt.sampling.sampling_params import SamplingParams

SMALL = dict(max_total_tokens=512, chunked_prefill_size=64, max_running_requests=2)
STORED = random_ids(100, seed=41)  # its first 96 tokens (6 pages and the end there) are on file, not in the tree
PROMPT = STORED[:96] + random_ids(8, seed=42)
PROMPT2 = STORED[:96] + random_ids(8, seed=44)  # the same prefix on file, another continuation
LONG = STORED[:96] + random_ids(36, seed=43)  # on file up to 128 (8 pages and the end there), past STORED's 96
LONG_PROMPT = LONG[:128] + random_ids(8, seed=45)
LOGPROB_START = 100  # the prompt's last 4 logprobs: a match may still reach 96
CLOCK = [0.0]  # the prefetcher's clock (the timeout policy's deadline)


class HeldReader:
    """Reads queue until `release` runs them, on the caller's thread."""

    def __init__(self) -> None:
        self.jobs = []

    def submit(self, job) -> None:
        self.jobs.append(job)

    def release(self) -> None:
        jobs, self.jobs = self.jobs, []
        for job in jobs:
            job()


class Inline:
    """Runs a job as it is submitted (a prompt's hashing, in tests that hold reads)."""

    def submit(self, job) -> None:
        job()


@pytest.fixture(scope="module")
def eng(tmp_path_factory):
    extra = json.dumps({"storage_dir": str(tmp_path_factory.mktemp("hicache"))})
    e = engine("tiny", **SMALL, enable_hierarchical_cache=True, hicache_ratio=4.0, hicache_write_policy="write_through",
               hicache_storage_backend="file", hicache_storage_backend_extra_config=extra,
               hicache_storage_prefetch_policy="wait_complete")
    try:
        for ids in (STORED, LONG):
            e.generate(input_ids=ids, sampling_params={"temperature": 0, "max_new_tokens": 6, "ignore_eos": True})
        yield e
    finally:
        e.shutdown()


@pytest.fixture
def files(eng, monkeypatch):
    """The engine's file tier, the tree flushed (STORED's prefix on file only), reads held, on a test clock."""
    assert eng.flush_cache()
    tier = eng.model_runner.token_allocator.host_tier
    tier.files.store.drain()
    CLOCK[0] = 0.0
    monkeypatch.setattr(tier.files.prefetcher, "reader", HeldReader())
    monkeypatch.setattr(tier.files.prefetcher, "hasher", Inline())
    monkeypatch.setattr(tier.files.prefetcher, "clock", lambda: CLOCK[0])
    yield tier.files
    assert not tier.files.prefetcher.busy()
    eng.model_runner.token_allocator.check_all_free()
    assert eng.flush_cache()


def _req(rid: str, ids: list, n: int = 4, logprob_start: int = LOGPROB_START) -> Req:
    return Req(rid=rid, origin_input_ids=list(ids), return_logprob=True, logprob_start_len=logprob_start,
               sampling_params=SamplingParams(temperature=0, max_new_tokens=n, ignore_eos=True))


def _run(sched, reqs: list) -> None:
    while not all(r.finished for r in reqs):
        sched.step()


def _cold(eng, monkeypatch, ids: list) -> dict:
    """The prompt on an empty tree with the file tier detached: computed in full."""
    assert eng.flush_cache()
    tier = eng.model_runner.token_allocator.host_tier
    with monkeypatch.context() as m:
        m.setattr(tier, "files", None)
        out = eng.generate(input_ids=ids, return_logprob=True, logprob_start_len=LOGPROB_START,
                           sampling_params={"temperature": 0, "max_new_tokens": 4, "ignore_eos": True})
        assert out["meta_info"]["cached_tokens"] == 0
        assert eng.flush_cache()
    return out


def _count_reads(files, monkeypatch) -> Counter:
    """Times each file is read from now on."""
    get, reads = files.store.get, Counter()

    def counted(key):
        reads[key] += 1
        return get(key)
    monkeypatch.setattr(files.store, "get", counted)
    return reads


def _host_usage(eng) -> tuple:
    alloc = eng.model_runner.token_allocator
    return (alloc.host_tier.pages.available(), alloc.host_tier.ends.available(), alloc.available_pages(),
            alloc.available_req_slots())


@pytest.mark.parametrize("policy", ["wait_complete", "best_effort", "timeout"])
def test_running_requests_decode_while_a_read_is_held(eng, files, policy, monkeypatch):
    """A request decodes; one whose prefix is on file arrives and its read is held back: steps go on and the running
    request's tokens come out. wait_complete keeps the new request waiting until the read is released, then admits
    it on the file's 96 tokens; best_effort admits it at once without them (the read, released later, is dropped);
    timeout keeps it waiting until its deadline passes on the clock, then admits it without them. Its outputs and
    prompt logprobs are a cold run's."""
    monkeypatch.setattr(files, "prefetch_policy", policy)
    sched, reader = eng.scheduler, files.prefetcher.reader
    stats = eng.model_runner.token_allocator.host_tier.stats
    hits, read_bytes = stats.file_hit_tokens, stats.bytes_from_file
    seed = {"wait_complete": 5, "best_effort": 6, "timeout": 7}[policy]  # a prompt on no file: each computed once
    other = _req("running", random_ids(40, seed=seed), n=30)
    sched.add_request(other)
    while len(other.output_ids) < 2:
        sched.step()
    req = _req("on-file", PROMPT)
    sched.add_request(req)
    sched.step()
    assert len(reader.jobs) == 1  # its read is queued, held
    before = len(other.output_ids)
    for _ in range(3):
        sched.step()
    assert len(other.output_ids) >= before + 2  # the running request kept decoding meanwhile
    if policy == "best_effort":
        assert req.alloc is not None and req.cached_tokens == 0 and req.prefetch is None
        assert files.prefetcher.reserved(eng.model_runner.token_allocator.host_tier.pages) == 0  # freed at admission
        reader.release()  # the read runs after the request's admission: dropped, nothing read
    else:
        assert req in sched.waiting and req.alloc is None and req.prefetch is not None
        if policy == "wait_complete":
            reader.release()
        else:
            CLOCK[0] = files.config.prefetch_timeout_base + 1.0
        sched.step()
        assert req.alloc is not None
        assert req.cached_tokens == (96 if policy == "wait_complete" else 0)
        reader.release()
    _run(sched, [req, other])
    if policy == "wait_complete":
        assert stats.file_hit_tokens == hits + 96 and stats.bytes_from_file > read_bytes
        assert stats.file_read_seconds  # the read's latency, for /metrics
    else:
        assert stats.file_hit_tokens == hits and stats.bytes_from_file == read_bytes
    assert not files.prefetcher.busy()
    eng.model_runner.token_allocator.check_all_free()
    cold = _cold(eng, monkeypatch, PROMPT)
    assert req.output_ids == cold["output_ids"]
    got = [lp for _, lp in req.input_token_logprobs]
    want = [lp for lp, _, _ in cold["meta_info"]["input_token_logprobs"] if lp is not None]
    assert len(got) == len(want) == 4 and max(abs(a - b) for a, b in zip(got, want)) <= 1e-5


def test_best_effort_admits_with_what_landed(eng, files, monkeypatch):
    """best_effort: a request kept waiting by the scheduler anyway (both request slots taken) whose read lands
    meanwhile is admitted on the file's prefix, outputs as a cold run's."""
    monkeypatch.setattr(files, "prefetch_policy", "best_effort")
    sched, reader = eng.scheduler, files.prefetcher.reader
    running = [_req("long", random_ids(40, seed=8), n=12), _req("short", random_ids(24, seed=9), n=2)]
    for r in running:
        sched.add_request(r)
    sched.step()
    req = _req("on-file", PROMPT)
    sched.add_request(req)
    sched.step()
    assert req in sched.waiting and len(sched.running) == 2 and len(reader.jobs) == 1
    reader.release()
    _run(sched, running[1:])
    sched.step()
    assert req.alloc is not None and req.cached_tokens == 96
    _run(sched, [req, running[0]])
    assert req.output_ids == _cold(eng, monkeypatch, PROMPT)["output_ids"]


def test_abort_before_or_during_the_read_frees_its_slots(eng, files, monkeypatch):
    """A request aborted while its read is queued gives back every host slot it reserved at once; one aborted while
    its read is in progress gives them back once the reader stops (the next poll), the host's accounting as before
    it came; neither leaves a node in the tree."""
    sched, alloc = eng.scheduler, eng.model_runner.token_allocator
    reader = files.prefetcher.reader
    before = _host_usage(eng)
    sched.add_request(_req("queued", PROMPT))
    sched._admit()  # looks for its files: 6 page slots and an end slot reserved, the read queued
    assert _host_usage(eng)[:2] == (before[0] - 6, before[1] - 1) and len(reader.jobs) == 1
    assert sched.abort_request("queued") is not None
    assert _host_usage(eng) == before and not files.prefetcher.busy()
    reader.release()  # the read comes after the abort: nothing read
    assert _host_usage(eng) == before and not alloc.cache.root.children

    get, calls = files.store.get, []

    def abort_on_first_read(key):
        if not calls:
            assert sched.abort_request("reading") is not None  # the read in progress
        calls.append(key)
        return get(key)
    monkeypatch.setattr(files.store, "get", abort_on_first_read)
    sched.add_request(_req("reading", PROMPT))
    sched._admit()
    reader.release()
    assert len(calls) == 1 and files.prefetcher.draining  # stopped after the page it was reading
    assert _host_usage(eng)[:2] == (before[0] - 6, before[1] - 1)  # the reader had the slots: still held
    alloc.check_all_free()  # counted as the prefetch's, not leaked
    alloc.poll_copies()
    assert _host_usage(eng) == before and not files.prefetcher.busy() and not alloc.cache.root.children


def test_metrics_report_prefetch_latency():
    metrics = MetricsCollector("m")
    stats = HostTierStats(bytes_from_file=512, file_read_seconds=[0.01, 0.02, 0.5])
    metrics.observe_stats(SchedulerStats(0, 0, 0.0, 0, cache_hit_rate=0.0, cache_queried_tokens=10,
                                         hicache=stats.take()))
    text = metrics.render().decode()
    assert 'sglang:hicache_prefetch_latency_seconds_count{model_name="m"} 3.0' in text
    assert 'sglang:hicache_bytes_total{direction="from_file",model_name="m"} 512.0' in text


def test_failed_read_is_a_logged_miss(eng, files, monkeypatch, caplog):
    """A read that raises (wait_complete) ends the wait of both requests sharing it, tried once: they are admitted
    without the file's prefix, the failure logged, every slot reserved freed; outputs as a cold run's."""
    sched, reader = eng.scheduler, files.prefetcher.reader
    tier = eng.model_runner.token_allocator.host_tier
    calls = []

    def broken(key):
        calls.append(key)
        raise RuntimeError("disk gone")
    monkeypatch.setattr(files.store, "get", broken)
    reqs = [_req("broken", PROMPT), _req("sharer", PROMPT2)]
    for r in reqs:
        sched.add_request(r)
    sched.step()
    assert all(r in sched.waiting for r in reqs) and len(reader.jobs) == 1
    reader.release()
    sched.step()
    assert all(r.alloc is not None and r.cached_tokens == 0 for r in reqs) and len(calls) == 1
    assert "a prefetch read failed" in caplog.text
    assert not files.prefetcher.busy() and files.prefetcher.reserved(tier.pages) == 0
    assert files.prefetcher.reserved(tier.ends) == 0 and not any(not n.pages for n in tier.cache.nodes())
    _run(sched, reqs)
    monkeypatch.undo()
    assert reqs[0].output_ids == _cold(eng, monkeypatch, PROMPT)["output_ids"]


def test_waiting_requests_share_the_reads_of_one_prefix(eng, files, monkeypatch):
    """Two requests queued on one prefix on file (wait_complete): the second joins the first's read, so the host
    reserves its slots once and each file is read once (its bytes counted once); both are admitted on the file's 96
    tokens, outputs as cold runs'."""
    sched, reader = eng.scheduler, files.prefetcher.reader
    stats = eng.model_runner.token_allocator.host_tier.stats
    before, read_bytes, hits = _host_usage(eng), stats.bytes_from_file, stats.file_hit_tokens
    reads = _count_reads(files, monkeypatch)
    reqs = [_req("first", PROMPT), _req("second", PROMPT2)]
    for r in reqs:
        sched.add_request(r)
    sched.step()
    assert len(reader.jobs) == 1 and reqs[1].prefetch.read is reqs[0].prefetch.read
    assert _host_usage(eng)[:2] == (before[0] - 6, before[1] - 1)  # one read's slots
    reader.release()
    sched.step()
    assert [r.cached_tokens for r in reqs] == [96, 96]
    assert stats.file_hit_tokens == hits + 96  # the first loads the landed node; the second finds it loaded
    assert len(reads) == 7 and set(reads.values()) == {1}  # 6 pages and the end, each read once
    assert stats.bytes_from_file - read_bytes == 6 * files.pool.page_nbytes + files.pool.end_nbytes
    _run(sched, reqs)
    for r, ids in zip(reqs, (PROMPT, PROMPT2)):
        assert r.output_ids == _cold(eng, monkeypatch, ids)["output_ids"]


@pytest.mark.parametrize("aborted", [("first",), ("second",), ("first", "second")])
def test_aborting_a_request_sharing_a_read(eng, files, monkeypatch, aborted):
    """Of two requests sharing a held read, one is aborted (either): the read stays for the other, its slots still
    reserved once, and lands for it (each file read once, the other admitted on the file's prefix); once it finished
    and the cache is flushed, the host and device accounting is where it was. Both aborted: every slot is back at
    once and nothing is read."""
    sched, reader, alloc = eng.scheduler, files.prefetcher.reader, eng.model_runner.token_allocator
    before = _host_usage(eng)
    reads = _count_reads(files, monkeypatch)
    reqs = {"first": _req("first", PROMPT), "second": _req("second", PROMPT2)}
    for r in reqs.values():
        sched.add_request(r)
    sched._admit()
    for rid in aborted:
        assert sched.abort_request(rid) is not None
    alloc.check_all_free()
    if len(aborted) == 2:
        assert _host_usage(eng) == before and not files.prefetcher.busy()
        reader.release()
        assert not reads and _host_usage(eng) == before and not alloc.cache.root.children
        return
    assert _host_usage(eng)[:2] == (before[0] - 6, before[1] - 1) and len(reader.jobs) == 1
    other = reqs["second" if aborted == ("first",) else "first"]
    reader.release()
    sched.step()
    assert other.cached_tokens == 96 and len(reads) == 7 and set(reads.values()) == {1}
    _run(sched, [other])
    alloc.check_all_free()
    assert eng.flush_cache() and _host_usage(eng) == before


def test_a_request_needing_more_reads_on_past_the_shared_read(eng, files, monkeypatch):
    """A request whose prefix on file goes on past another waiting request's (128 tokens against 96) joins that one's
    read; once it landed, the shorter one is admitted on it while the longer one keeps waiting on a read of only the
    2 pages and the end past it (those slots alone reserved), then is admitted on all 128. Each file is read once;
    outputs as cold runs'."""
    sched, reader = eng.scheduler, files.prefetcher.reader
    tier = eng.model_runner.token_allocator.host_tier
    reads = _count_reads(files, monkeypatch)
    short, long = _req("short", PROMPT), _req("long", LONG_PROMPT, logprob_start=132)
    for r in (short, long):
        sched.add_request(r)
    sched.step()
    assert len(reader.jobs) == 1 and long.prefetch.read is short.prefetch.read
    reader.release()
    sched.step()
    assert short.cached_tokens == 96 and long in sched.waiting and len(reader.jobs) == 1
    assert files.prefetcher.reserved(tier.pages) == 2 and files.prefetcher.reserved(tier.ends) == 1
    reader.release()
    sched.step()
    assert long.cached_tokens == 128
    assert len(reads) == 10 and set(reads.values()) == {1}  # 8 pages and 2 ends
    _run(sched, [short, long])
    for r, ids in ((short, PROMPT), (long, LONG_PROMPT)):
        assert r.output_ids == _cold(eng, monkeypatch, ids)["output_ids"]


def test_prompt_hashing_runs_off_the_scheduler_thread(eng, files, monkeypatch):
    """Queueing a request hashes none of its tokens on the scheduler's thread: the chain hashes that name its files
    are computed on a reader thread, and its read is planned from them once they are back (admitted on the file's
    prefix)."""
    sched, reader = eng.scheduler, files.prefetcher.reader
    threads, chain_hashes = [], file_tier.chain_hashes

    def recorded(start, tokens, page_size):
        threads.append(threading.current_thread())
        return chain_hashes(start, tokens, page_size)
    monkeypatch.setattr(file_tier, "chain_hashes", recorded)
    monkeypatch.setattr(files.prefetcher, "hasher", ThreadedReader())
    req = _req("hashed", PROMPT)
    sched.add_request(req)
    for _ in range(1000):  # each idle step sleeps until the hashing stops (5 ms at most)
        sched.step()
        if reader.jobs:
            break
    assert len(reader.jobs) == 1 and req in sched.waiting
    reader.release()
    sched.step()
    assert req.cached_tokens == 96
    assert threads and threading.main_thread() not in threads
    assert all(t.name.startswith("hicache-file-reader") for t in threads)
    _run(sched, [req])
