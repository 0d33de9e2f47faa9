"""The scheduler process: owns the ModelRunner and Scheduler, talks to the HTTP process over ZMQ.
`start_scheduler` spawns it (for the HTTP server and sglang.Engine(launch_subprocess=True)) and waits until ready.

With --tp N it spawns N of them, one per rank (distributed/parallel_state.py). Rank 0 alone receives from the HTTP
process: each loop it broadcasts the messages it received to every rank, and every rank then admits, aborts and steps
exactly alike (the scheduler is deterministic and the sampling seeds are equal), so the ranks run the same batches
and meet in the same collectives; only rank 0 sends outputs. With --enable-dp-attention --dp D, rank 0 gives each
new request to a DP group (round robin), the ranks of a group admit and step alike, the first rank of each group
sends its requests' outputs, and every loop is a round of all ranks (distributed/dp_attention.py): a group with
nothing to run serves the others' MoE layers with idle forwards. A rank that dies or stops answering fails the others'
next collective within --dist-timeout; the parent sees a rank process gone and stops the server, naming it.

Loop: drain incoming messages (blocking only when idle), then run one scheduler step and send every request's
progress; a step is reported even when no request progressed in it (a prefill chunk), so the HTTP side's watchdog
(--watchdog-timeout) hears from a scheduler that is alive and stepping, and from no other. A failure inside a step
aborts only the requests that cause it (Scheduler.step isolates them); a failure outside the model step (a
scheduler bug) aborts every request, and the loop goes on. Either way the failed step is
counted in the stats sent with each output, which the HTTP side's /health reads. A request rejected at admission is
answered with its error, so the HTTP side can return a 4xx.
"""

from __future__ import annotations

import atexit
import dataclasses
import logging
import multiprocessing as mp
import os
import shutil
import tempfile
import time
import traceback
from typing import Optional

import zmq

from sglang.srt.disaggregation.messages import BootstrapInfo
from sglang.srt.environ import envs
from sglang.srt.eplb.expert_distribution import expert_distribution_action
from sglang.srt.managers.io_struct import (
    MAX_WEIGHT_VALUES, AbortReq, BatchOutput, ClearHiCacheReq, ControlOutput, ExpertDistributionReq, FlushCacheReq,
    GetWeightsReq,
    MessageCodec, ProfileReq, ReqOutput, SchedulerReady, SchedulerStats, TokenizedGenerateReqInput, UpdateTensorsReq,
    UpdateWeightsReq, new_channel_key)
from sglang.srt.managers.schedule_batch import FinishReason, Req
from sglang.srt.server_args import ServerArgs
from sglang.srt.utils.common import configure_logging

logger = logging.getLogger(__name__)


@dataclasses.dataclass
class PortArgs:
    """ZMQ endpoints: the scheduler pulls requests from one and pushes outputs to the other. Both ipc:// sockets live
    in a private directory (mkdtemp: mode 0700), so only this user's processes on this node reach them."""

    scheduler_input: str
    tokenizer_input: str
    # DP attention over several nodes: node 0's TCP endpoint where DP groups led from other nodes send their outputs
    # (bound on --dist-init-addr's host, the address the nodes already meet at, never on every interface)
    tokenizer_input_remote: Optional[str] = None
    # signs every scheduler -> tokenizer message (io_struct.MessageCodec); node 0's reaches the other nodes' ranks
    # over the process group they joined (SchedulerProcess), never over the command line or a file
    channel_key: bytes = dataclasses.field(default_factory=new_channel_key, repr=False)


