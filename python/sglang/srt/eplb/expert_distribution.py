"""Expert distribution recording (upstream's --expert-distribution-recorder-mode stat and its endpoints
/start_expert_distribution_record, /stop_expert_distribution_record, /dump_expert_distribution_record): how many
tokens each routed expert of each MoE layer received, for load-balancing studies.

With the mode on, every MoE layer adds its router's choices into one device tensor [layers, experts] (one index_add
per layer, inside CUDA graphs too: no host sync); off, nothing is recorded and nothing runs. Rows of a padded static
batch (a CUDA-graph bucket larger than the batch) do not count: the static runner names the real rows (`rows`). Start
zeroes the counts, stop freezes a host copy, dump writes it (torch.save) under SGLANG_EXPERT_DISTRIBUTION_RECORDER_DIR.
Each rank records its own requests' tokens: without DP attention every rank's counts are the same; with it each rank
counts its DP group's rows (the MoE sees every group's), so one rank per group, summed, gives the whole count.
"""

from __future__ import annotations

import contextlib
import os
import time
from typing import Optional

import torch

from sglang.srt.distributed.dp_attention import get_dp_attention


class ExpertDistributionRecorder:
    def __init__(self, num_layers: int, num_experts: int, device, rank: int = 0) -> None:
        self.counts = torch.zeros(num_layers, num_experts, dtype=torch.int64, device=device)
        self.rank = rank
        self.recording = False
        self.frozen: Optional[torch.Tensor] = None  # the counts at the last stop
        self.started = 0.0
        self._rows: Optional[torch.Tensor] = None  # bool [T]: the real rows of the static batch being run

    def record(self, layer_id: int, topk_ids: torch.Tensor) -> None:
        """Add one MoE layer's choices [T, k] (global expert ids) to the counts: under DP attention (where the MoE
        routes every group's rows) only this rank's group's rows."""
        dp = get_dp_attention()
        if dp.active and dp.current is not None:
            topk_ids = topk_ids[dp.own_rows()]
        rows, k = topk_ids.shape
        ids = topk_ids.reshape(-1)
        if self._rows is not None and self._rows.numel() <= rows:  # a static batch: its padded rows count 0 (and
            real = self._rows.to(torch.int64)  # the rows a static DP round pads it with to the round's size)
            weight = torch.cat((real, real.new_zeros(rows - real.numel()))).repeat_interleave(k)
        else:
            weight = torch.ones_like(ids)
        self.counts[layer_id].index_add_(0, ids, weight)

    @contextlib.contextmanager
    def static_rows(self, rows: torch.Tensor):
        """Within: a forward of static rows, of which `rows` (bool, device) are real (computed on the device, so a
        captured graph recomputes it at every replay)."""
        self._rows = rows
        try:
            yield
        finally:
            self._rows = None

    def start(self) -> str:
        self.counts.zero_()
        self.recording, self.frozen, self.started = True, None, time.time()
        return "Start recording the expert distribution successfully"

    def stop(self) -> str:
        if not self.recording:
            raise ValueError("no expert distribution record is running; POST /start_expert_distribution_record")
        self.frozen, self.recording = self.counts.to("cpu", copy=True), False  # a copy on CPU devices too
        return "Stop recording the expert distribution successfully"

    def dump(self, out_dir: str) -> str:
        """Write {"logical_count": [layers, experts] int64, "rank", "seconds"} (the frozen counts, or the running
        ones); returns the path."""
        counts = self.frozen
        if counts is None and self.recording:
            counts = self.counts.to("cpu", copy=True)
        if counts is None:
            raise ValueError("nothing recorded yet; POST /start_expert_distribution_record first")
        os.makedirs(out_dir, exist_ok=True)
        path = os.path.join(out_dir, f"expert_distribution_recorder_{time.time():.0f}_rank{self.rank}.pt")
        torch.save({"logical_count": counts, "rank": self.rank, "seconds": time.time() - self.started}, path)
        return path


_RECORDER: Optional[ExpertDistributionRecorder] = None


def set_expert_distribution_recorder(recorder: Optional[ExpertDistributionRecorder]) -> None:
    global _RECORDER
    _RECORDER = recorder


def get_expert_distribution_recorder() -> Optional[ExpertDistributionRecorder]:
    """The recorder of this process's model, or None when the mode is off."""
    return _RECORDER


def expert_distribution_action(action: str) -> str:
    """start / stop / dump on this process's recorder (the server's endpoints and Engine's methods); returns the
    message, ValueError when refused."""
    from sglang.srt.environ import envs

    recorder = _RECORDER
    if recorder is None:
        raise ValueError("expert distribution recording is off; start the server with "
                         "--expert-distribution-recorder-mode stat")
    if action == "start":
        return recorder.start()
    if action == "stop":
        return recorder.stop()
    if action == "dump":
        path = recorder.dump(envs.SGLANG_EXPERT_DISTRIBUTION_RECORDER_DIR.get())
        return f"Dumped the expert distribution record to {path}"
    raise ValueError(f"unknown expert distribution action {action!r}")
