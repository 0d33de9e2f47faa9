"""The grammar queue: a constrained request waits here, outside the batch, while its grammar compiles in worker
threads (xgrammar releases the GIL while compiling), so a large schema never stalls the other requests' decoding.

Scheduler.add_request submits a request whose sampling params carry a grammar. Each scheduler step decides over the
queued requests (GrammarQueue.decide: compiled, refused because the grammar does not compile or took longer than
SGLANG_GRAMMAR_TIMEOUT, or still compiling) and applies the decision (GrammarQueue.apply): a compiled request gets
its matcher and joins the waiting queue, a refused one ends with a 400 naming the field. With several ranks the first
rank of the attention group decides and broadcasts (Scheduler._poll_grammars), so every rank admits the same requests
at the same step; a rank whose own compile of an admitted grammar is not done yet waits for it (the same text
compiles the same way, at about the same time).

The worker threads' first task builds the tokenizer info over the whole vocabulary, at scheduler start. Requests
with the same grammar share one compile; a compile no queued request needs any more is dropped if it has not started
(a running compile cannot be interrupted: it finishes and fills the cache).
"""

from __future__ import annotations

import queue
import threading
from concurrent import futures
from dataclasses import dataclass
from typing import Any, Callable, Optional

from sglang.srt.environ import envs
from sglang.srt.sampling.sampling_params import SamplingParamError

GRAMMAR_COMPILE_THREADS = 2  # compiles at once; each also runs on xgrammar's own threads (XGrammarBackend)
GRAMMAR_POLL_INTERVAL_S = 0.01  # a scheduler with nothing else to run waits this long per step for a compile


class WorkerThreads:
    """Daemon threads running submitted callables. A ThreadPoolExecutor's threads are joined when the interpreter
    exits, which would wait out a long compile; these are not."""

    def __init__(self, n: int, name: str) -> None:
        self._tasks: queue.SimpleQueue = queue.SimpleQueue()
        for i in range(n):
            threading.Thread(target=self._work, name=f"{name}-{i}", daemon=True).start()

    def submit(self, fn: Callable, *args) -> futures.Future:
        future: futures.Future = futures.Future()
        self._tasks.put((future, fn, args))
        return future

    def _work(self) -> None:
        while True:
            future, fn, args = self._tasks.get()
            if not future.set_running_or_notify_cancel():
                continue  # cancelled while queued
            try:
                result = fn(*args)
            except BaseException as e:  # handed to whoever reads the future
                future.set_exception(e)
            else:
                future.set_result(result)


@dataclass
class GrammarJob:
    req: Any  # the Req waiting for its grammar
    key: tuple  # (kind, text): kind is the field (json_schema | regex | ebnf)
    future: futures.Future  # -> the CompiledGrammar, shared by the jobs of one key
    deadline: float  # time.perf_counter() after which the request is refused


@dataclass(frozen=True)
class GrammarDecision:
    """The first rank's verdict on the queued job at `index` (the queue is the same on every rank)."""

    index: int
    message: Optional[str] = None  # None: compiled, admit it; otherwise why it is refused
    param: Optional[str] = None
    status_code: int = 400


class GrammarQueue:
    def __init__(self, build_backend: Callable[[], Any], timeout_s: Optional[float] = None,
                 threads: int = GRAMMAR_COMPILE_THREADS) -> None:
        """`build_backend`: makes the XGrammarBackend (the tokenizer info), run at once by a worker thread."""
        self.timeout_s = envs.SGLANG_GRAMMAR_TIMEOUT.get() if timeout_s is None else timeout_s
        self.jobs: list = []  # GrammarJob, in arrival order
        self._threads = WorkerThreads(threads, "grammar-compile")
        self._backend = self._threads.submit(build_backend)
        self._compiling: dict = {}  # key -> the future of its compile while it is not done
        self._lock = threading.RLock()  # _compiling; done callbacks run in a worker thread, or here if done

    @property
    def backend(self):
        """The XGrammarBackend, waiting until it is built."""
        return self._backend.result()

    def submit(self, req, kind: str, text: str, now: float) -> None:
        key = (kind, text)
        with self._lock:
            future = self._compiling.get(key)
            if future is None or future.cancelled():
                future = self._threads.submit(self._compile, key)
                self._compiling[key] = future
                future.add_done_callback(lambda f: self._done(key, f))
        self.jobs.append(GrammarJob(req, key, future, now + self.timeout_s))

    def _compile(self, key: tuple):
        return self._backend.result().compile(*key)

    def _done(self, key: tuple, future: futures.Future) -> None:
        with self._lock:
            if self._compiling.get(key) is future:
                del self._compiling[key]

    def decide(self, now: float) -> list:
        """GrammarDecisions for the jobs whose compile ended, or whose deadline passed."""
        out = []
        for i, job in enumerate(self.jobs):
            kind = job.key[0]
            if job.future.done():
                error = job.future.exception()
                if error is None:
                    out.append(GrammarDecision(i))
                elif isinstance(error, SamplingParamError):
                    out.append(GrammarDecision(i, str(error), error.param))
                else:  # the compiler itself failed (memory, the tokenizer info): not the client's fault
                    out.append(GrammarDecision(i, f"{kind} could not be compiled: {type(error).__name__}: {error}"
                                               [:500], kind, 500))
            elif now >= job.deadline:
                out.append(GrammarDecision(i, f"{kind} did not compile within {self.timeout_s:g} s "
                                              f"(SGLANG_GRAMMAR_TIMEOUT); simplify it", kind))
        return out

    def apply(self, decisions: list) -> tuple:
        """Take the decided jobs out of the queue: (requests ready, each with its matcher; [(request, decision)]
        refused). A ready request's compile is awaited here if this rank's has not ended yet."""
        ready, refused = [], []
        decided = {d.index: d for d in decisions}
        jobs, self.jobs = self.jobs, [job for i, job in enumerate(self.jobs) if i not in decided]
        for i in sorted(decided):
            job, decision = jobs[i], decided[i]
            if decision.message is None:
                job.req.grammar = self.backend.new_matcher(job.future.result())
                ready.append(job.req)
            else:
                refused.append((job.req, decision))
                self._release(job.future)
        return ready, refused

    def remove(self, rid: str):
        """Take the request `rid` out of the queue (aborted); None if it is not queued."""
        job = next((j for j in self.jobs if j.req.rid == rid), None)
        if job is None:
            return None
        self.jobs.remove(job)
        self._release(job.future)
        return job.req

    def clear(self) -> list:
        """Take every request out of the queue; returns them."""
        jobs, self.jobs = self.jobs, []
        for job in jobs:
            self._release(job.future)
        return [job.req for job in jobs]

    def _release(self, future: futures.Future) -> None:
        """Drop a compile no queued request waits for, unless it has started."""
        if all(job.future is not future for job in self.jobs):
            future.cancel()

    def wait(self, timeout_s: float) -> None:
        """Up to `timeout_s` until some queued compile ends."""
        futures.wait([job.future for job in self.jobs], timeout_s, return_when=futures.FIRST_COMPLETED)
