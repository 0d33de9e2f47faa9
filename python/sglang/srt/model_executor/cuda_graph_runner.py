"""CUDA graphs over static buffers: StaticGraphRunner (shared), CudaGraphRunner (DECODE).

Per step the host writes the step's inputs (the allocator's plan_extend table: request slot, position, full slot,
window slot of every new row; and token ids) into one pinned block, padded to the smallest captured batch size >= the
batch, and issues one non_blocking copy into the static device block every graph reads. The replay writes the new
slots to the page table and window map, derives the attention metadata on the device at capacity-static shapes
(decode_metadata.py) and runs the model: one launch whatever the model. A runner's rows are `rows_per_req` per request,
request-major: 1 for DECODE, k+1 for a speculative cycle (speculative/eagle_cuda_graph_runner.py).

Padded rows (raw batch 3 in a graph of 4) are request slot 0 at position 0 with full slot 0 and window slot -1: they
map nothing, read no window key, store nothing, complete no entry and write only request 0's staging rows.

On CPU the same static path runs eagerly (no graphs): the CPU test suite checks it against the general path.
Batches above the largest size, and every batch under --disable-cuda-graph, run the general (eager) path.

DP attention (DECODE only): the step opens its round before the replay (distributed/dp_attention.py); a static round
replays the round's batch size (the largest of the busy groups'), an ordinary one runs this step's rows eagerly.
"""

from __future__ import annotations

import logging
import time
from abc import ABC, abstractmethod
from typing import Optional

import torch

from sglang.srt.distributed.dp_attention import get_dp_attention
from sglang.srt.eplb.expert_distribution import get_expert_distribution_recorder
from sglang.srt.layers.logits_processor import LogitsProcessorOutput
from sglang.srt.mem_cache.deepseek_v4_allocator import write_slots_on_device
from sglang.srt.model_executor.forward_batch_info import ForwardBatch, ForwardMode
from sglang.srt.utils.graph_capture import graph_capture_region

logger = logging.getLogger(__name__)

_REQS, _POSITIONS, _OUT_LOC, _SWA, _IDS = range(5)  # rows of the static input block (the first 4: plan_extend's)
_PADDING = (0, 0, 0, -1, 0)  # a padded row: request 0, position 0, full slot 0, no window slot, token 0


class StaticGraphRunner(ABC):
    """Static input block, padding, capture and replay; a subclass defines `_run(bs)` (the captured work, returning
    a tuple of output tensors) and the step that stages its inputs."""

    rows_per_req = 1
    kind = "decode"

    def __init__(self, model_runner, batch_sizes: list, use_graphs: bool) -> None:
        """`model_runner`: ModelRunner (its model, attach()); `use_graphs`: capture now (CUDA only)."""
        if not batch_sizes or min(batch_sizes) < 1:
            raise ValueError(f"CUDA graph batch sizes must be positive, got {batch_sizes}")
        self.runner = model_runner
        self.batch_sizes = sorted(batch_sizes)
        self.max_bs = self.batch_sizes[-1]
        device = model_runner.device
        width = self.max_bs * self.rows_per_req
        self.host = torch.tensor(_PADDING).repeat(width, 1).T.contiguous()
        if device.type == "cuda":
            self.host = self.host.pin_memory()
        self.inputs = self.host.to(device)
        self.padding = self.host[:, :1].clone()  # [5, 1]
        self.rows = torch.arange(width, device=device)
        self.ones = torch.ones(width, dtype=torch.int64, device=device)
        self._copied: Optional[torch.cuda.Event] = None  # the last host -> device copy (the host block is reused)
        self.graphs: dict = {}
        self.outputs: dict = {}  # bs -> the graph's output tensors
        self.graph_memory_bytes = 0
        if use_graphs:
            self.capture()

    def can_run(self, batch_size: int) -> bool:
        return 0 < batch_size <= self.max_bs

    def padded_size(self, batch_size: int) -> int:
        return next(bs for bs in self.batch_sizes if bs >= batch_size)

    def _write_slots(self, bs: int) -> None:
        """The step's new rows into the page table and window map, on the device (part of the replay)."""
        allocator = self.runner.token_allocator
        v = self.inputs[:, :bs * self.rows_per_req]
        write_slots_on_device(allocator.req_to_token_pool.req_to_token, allocator.full_to_swa, v[_REQS],
                              v[_POSITIONS], v[_OUT_LOC], v[_SWA])

    @abstractmethod
    def _run(self, bs: int) -> tuple:
        """The work one graph captures, for `bs` requests of static rows; returns its output tensors."""

    def _run_rows(self, bs: int) -> tuple:
        """`_run`, telling an expert distribution recorder which static rows are real (a padded row has no window
        slot); the comparison runs on the device, inside the graph when captured."""
        recorder = get_expert_distribution_recorder()
        if recorder is None:
            return self._run(bs)
        with recorder.static_rows(self.inputs[_SWA, :bs * self.rows_per_req] >= 0):
            return self._run(bs)

    def _capture_round(self, bs: int) -> None:
        """Before each capture or warm-up run: the DP round it runs in (set, not exchanged), for runners whose work
        joins DP rounds."""

    # ---- capture ------------------------------------------------------------------------------------
    @torch.inference_mode()
    def capture(self) -> None:
        """Capture one graph per batch size, largest first, all in one memory pool (replays never overlap)."""
        start, before = time.perf_counter(), torch.cuda.memory_reserved()
        self.inputs.copy_(self.padding)  # every row a padded row while capturing: nothing real is read or written
        pool = None
        stream = torch.cuda.Stream()
        for bs in reversed(self.batch_sizes):
            with graph_capture_region():  # the warm-up picks the kernels the capture records (utils/graph_capture)
                with torch.cuda.stream(stream):
                    for _ in range(2):  # warm-up: Triton compilation, cuBLAS workspaces, lazy allocations
                        self._capture_round(bs)
                        self._run_rows(bs)
                stream.synchronize()
                graph = torch.cuda.CUDAGraph()
                self._capture_round(bs)
                with torch.cuda.graph(graph, pool=pool, stream=stream):
                    out = self._run_rows(bs)
            pool = graph.pool()
            self.graphs[bs], self.outputs[bs] = graph, out
        torch.cuda.synchronize()
        self.graph_memory_bytes = torch.cuda.memory_reserved() - before
        logger.info("captured CUDA graphs for %s batch sizes %s in %.1f s (%.2f GiB)", self.kind, self.batch_sizes,
                    time.perf_counter() - start, self.graph_memory_bytes / 2**30)

    def release(self) -> None:
        """Destroy the captured graphs (and with them their memory pool). A rank must do this before it leaves the
        world: a live graph that captured NCCL kernels keeps ncclCommDestroy, hence destroy_process_group, waiting
        forever (pytorch#115388; seen on 2 H200s). Afterwards the static path runs eagerly."""
        if self.graphs and torch.cuda.is_available():
            torch.cuda.synchronize()  # no replay may be in flight while its executable graph is destroyed
        for graph in self.graphs.values():
            graph.reset()
        self.graphs.clear()
        self.outputs.clear()

    # ---- one step -----------------------------------------------------------------------------------
    def _stage(self, slots: torch.Tensor, ids: Optional[list], bs: int) -> None:
        """Write the step's rows (`slots`: plan_extend's [4, N] table, N <= bs * rows_per_req) and token ids (one per
        row for DECODE, one per request for a cycle) into the pinned block, padded to `bs` requests, and copy it to
        the device with one non_blocking copy."""
        n = slots.shape[1]
        if self._copied is not None and not self._copied.query():
            self._copied.synchronize()  # the previous copy still reads the pinned block (never seen: the step's
            # read-back, later in stream order, has waited for it)
        host = self.host[:, :bs * self.rows_per_req]
        host[:, n:] = self.padding
        host[:_IDS, :n] = slots
        host[_IDS, :n] = 0
        if ids is not None:
            host[_IDS, :len(ids)] = torch.tensor(ids)
        on_gpu = self.inputs.device.type == "cuda"
        self.inputs[:, :host.shape[1]].copy_(host, non_blocking=on_gpu)
        if on_gpu:
            self._copied = torch.cuda.Event()
            self._copied.record()

    def _replay(self, bs: int) -> tuple:
        """The captured work for `bs` requests: replayed, or run eagerly when no graph was captured (CPU)."""
        graph = self.graphs.get(bs)
        if graph is None:
            return self._run_rows(bs)
        graph.replay()
        return self.outputs[bs]