class SchedulerProcess:
    def __init__(self, server_args: ServerArgs, port_args: PortArgs) -> None:
        from sglang.srt.distributed.dp_attention import get_dp_attention
        from sglang.srt.distributed.parallel_state import get_parallel_state
        from sglang.srt.managers.scheduler import Scheduler
        from sglang.srt.managers.server_warmup import run_server_warmup
        from sglang.srt.utils.compile_watch import watch_compiles
        from sglang.srt.model_executor.model_runner import ModelRunner
        from sglang.srt.utils.hf_transformers_utils import load_tokenizer

        self.runner = ModelRunner(server_args)
        self.tokenizer = load_tokenizer(server_args.tokenizer_path or self.runner.model_path)
        self.scheduler = Scheduler(self.runner, self.tokenizer)
        self.scheduler.log_prefill_batches = False  # not the warm-up's prefills, nor every TP rank's (below)
        # Before the ready message: no kernel compiles inside a user's request (every rank runs the same prefills)
        self.warmup = run_server_warmup(self.scheduler, after_step=self.runner.finish_dp_round)
        # from here on a Triton compile stalls users' requests: each is logged (a variant the warm-up missed)
        self.compiles = watch_compiles() if self.runner.device.type != "cpu" else None
        self.sent: dict = {}  # rid -> output tokens already sent
        self._last_log = (time.perf_counter(), 0)
        state = get_parallel_state()
        self.ranks, self.dp, self.dp_rank = state.tp, get_dp_attention(), state.dp_rank
        key = port_args.channel_key
        if server_args.nnodes > 1:  # node 0's key, from rank 0; every rank calls this (a collective)
            key = self.ranks.broadcast_object(key)
        self.codec = MessageCodec(key)
        self.is_leader = self.ranks.rank_in_group == 0  # receives and broadcasts every message
        self.sends = state.attn_tp.rank_in_group == 0  # sends its DP group's outputs
        self.scheduler.log_prefill_batches = self.sends
        self._next_group = 0  # rank 0: the DP group of the next new request (round robin)
        self._hang_file = envs.SGLANG_TEST_HANG_SCHEDULER_FILE.get()
        # prefill/decode disaggregation: this server's side of the KV transfer (None when it serves both)
        self.kv = create_kv_manager(server_args, self.scheduler, self.ranks)
        self._sent_queues = None  # the transfer queue depths last reported
        if not self.sends:
            return
        ctx = zmq.Context()
        if self.is_leader:  # node 0's ipc socket (PortArgs): unsigned, no other host can reach it
            self.recv = ctx.socket(zmq.PULL)
            self.recv.setsockopt(zmq.LINGER, 0)
            self.recv.bind(port_args.scheduler_input)
        self.send = ctx.socket(zmq.PUSH)
        self.send.setsockopt(zmq.LINGER, 0)
        remote = server_args.node_rank > 0 and port_args.tokenizer_input_remote
        self.send.connect(port_args.tokenizer_input_remote if remote else port_args.tokenizer_input)

    def ready_message(self) -> SchedulerReady:
        r = self.runner
        return SchedulerReady(
            model_path=r.model_path, context_length=r.server_args.context_length,
            vocab_size=r.model_config.vocab_size, max_total_tokens=r.pool_plan.max_total_tokens,
            max_running_requests=r.server_args.max_running_requests, eos_token_ids=r.model_config.eos_token_ids,
            pool_report=r.pool_plan.format(), effective_args=dataclasses.asdict(r.server_args), stats=self._stats(),
            warmup_forwards=self.warmup.forwards if self.warmup is not None else 0)

    # ---- loop -----------------------------------------------------------------------------------------
    def run_forever(self) -> None:
        parent = os.getppid()
        while True:
            if os.getppid() != parent:  # the HTTP process is gone (reparented): nothing can reach us
                logger.warning("the server process exited; the scheduler stops")
                return
            busy = self.scheduler.has_work()
            if self.dp.active:  # wait for messages only when no DP group has work
                busy = self.dp.any_rank(busy)
            answers = self._handle_messages(block=not busy)
            if self.kv is not None:  # transfers that started or ended; rooms that failed
                answers += [self._progress(req) for req in self.kv.poll()]
            updated, stepped = [], self.scheduler.has_work()
            if stepped:
                self._test_hang()
                try:
                    updated = self.scheduler.step()
                except Exception:  # a scheduler bug must not take the server down: fail every request
                    logger.error("scheduler step failed:\n%s", traceback.format_exc())
                    updated = self._abort_all("internal error in the scheduler; see the server log")
                    self.scheduler.consecutive_failed_steps += 1
            self.runner.finish_dp_round()
            outputs = answers + [self._progress(req) for req in updated]
            queues = self.kv.queues() if self.kv is not None else None
            if self.kv is not None:  # another rank's pools came free (or not) too
                queues = (queues, self.kv.ranks_pools_free)
            moved = queues != self._sent_queues  # a room came or went without a step: the gauges and /server_info
            self._sent_queues = queues
            if (outputs or stepped or moved) and self.sends:  # every step is reported (the watchdog hears it)
                self.send.send_multipart(self.codec.encode(BatchOutput(outputs, self._stats())))
            if self.sends:
                self._log_progress()

    def _test_hang(self) -> None:
        """Test hook (SGLANG_TEST_HANG_SCHEDULER_FILE): before a step, hang while that file exists, alive and reading
        nothing, as a stuck device or collective would."""
        while self._hang_file and os.path.exists(self._hang_file):
            time.sleep(0.05)

    def _receive(self, block: bool) -> list:
        """Rank 0: the messages waiting (up to 1 s for the first when idle), each with the DP group that takes it (new
        requests round robin; the rest every group) and, for a disaggregated request, why its room is refused (the
        first rank alone holds the bootstrap server, so it decides for all); every rank: the same list."""
        msgs = []
        if self.is_leader:
            timeout = 1000 if block else 0
            if timeout and self.kv is not None:  # idle: also wake on a bootstrap message, or soon while rooms wait
                poller = zmq.Poller()
                for sock in [self.recv, *self.kv.sockets()]:
                    poller.register(sock, zmq.POLLIN)
                poller.poll(self.kv.idle_wait_ms())
                timeout = 0
            while self.recv.poll(timeout):
                timeout = 0
                msg = self.recv.recv_pyobj()
                group = refusal = None
                if isinstance(msg, TokenizedGenerateReqInput) and self.dp.active:
                    group, self._next_group = self._next_group, (self._next_group + 1) % self.dp.dp
                if isinstance(msg, TokenizedGenerateReqInput) and msg.bootstrap_room is not None and self.kv:
                    refusal = self.kv.claim_room(msg.bootstrap_room, msg.rid)
                msgs.append((msg, group, refusal))
        return self.ranks.broadcast_object(msgs)

    def _handle_messages(self, block: bool) -> list:
        answers = []
        for msg, group, refusal in self._receive(block):
            if group is not None and group != self.dp_rank:
                continue  # another DP group's request
            if isinstance(msg, TokenizedGenerateReqInput):
                answer = self._add(msg, refusal)
                if answer is not None:
                    answers.append(answer)
            elif isinstance(msg, AbortReq):
                owned = self.kv is not None and self.kv.owns(msg.rid)  # waiting for pool pages or its KV transfer
                req = self.kv.abort(msg.rid) if owned else self.scheduler.abort_request(msg.rid)
                if req is not None:
                    answers.append(self._progress(req))
            elif isinstance(msg, FlushCacheReq):
                flushed = self.scheduler.flush_cache()
                answers.append(ControlOutput(msg.rid, 200, "Cache flushed") if flushed else ControlOutput(
                    msg.rid, 400, "cannot flush the cache while requests are running; retry when the server is idle"))
            elif isinstance(msg, ClearHiCacheReq):
                refusal = self.scheduler.clear_hicache_storage()
                answers.append(ControlOutput(msg.rid, 400 if refusal else 200,
                                             refusal or "Hierarchical cache storage backend cleared."))
            elif isinstance(msg, ProfileReq):
                answers.append(self._profile(msg))
            elif isinstance(msg, (UpdateWeightsReq, UpdateTensorsReq)):
                answers.append(self._update_weights(msg))
            elif isinstance(msg, GetWeightsReq):
                answers.append(self._get_weights(msg))
            elif isinstance(msg, ExpertDistributionReq):
                answers.append(self._expert_distribution(msg))
            else:
                logger.error("unknown message %r", type(msg).__name__)
        return answers

    def _profile(self, msg: ProfileReq) -> ControlOutput:
        """Start or stop this rank's profile (every rank gets the message; the first rank's answer is the reply)."""
        profiler = self.scheduler.profiler
        try:
            return ControlOutput(msg.rid, 200, profiler.start(msg.config) if msg.start else profiler.stop())
        except ValueError as e:
            return ControlOutput(msg.rid, 400, str(e))
        except Exception as e:  # e.g. the trace could not be written: the server goes on
            logger.exception("profile request failed")
            return ControlOutput(msg.rid, 500, f"profiling failed on rank {profiler.rank}: {e}")

    def _update_weights(self, msg) -> ControlOutput:
        """An UpdateWeightsReq (a checkpoint directory) or UpdateTensorsReq (tensors in the message)."""
        try:
            if isinstance(msg, UpdateWeightsReq):
                return ControlOutput(msg.rid, 200, self.scheduler.update_weights_from_disk(msg.model_path))
            return ControlOutput(msg.rid, 200, self.scheduler.update_weights_from_tensor(msg.named_tensors))
        except ValueError as e:  # requests running, or weights that do not fit (nothing changed)
            return ControlOutput(msg.rid, 400, str(e))
        except Exception as e:
            logger.exception("weight update failed")
            return ControlOutput(msg.rid, 500, f"weight update failed: {e}")

    def _get_weights(self, msg: GetWeightsReq) -> ControlOutput:
        """The rows as a tensor: the HTTP process makes the lists (slow for wide weights) off this loop."""
        try:
            data = self.scheduler.runner.weight_rows(msg.name, msg.truncate_size, MAX_WEIGHT_VALUES)
        except ValueError as e:
            return ControlOutput(msg.rid, 400, str(e))
        return ControlOutput(msg.rid, 200, "ok", data)

    def _expert_distribution(self, msg: ExpertDistributionReq) -> ControlOutput:
        try:
            return ControlOutput(msg.rid, 200, expert_distribution_action(msg.action))
        except ValueError as e:
            return ControlOutput(msg.rid, 400, str(e))

    def _add(self, msg: TokenizedGenerateReqInput, refusal: Optional[Exception] = None):
        req = Req(rid=msg.rid, origin_input_ids=list(msg.input_ids), sampling_params=msg.sampling_params,
                  return_logprob=msg.return_logprob, logprob_start_len=msg.logprob_start_len,
                  top_logprobs_num=msg.top_logprobs_num)
        try:
            if refusal is not None:  # its room, refused by the first rank
                raise refusal
            if msg.bootstrap_room is not None and self.kv is not None:
                self.kv.add(req, BootstrapInfo(msg.bootstrap_host, msg.bootstrap_port, msg.bootstrap_room))
            else:
                self.scheduler.add_request(req)
        except Exception as e:  # refused; a ValueError names what the client got wrong, anything else is our bug
            status, message = 400, str(e)
            if not isinstance(e, ValueError):
                logger.exception("admitting request %s failed", msg.rid)
                status, message = 500, f"internal error admitting request {msg.rid}; see the server log"
            return ReqOutput(rid=msg.rid, new_token_ids=[], new_logprobs=[], new_top_logprobs=[],
                             prompt_tokens=len(msg.input_ids), completion_tokens=0,
                             finished_reason=FinishReason("abort", message=message, status_code=status).to_json(),
                             error=message)
        self.sent[msg.rid] = 0
        return None

    def _abort_all(self, message: str) -> list:
        reqs = list(self.scheduler.running) + list(self.scheduler.waiting) + self.scheduler.drop_grammar_queue()
        self.scheduler.waiting.clear()
        for req in reqs:
            self.scheduler.fail_request(req, message)
        return reqs

    def _progress(self, req: Req) -> ReqOutput:
        start = self.sent.get(req.rid, 0)
        first = start == 0 and bool(req.output_ids)
        out = ReqOutput(
            rid=req.rid, new_token_ids=req.output_ids[start:], new_logprobs=req.output_token_logprobs[start:],
            new_top_logprobs=req.output_top_logprobs[start:], prompt_tokens=len(req.origin_input_ids),
            completion_tokens=len(req.output_ids),
            finished_reason=req.finished_reason.to_json() if req.finished else None,
            input_token_logprobs=list(req.input_token_logprobs) if (first or req.finished) and req.return_logprob
            else None, spec_accept_length=req.spec_accept_length, cached_tokens=req.cached_tokens,
            queue_time=req.admitted_time - req.created_time if req.finished and req.admitted_time else None)
        if req.finished:
            self.sent.pop(req.rid, None)
        else:
            self.sent[req.rid] = len(req.output_ids)
        return out

    def _log_progress(self, every_s: float = 10.0) -> None:
        """A periodic decode log line: running/queued requests, token usage, throughput, accept length."""
        now = time.perf_counter()
        last_time, last_tokens = self._last_log
        if now - last_time < every_s:
            return
        s = self.scheduler
        rate = (s.num_generated_tokens - last_tokens) / (now - last_time)
        accept = s.mean_accept_length
        accept = f", accept len {accept:.2f}" if accept is not None else ""
        if s.has_work() or rate > 0:
            logger.info("running %d, queued %d, token usage %.2f, new-token ratio %.3f, retracted %d, gen throughput "
                        "%.1f tok/s%s", len(s.running), len(s.waiting), s.allocator.token_usage(),
                        s.new_token_ratio.value, s.num_retractions, rate, accept)
        self._last_log = (now, s.num_generated_tokens)

    def _stats(self) -> SchedulerStats:
        s = self.scheduler
        return SchedulerStats(num_running_reqs=len(s.running), num_waiting_reqs=len(s.waiting),
                              token_usage=s.allocator.token_usage(), num_generated_tokens=s.num_generated_tokens,
                              pools_all_free=s.allocator.is_all_free() and (self.kv is None
                                                                            or self.kv.ranks_pools_free),
                              consecutive_failed_steps=s.consecutive_failed_steps,
                              spec_accept_length=s.mean_accept_length, num_retractions=s.num_retractions,
                              new_token_ratio=s.new_token_ratio.value,
                              cache_hit_rate=s.allocator.cache.hit_rate() if s.allocator.cache else 0.0,
                              cache_queried_tokens=s.allocator.cache.queried_tokens if s.allocator.cache else 0,
                              hicache=s.allocator.host_tier.stats.take() if s.allocator.host_tier else None,
                              dp_rank=self.dp_rank, transfer=self.kv.stats.take() if self.kv is not None else None,
                              transfer_queues=self.kv.queues() if self.kv is not None else None)


