"""The file tier's reads happen while a request waits, behind the scheduler (mem_cache/file_prefetch.py): with a read
held back, the running request keeps decoding; --hicache-storage-prefetch-policy decides the waiting request's
admission (wait_complete: once the read landed, with the file's prefix; best_effort: at once, without it, or with it
when the read landed while the request waited for a slot; timeout: once its deadline passed, on a test clock,
without it); its outputs equal a cold run's (no cached token) under each policy; a request aborted before or during
its read, or admitted before it, frees every host slot it reserved; a read that raises is a logged miss. Two
requests waiting on one prefix on file share its read: each file read once, either aborted without touching the
other's (before the read or midway through it; both aborted midway, what lands after is dropped), one needing more
reading only the rest, one needing less stopping inside it (its end read with it, the landed node split there);
under timeout each is admitted at its own deadline, the read going on for the other. A request whose read keeps its
prefix's device pages locked is admitted in a pool those pages fill (mapped, not allocated again). A queued prompt is
hashed on a reader thread, not the scheduler's. The restart case (a second engine on the directory) is test_hicache.py's
test_file_tier_outlives_the_server.

One engine for the module (a file tier on a temporary directory); the reader replaced by one that runs reads only
when the test releases them (a store hook acts between two of its files), the hashing run where it is submitted.
About 8 s of wall time on 2 cores, a third of it the engine's start."""

from __future__ import annotations

import functools
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


@pytest.mark.parametrize("abort_short", [False, True], ids=["admitted", "short-aborted"])
def test_a_request_needing_less_stops_inside_the_shared_read(eng, files, monkeypatch, abort_short):
    """A request whose prefix on file ends inside another waiting request's read (96 tokens against 128, the end at
    96 on file too) joins that read as a stop rather than read its 6 pages again: the host reserves the 8 pages and
    the end at 128 once, and one end slot more, for the end at 96, shared by a second request stopping there. The
    read lands as two nodes (96 and 128): each request is admitted on its whole prefix, each file read once (8 pages,
    2 ends); outputs as cold runs'. The two stopping requests aborted before the read: the slot of the end at 96 is
    freed once neither stops there and that file is not read; the long request is still admitted on 128. No slot
    leaks."""
    sched, reader, alloc = eng.scheduler, files.prefetcher.reader, eng.model_runner.token_allocator
    tier = alloc.host_tier
    before = _host_usage(eng)
    reads = _count_reads(files, monkeypatch)
    long, shorts = _req("long", LONG_PROMPT, logprob_start=132), [_req("short", PROMPT), _req("short2", PROMPT2)]
    for r in (long, *shorts):
        sched.add_request(r)
        sched.step()
    assert len(reader.jobs) == 1 and all(r.prefetch.read is long.prefetch.read for r in shorts)
    assert files.prefetcher.reserved(tier.pages) == 8 and files.prefetcher.reserved(tier.ends) == 2
    if abort_short:
        for r, ends in zip(shorts, (2, 1)):  # the end at 96 stays reserved while a request stops there
            assert sched.abort_request(r.rid) is not None
            assert files.prefetcher.reserved(tier.pages) == 8 and files.prefetcher.reserved(tier.ends) == ends
        shorts = []
    reader.release()
    sched.step()
    assert long.cached_tokens == 128 and all(r.cached_tokens == 96 for r in shorts[:1])
    assert all(r in sched.waiting for r in shorts[1:])  # for a request slot: the read's nodes stay locked for it
    assert len(reads) == (9 if abort_short else 10) and set(reads.values()) == {1}
    _run(sched, [long, *shorts])
    assert all(r.cached_tokens == 96 for r in shorts)
    alloc.check_all_free()
    assert eng.flush_cache() and _host_usage(eng) == before
    for r in (long, *shorts):
        assert r.output_ids == _cold(eng, monkeypatch, r.origin_input_ids)["output_ids"]


def _between_reads(files, monkeypatch, actions: dict) -> list:
    """actions[n]() runs once n files of a read have landed, before the next one is read (the scheduler acting
    between two of the reader's files); returns the keys read, in order."""
    get, calls = files.store.get, []

    def hooked(key):
        action = actions.pop(len(calls), None)
        if action is not None:
            action()
        calls.append(key)
        return get(key)
    monkeypatch.setattr(files.store, "get", hooked)
    return calls


@pytest.mark.parametrize("aborts", [{3: ("first",)}, {3: ("second",)}, {2: ("first",), 4: ("second",)},
                                    {5: ("second", "first")}, {6: ("first", "second")}],
                         ids=["first", "second", "both", "both-on-the-last-page", "both-on-the-end"])