class CudaGraphRunner(StaticGraphRunner):
    """DECODE: one row per request; under overlap scheduling the token ids are the previous step's samples, copied
    device to device after the block."""

    def forward_batch(self, bs: int) -> ForwardBatch:
        """The DECODE batch of the first `bs` static rows."""
        v = self.inputs[:, :bs]
        return ForwardBatch(forward_mode=ForwardMode.DECODE, input_ids=v[_IDS], positions=v[_POSITIONS],
                            out_cache_loc=v[_OUT_LOC], req_pool_indices=v[_REQS], extend_seq_lens=self.ones[:bs],
                            extend_start_loc=self.rows[:bs], row_req=self.rows[:bs], capacity_static=True)

    def _capture_round(self, bs: int) -> None:
        dp = get_dp_attention()
        if dp.active:
            dp.static_round("main", bs)

    def _run(self, bs: int) -> tuple:
        self._write_slots(bs)
        forward_batch = self.forward_batch(bs)
        self.runner.attach(forward_batch)
        return (self.runner.model(forward_batch.input_ids, forward_batch.positions, forward_batch).next_token_logits,)

    @torch.inference_mode()
    def forward(self, input_ids: Optional[list], slots: torch.Tensor,
                input_ids_device: Optional[torch.Tensor] = None) -> LogitsProcessorOutput:
        """One decode row per request: the tokens (`input_ids` on the host, or `input_ids_device` [B] already on the
        device) and `slots`, the allocator's plan_extend table [4, B] (one new position per request, not yet on the
        device). Replays, or runs the static path eagerly when no graph was captured; returns the real rows' logits."""
        raw = slots.shape[1]
        if slots.shape[0] != 4 or (input_ids is not None and len(input_ids) != raw):
            raise ValueError(f"decode needs one new position per request: slots {tuple(slots.shape)} for "
                             f"{raw if input_ids is None else len(input_ids)} rows")
        bs = self.padded_size(raw)
        static, dp = True, get_dp_attention()
        if dp.active:  # the round first, outside the graph: the largest busy group's size, or an eager run
            fwd = dp.open_round("main", bs)
            static = fwd.static
            bs = max(fwd.counts) if static else bs
        self._stage(slots, input_ids, bs)
        if input_ids is None:
            self.inputs[_IDS, :raw].copy_(input_ids_device)  # device to device, after the block copy
        try:
            (logits,) = self._replay(bs) if static else self._run_rows(bs)
        finally:
            dp.close_round()
        return LogitsProcessorOutput(next_token_logits=logits[:raw])