def create_kv_manager(server_args: ServerArgs, scheduler, ranks=None):
    """This server's side of prefill/decode disaggregation (disaggregation/): the transfer backend with its pools
    registered (one per TP rank, each its own session), and on the first rank of `ranks` (the TP group) the
    bootstrap server (prefill, on --host:--disaggregation-bootstrap-port) or client (decode); None with
    --disaggregation-mode null."""
    mode = server_args.disaggregation_mode
    if mode == "null":
        return None
    from sglang.srt.disaggregation.bootstrap import BootstrapClient, BootstrapServer
    from sglang.srt.disaggregation.transfer import DEFAULT_WRITE_TIMEOUT_S, create_transfer_backend

    host = transfer_hostname(server_args)
    first = ranks is None or ranks.rank_in_group == 0
    backend = create_transfer_backend(server_args.disaggregation_transfer_backend, host,
                                      server_args.disaggregation_ib_device)
    room_timeout_s = envs.SGLANG_DISAGGREGATION_BOOTSTRAP_TIMEOUT.get()
    try:
        if mode == "prefill":
            from sglang.srt.disaggregation.prefill_manager import PrefillKVManager

            server = None
            if first:
                server = BootstrapServer(server_args.host, server_args.disaggregation_bootstrap_port, room_timeout_s)
                logger.info("prefill server: bootstrap server on %s:%d", server_args.host, server.port)
            logger.info("prefill server: transfer session %s", backend.session_id)
            return PrefillKVManager(scheduler, backend, server, ranks)
        from sglang.srt.disaggregation.decode_manager import DecodeKVManager

        # a cancelled room's pages stay held until the prefill side answers or any write it started has timed out
        client = BootstrapClient(backend.session_id, room_timeout_s,
                                 cancel_grace_s=DEFAULT_WRITE_TIMEOUT_S + 5) if first else None
        logger.info("decode server: transfer session %s", backend.session_id)
        return DecodeKVManager(scheduler, backend, client, room_timeout_s, ranks,
                               late_write_hold_s=envs.SGLANG_DISAGGREGATION_LATE_WRITE_HOLD.get())
    except BaseException:
        backend.close()
        raise


