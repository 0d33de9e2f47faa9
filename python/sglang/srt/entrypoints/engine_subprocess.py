"""The scheduler of `sglang.Engine(launch_subprocess=True)`: the same scheduler process and TokenizerManager the
server uses, driven from a private event loop in a background thread. As behind the server, a scheduler process that
dies, or completes no step for --watchdog-timeout while a call awaits it, ends the call with a RuntimeError naming it.

Shutdown closes the loop explicitly (also at interpreter exit when the caller never calls `Engine.shutdown()`):
a loop left for the garbage collector is closed after its self-pipe socket, which printed
"ValueError: Invalid file descriptor: -1" at exit.
"""

from __future__ import annotations

import asyncio
import atexit
import threading

from sglang.srt.managers.scheduler_process import start_scheduler
from sglang.srt.managers.tokenizer_manager import RequestError, TokenizerManager
from sglang.srt.server_args import ServerArgs


class SubprocessScheduler:
    def __init__(self, server_args: ServerArgs, tokenizer) -> None:
        self.proc, self.ready, ports = start_scheduler(server_args)
        self.loop = asyncio.new_event_loop()
        self.thread = threading.Thread(target=self.loop.run_forever, name="sglang-engine-loop", daemon=True)
        self.thread.start()

        async def make() -> TokenizerManager:  # ZMQ asyncio sockets bind to the loop they are made in
            tm = TokenizerManager(tokenizer, self.ready, ports.scheduler_input, ports.tokenizer_input,
                                  tokenizer_input_remote=ports.tokenizer_input_remote,
                                  channel_key=ports.channel_key, watchdog_timeout=server_args.watchdog_timeout)
            tm.start()
            asyncio.get_running_loop().create_task(tm.watch_process(self.proc))  # a dead scheduler fails the calls
            return tm

        self.tm = asyncio.run_coroutine_threadsafe(make(), self.loop).result()
        self._closed = False
        atexit.register(self.shutdown)  # runs before multiprocessing's exit hook (atexit is LIFO)

    def run(self, reqs: list) -> list:
        """Generate every Req to completion in the scheduler process; returns the output dicts (shaped by
        managers/output_shaping.py, as the in-process Engine's are)."""
        async def one(req):
            last = None
            async for last in self.tm.generate(req.origin_input_ids, req.sampling_params, req.return_logprob,
                                               req.logprob_start_len, req.top_logprobs_num, rid=req.rid):
                pass
            return last.to_dict()

        async def all_of():
            return await asyncio.gather(*(one(r) for r in reqs))

        try:
            return asyncio.run_coroutine_threadsafe(all_of(), self.loop).result()
        except RequestError as e:  # refused (4xx), or the scheduler died or hung (5xx: --watchdog-timeout)
            raise (ValueError if e.status_code < 500 else RuntimeError)(e.message) from None

    def flush_cache(self) -> bool:
        """Ask the scheduler process to empty its prefix cache, as the server's /flush_cache does, and wait for its
        answer: refused (False) while requests run."""
        async def flush() -> bool:
            if self.tm.states:
                return False
            try:
                await self.tm.flush_cache()
            except RequestError:
                return False
            return True

        return asyncio.run_coroutine_threadsafe(flush(), self.loop).result()

    def update_weights(self, model_path: str) -> str:
        """The scheduler process loads another checkpoint (TokenizerManager.update_weights_from_disk); raises
        ValueError when refused."""
        try:
            return asyncio.run_coroutine_threadsafe(self.tm.update_weights_from_disk(model_path), self.loop).result()
        except RequestError as e:
            raise ValueError(e.message) from None

    def update_tensors(self, named_tensors: list) -> str:
        """The scheduler process's TokenizerManager.update_weights_from_tensor; ValueError when refused."""
        try:
            return asyncio.run_coroutine_threadsafe(self.tm.update_weights_from_tensor(named_tensors),
                                                    self.loop).result()
        except RequestError as e:
            raise ValueError(e.message) from None

    def expert_distribution(self, action: str) -> str:
        """The scheduler process's expert distribution record: start / stop / dump; ValueError when refused."""
        try:
            return asyncio.run_coroutine_threadsafe(self.tm.expert_distribution(action), self.loop).result()
        except RequestError as e:
            raise ValueError(e.message) from None

    def get_weights(self, name: str, truncate_size: int) -> list:
        """The scheduler process's TokenizerManager.get_weights_by_name; ValueError when refused."""
        try:
            return asyncio.run_coroutine_threadsafe(self.tm.get_weights_by_name(name, truncate_size),
                                                    self.loop).result().tolist()
        except RequestError as e:
            raise ValueError(e.message) from None

    def profile(self, start: bool, config=None) -> str:
        """Start (with a ProfileConfig) or stop the scheduler process's profiler, as /start_profile and
        /stop_profile do; raises ValueError when refused."""
        try:
            return asyncio.run_coroutine_threadsafe(self.tm.profile(start, config), self.loop).result()
        except RequestError as e:
            raise ValueError(e.message) from None

    def shutdown(self) -> None:
        """Stop the scheduler process, cancel the loop's tasks and close the loop; idempotent."""
        if self._closed:
            return
        self._closed = True
        atexit.unregister(self.shutdown)

        async def close():
            self.tm.close()
            tasks = [t for t in asyncio.all_tasks() if t is not asyncio.current_task()]
            for task in tasks:
                task.cancel()
            await asyncio.gather(*tasks, return_exceptions=True)

        try:
            asyncio.run_coroutine_threadsafe(close(), self.loop).result(timeout=10)
        finally:
            self.proc.kill()
            self.proc.join(timeout=10)
            self.loop.call_soon_threadsafe(self.loop.stop)
            self.thread.join(timeout=10)
            if not self.thread.is_alive():
                self.loop.close()