def test_an_abort_midway_through_a_shared_read(eng, files, monkeypatch, aborts):
    """Two requests share a read of 6 pages and the end; some of its files land, then one request is aborted (either)
    and the rest land: the other is admitted on the whole 96 tokens (each file read once), outputs as a cold run's,
    and once it finished and the cache is flushed every host slot, device page, window and state slot is free. Both
    aborted midway (apart; together while the last page is read: the end is not read then; or while the end is): the
    reader stops after the file it was reading, whose landing (the end's too) neither grafts a node nor keeps a slot;
    every slot is back at the next poll."""
    sched, reader, alloc = eng.scheduler, files.prefetcher.reader, eng.model_runner.token_allocator
    before = _host_usage(eng)
    reqs = {"first": _req("first", PROMPT), "second": _req("second", PROMPT2)}
    for r in reqs.values():
        sched.add_request(r)
    sched.step()
    assert len(reader.jobs) == 1 and reqs["second"].prefetch.read is reqs["first"].prefetch.read

    def abort(rids):
        for rid in rids:
            assert sched.abort_request(rid) is not None
    calls = _between_reads(files, monkeypatch, {n: functools.partial(abort, rids) for n, rids in aborts.items()})
    reader.release()
    aborted = [rid for rids in aborts.values() for rid in rids]
    if len(aborted) == 2:
        assert len(calls) == max(aborts) + 1 and files.prefetcher.draining  # stopped after the file it was reading
        assert _host_usage(eng)[:2] == (before[0] - 6, before[1] - 1)  # the reader had the slots: still held
        alloc.check_all_free()
        sched.step()  # the poll: what landed after the aborts is dropped, its slots freed
        assert _host_usage(eng) == before and not files.prefetcher.busy() and not alloc.cache.root.children
        return
    other = reqs["second" if aborted == ["first"] else "first"]
    assert other in sched.waiting and len(calls) == 7 and len(set(calls)) == 7  # 6 pages and the end, once each
    sched.step()
    assert other.cached_tokens == 96
    _run(sched, [other])
    alloc.check_all_free()
    assert eng.flush_cache() and _host_usage(eng) == before
    assert other.output_ids == _cold(eng, monkeypatch, other.origin_input_ids)["output_ids"]


def test_timeout_admits_each_sharer_at_its_own_deadline(eng, files, monkeypatch):
    """timeout: the deadline is per request (its queueing plus prefetch_timeout_base); a shared read goes on until
    the latest of its waiters' deadlines. Of two requests sharing a held read, queued half a timeout apart, the first
    is admitted once its deadline passed, without the file's prefix (computing it), while the read stays reserved
    for the second; the read released then, the second is admitted on the file's 96 tokens, each file read once.
    Outputs as cold runs'; no slot leaks."""
    monkeypatch.setattr(files, "prefetch_policy", "timeout")
    sched, reader, alloc = eng.scheduler, files.prefetcher.reader, eng.model_runner.token_allocator
    base = files.config.prefetch_timeout_base
    before = _host_usage(eng)
    reads = _count_reads(files, monkeypatch)
    early, late = _req("early", PROMPT), _req("late", PROMPT2)
    sched.add_request(early)
    sched.step()
    CLOCK[0] = base / 2
    sched.add_request(late)
    sched.step()
    assert len(reader.jobs) == 1 and late.prefetch.read is early.prefetch.read
    assert early in sched.waiting and late in sched.waiting
    CLOCK[0] = base * 1.25  # past early's deadline, not late's
    sched.step()
    assert early.alloc is not None and early.cached_tokens == 0 and late in sched.waiting
    assert _host_usage(eng)[:2] == (before[0] - 6, before[1] - 1)  # still reserved, for late
    reader.release()
    sched.step()
    assert late.alloc is not None and late.cached_tokens == 96
    assert len(reads) == 7 and set(reads.values()) == {1}
    _run(sched, [early, late])
    alloc.check_all_free()
    assert eng.flush_cache() and _host_usage(eng) == before
    for r, ids in ((early, PROMPT), (late, PROMPT2)):
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


def test_a_waiting_request_counts_its_locked_prefix_as_its_own(eng, files, monkeypatch):
    """A read keeps its path locked while its request waits. In a pool whose free pages hold the request only with
    that path's pages mapped (not allocated again), the request is admitted: counted as pages it needs and not as
    pages available, it would wait for pages only its own admission frees, for ever."""
    sched, alloc = eng.scheduler, eng.model_runner.token_allocator
    tier = alloc.host_tier
    with monkeypatch.context() as m:  # the device holds STORED's first 2 pages, an end at 32 that PROMPT fits
        m.setattr(tier, "files", None)
        eng.generate(input_ids=STORED[:33], sampling_params={"temperature": 0, "max_new_tokens": 1})
    req = _req("tight", PROMPT)
    sched.add_request(req)
    sched._admit()  # its read queued from the node at 32, which stays locked: no eviction frees its pages
    assert files.prefetcher.live and files.prefetcher.live[0].parent.lock_ref > 0
    assert alloc.cache.evictable_pages() == 0
    taken = alloc.pages.alloc(alloc.pages.available() - 5)  # 7 pages for 108 tokens: 2 of them mapped, 5 free
    try:
        files.prefetcher.reader.release()
        for _ in range(20):
            sched.step()
            if req in sched.running or req.finished:
                break
        admitted = req in sched.running or req.finished
        if not admitted:
            sched.abort_request("tight")  # the module's other tests go on from a clean engine
        assert admitted, "the request waits for its own prefix's pages"
    finally:
        alloc.pages.free(taken)
    _run(sched, [req])
    assert req.cached_tokens == 96