def transfer_hostname(server_args: ServerArgs):
    """The address peers reach this rank's transfer engine at: --host, on node 0, where the HTTP server serves on
    it; None (this host's resolved name) for a wildcard --host, and on the other nodes of --nnodes, whose ranks
    do not run where --host names."""
    if server_args.node_rank > 0 or server_args.host in ("0.0.0.0", "::", ""):
        return None
    return server_args.host


def _exit_with_parent() -> None:
    """Die with the HTTP process however it ends (a SIGKILL skips the parent's cleanup, which SIGTERM now runs:
    launch_server.exit_on_sigterm): PR_SET_PDEATHSIG on Linux, and the loop also checks the parent."""
    try:
        import ctypes
        import signal

        ctypes.CDLL("libc.so.6", use_errno=True).prctl(1, signal.SIGKILL)  # 1 = PR_SET_PDEATHSIG
    except (OSError, AttributeError):
        pass


def run_scheduler_process(server_args: ServerArgs, port_args: PortArgs, pipe, rank: int = 0,
                          init_method: str = "") -> None:
    """Entry point of a spawned scheduler process (rank `rank` of --tp); reports readiness (or the start-up error) on
    `pipe`."""
    _exit_with_parent()
    tp = server_args.tp_size
    configure_logging(server_args.log_level, prefix=" scheduler" if tp == 1 else f" rank {rank}")
    try:
        if tp > 1:
            join_ranks(server_args, rank, init_method)
        proc = SchedulerProcess(server_args, port_args)
    except Exception as e:
        pipe.send(f"{type(e).__name__}: {e}")
        raise
    pipe.send(proc.ready_message())
    proc.run_forever()


def join_ranks(server_args: ServerArgs, rank: int, init_method: str) -> None:
    """Make this process rank `rank` of the --tp world (its GPU, the process groups)."""
    import torch

    from sglang.srt.distributed.parallel_state import init_parallel_state

    on_gpu = server_args.device != "cpu"
    if on_gpu:
        torch.cuda.set_device(rank % torch.cuda.device_count())
    init_parallel_state(server_args.parallel_config(), rank, "nccl" if on_gpu else "gloo", init_method,
                        timeout_s=server_args.dist_timeout)


class SchedulerRanks:
    """The scheduler processes of this node (one per rank, from global rank `first`), seen as one: alive while
    every rank is."""

    def __init__(self, procs: list, first: int = 0) -> None:
        self.procs, self.first = procs, first

    def is_alive(self) -> bool:
        return all(p.is_alive() for p in self.procs)

    @property
    def exitcode(self):
        return next((p.exitcode for p in self.procs if not p.is_alive()), None)

    def describe_exit(self) -> str:
        dead = [f"rank {r} (exit code {p.exitcode})" for r, p in enumerate(self.procs, self.first)
                if not p.is_alive()]
        if len(self.procs) == 1 and self.first == 0:
            return f"the scheduler process died (exit code {self.procs[0].exitcode})"
        return "scheduler " + ", ".join(dead) + " exited"

    def kill(self) -> None:
        for p in self.procs:
            if p.is_alive():
                p.kill()

    def join(self, timeout: float = None) -> None:
        for p in self.procs:
            p.join(timeout)


def init_method_for(server_args: ServerArgs) -> str:
    if server_args.dist_init_addr:
        return f"tcp://{server_args.dist_init_addr}"
    import socket

    with socket.socket() as s:  # a free port for the ranks to meet on
        s.bind(("127.0.0.1", 0))
        return f"tcp://127.0.0.1:{s.getsockname()[1]}"


def port_args_for(server_args: ServerArgs, ipc_dir: str) -> PortArgs:
    """This launch's endpoints (ipc sockets under `ipc_dir`) and a fresh channel key."""
    ports = PortArgs(scheduler_input=f"ipc://{os.path.join(ipc_dir, 'scheduler')}",
                     tokenizer_input=f"ipc://{os.path.join(ipc_dir, 'tokenizer')}")
    if server_args.nnodes > 1 and server_args.enable_dp_attention:  # DP groups led from other nodes answer over TCP
        host, port = server_args.dist_init_addr.rsplit(":", 1)
        ports.tokenizer_input_remote = f"tcp://{host}:{int(port) + 1}"
    return ports


def start_scheduler(server_args: ServerArgs):
    """Spawn this node's scheduler process(es) (--tp-size / --nnodes ranks from node_rank's first) and wait until
    each has loaded the model; returns (SchedulerRanks, the first rank's ready message, ports). Used by the HTTP
    server (node 0), headless nodes and sglang.Engine(launch_subprocess=True)."""
    ipc_dir = tempfile.mkdtemp(prefix="sglang-ipc-")
    atexit.register(shutil.rmtree, ipc_dir, ignore_errors=True)  # the socket files, when this process exits
    ports = port_args_for(server_args, ipc_dir)
    ctx = mp.get_context("spawn")
    init_method = init_method_for(server_args) if server_args.tp_size > 1 else ""
    procs, readers = [], []
    per_node = server_args.tp_size // server_args.nnodes
    first = server_args.node_rank * per_node
    for rank in range(first, first + per_node):
        reader, writer = ctx.Pipe(duplex=False)
        name = "sglang-scheduler" + (f"-rank{rank}" if server_args.tp_size > 1 else "")
        proc = ctx.Process(target=run_scheduler_process, args=(server_args, ports, writer, rank, init_method),
                           daemon=True, name=name)
        proc.start()
        procs.append(proc)
        readers.append(reader)
    ranks = SchedulerRanks(procs, first)
    readies = []
    try:
        for rank, (proc, reader) in enumerate(zip(procs, readers), first):
            while not reader.poll(1.0):
                if not ranks.is_alive():
                    errors = [f"rank {r}: {m.recv()}" for r, m in enumerate(readers, first) if r != rank and m.poll()]
                    if errors:
                        raise RuntimeError("the scheduler process failed to start: " + "; ".join(errors))
                    raise RuntimeError(f"{ranks.describe_exit()} during start-up; if this is a script creating "
                                       f"sglang.Engine(launch_subprocess=True), it needs the "
                                       f"`if __name__ == \"__main__\":` guard (the scheduler process is spawned and "
                                       f"re-imports the script)")
            readies.append(reader.recv())
        failed = [(r, m) for r, m in enumerate(readies) if not isinstance(m, SchedulerReady)]
        if failed:
            raise RuntimeError("the scheduler process failed to start: " + "; ".join(
                (f"rank {r + first}: {m}" if len(procs) > 1 else str(m)) for r, m in failed))
    except BaseException:
        ranks.kill()
        ranks.join(timeout=5)
        raise
    return ranks, readies[0], ports
