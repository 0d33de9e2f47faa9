"""The bytes floor of a decode step: the bytes the step must read, over the copy bandwidth of the same run.

A decode step at small batch is bound by memory traffic, so its least possible time is the bytes it must read divided
by what the device moves at best (a large device-to-device copy, bytes read + written). What a step must read:

- weights (model_bytes): every loaded parameter of the model except the routed experts, as stored (FP8 codes and
  fp32 block scales, bf16, fp32); of the embedding table only the batch's rows; the LM head whole.
- routed experts: per MoE layer, the bytes of one expert (codes and scales) times the experts the step's tokens
  picked (ExpertTouches counts the distinct ids the router chose; without a count, the expected number under
  uniform routing, uniform_touched), plus the shared expert where it is stored as one more expert (always read).
- cache (cache_bytes): per request and layer, the window entries (min(context, window)); on CSA layers the indexer's
  keys of every visible compressed entry and the top-k entries it selects; on HCA layers every visible compressed
  entry. Entry sizes are the pools' formats (kv_formats.py). Buffers (hash routing tables, rotary caches), the
  compressors' staging rings and the metadata are left out: a few KB per step.

Per rank: with tensor / expert parallelism each rank reads its own parameters (the figures are one rank's).
"""

from __future__ import annotations

import dataclasses
import time
from typing import Optional

import torch
from torch import nn


@dataclasses.dataclass(frozen=True)
class ExpertLayer:
    """The routed experts of one MoE layer as stored: every parameter is stacked [experts, ...]."""

    layer_id: int
    bytes_per_expert: int  # codes and scales of one expert
    stored: int  # experts stored on this rank (the shared expert included where fused)
    first_routed: int  # the global id of this rank's first routed expert (expert parallelism)
    routed: int  # this rank's routed experts
    shared_fused: bool  # the shared expert is stored as expert `routed` (every token reads it)


@dataclasses.dataclass(frozen=True)
class ModelBytes:
    """A model's loaded parameters, as stored."""

    by_dtype: dict  # dtype name -> bytes of every parameter outside the routed experts (embedding, LM head included)
    embedding: int  # the embedding table
    embedding_row: int  # one row of it
    lm_head: int
    experts: tuple  # ExpertLayer per MoE layer

    @property
    def non_expert(self) -> int:
        return sum(self.by_dtype.values())

    @property
    def expert_total(self) -> int:
        return sum(e.bytes_per_expert * e.stored for e in self.experts)


def nbytes(t: torch.Tensor) -> int:
    return t.numel() * t.element_size()


def model_bytes(model: nn.Module) -> ModelBytes:
    """ModelBytes of a DeepseekV4ForCausalLM (its `embed`, `head` and MoE `ffn` modules). A parameter shared by two
    modules counts once."""
    expert_params, experts = set(), []
    for layer_id, layer in enumerate(model.layers):
        moe = layer.ffn
        params = list(moe.experts.parameters())
        stored = {p.shape[0] for p in params}
        if len(stored) != 1:
            raise ValueError(f"layer {layer_id}: routed expert parameters of leading dims {sorted(stored)}, expected "
                             f"one stacked count")
        (count,) = stored
        total = sum(map(nbytes, params))
        if total % count:
            raise ValueError(f"layer {layer_id}: {total} expert bytes do not split into {count} experts")
        fused = getattr(moe, "shared_expert_id", None) is not None
        experts.append(ExpertLayer(layer_id, total // count, count, moe.local_experts.start,
                                   len(moe.local_experts), fused))
        expert_params.update(id(p) for p in params)
    by_dtype: dict = {}
    for p in model.parameters():
        if id(p) not in expert_params:
            key = str(p.dtype).removeprefix("torch.")
            by_dtype[key] = by_dtype.get(key, 0) + nbytes(p)
    embed = model.embed.weight
    return ModelBytes(by_dtype, nbytes(embed), nbytes(embed[0]), nbytes(model.head.weight), tuple(experts))


def uniform_touched(num_experts: int, top_k: int, tokens: int) -> float:
    """Expected distinct experts `tokens` tokens pick, each `top_k` of `num_experts` uniformly: E (1 - (1 - k/E)^T)
    (the chance an expert is missed by one token is 1 - k/E)."""
    return num_experts * (1 - (1 - top_k / num_experts) ** tokens)


class ExpertTouches:
    """Inside: forward hooks on every MoE router of `model` keep the expert ids the first `rows` rows (the real ones:
    padded rows of a static batch come after them) picked in the last forward; `touched()` counts the distinct ones
    of this rank per layer. Reads the device after the step, never inside a graph."""

    def __init__(self, model: nn.Module, rows: int) -> None:
        self.model, self.rows = model, rows
        self.ids: dict = {}
        self.handles: list = []

    def __enter__(self) -> "ExpertTouches":
        for layer_id, layer in enumerate(self.model.layers):
            gate = layer.ffn.gate

            def keep(module, args, output, layer_id=layer_id):
                self.ids[layer_id] = output[1][:self.rows].detach().clone()
            self.handles.append(gate.register_forward_hook(keep))
            self._wrap_route(gate, layer_id)
        return self

    def _wrap_route(self, gate: nn.Module, layer_id: int) -> None:
        """Gate.route (forward and the local remap in one call, no forward hook fires) as well: its ids are this
        rank's (-1: another rank's, the shared expert's column last), kept as global ids."""
        route = gate.route

        def keep_route(x, input_ids, local_experts=None, shared_expert_id=None):
            weights, ids = route(x, input_ids, local_experts, shared_expert_id)
            mine = ids[:self.rows, :gate.top_k]
            start = local_experts.start if local_experts is not None else 0
            self.ids[layer_id] = torch.where(mine >= 0, mine + start, -1).detach().clone()
            return weights, ids
        gate.route = keep_route
        self.handles.append(_InstanceAttr(gate, "route"))

    def __exit__(self, *exc) -> None:
        for h in self.handles:
            h.remove()
        self.handles.clear()

    def touched(self, layers: tuple) -> dict:
        """layer id -> distinct routed experts of this rank (ExpertLayer's range) the recorded forward picked."""
        out = {}
        for e in layers:
            ids = self.ids.get(e.layer_id)
            if ids is not None:
                mine = ids[(ids >= e.first_routed) & (ids < e.first_routed + e.routed)]
                out[e.layer_id] = int(torch.unique(mine).numel())
        return out


class _InstanceAttr:
    """A handle whose remove() deletes an attribute set on an instance (uncovering its class's method)."""

    def __init__(self, obj, name: str) -> None:
        self.obj, self.name = obj, name

    def remove(self) -> None:
        self.obj.__dict__.pop(self.name, None)


@dataclasses.dataclass(frozen=True)
class CacheBytes:
    """Cache bytes the attention of one decode step reads, over every layer and request."""

    window: int  # window (sliding) KV entries
    compressed: int  # compressed KV entries attended: CSA's selected top-k, HCA's every visible entry
    index_keys: int  # the CSA indexer's keys of every visible compressed entry

    @property
    def total(self) -> int:
        return self.window + self.compressed + self.index_keys


def cache_bytes(config, context_lens: list, kv_entry: int, index_entry: int) -> CacheBytes:
    """CacheBytes of a decode step whose requests see `context_lens` tokens each (the new one included); entry sizes
    in bytes. `config`: DeepseekV4Config (its main layers; MTP layers are not part of a plain decode step)."""
    window = compressed = index = 0
    for layer_id in range(config.num_hidden_layers):
        ratio = config.compress_ratio(layer_id)
        for n in context_lens:
            window += min(n, config.sliding_window) * kv_entry
            if not ratio:
                continue
            visible = n // ratio
            if config.is_csa(layer_id):
                index += visible * index_entry
                compressed += min(visible, config.index_topk) * kv_entry
            else:
                compressed += visible * kv_entry
    return CacheBytes(window, compressed, index)


@dataclasses.dataclass(frozen=True)
class BytesFloor:
    """The bytes a decode step must read and the least time to read them, beside the measured step."""

    batch_size: int
    context_len: int  # tokens each request sees at the step the floor is taken for
    weight_bytes: int  # non-expert parameters (embedding: the batch's rows; the LM head included)
    weights_by_dtype: dict  # dtype name -> bytes stored of the non-expert parameters (the whole embedding)
    lm_head_bytes: int
    expert_bytes: float  # routed experts touched (and the fused shared expert)
    experts_touched: float  # distinct routed experts per MoE layer, mean over layers
    experts_counted: bool  # counted from the step's routing (False: the uniform-routing estimate)
    cache: CacheBytes
    copy_gbps: Optional[float]  # bytes read + written per second / 1e9, measured in the same run
    copy_device: str  # what copy_gbps measured: "cuda" (device to device) or "cpu" (a memcpy)
    step_ms: Optional[float]  # the measured decode step (median)
    total_bytes: float
    floor_ms: Optional[float]  # total_bytes / copy bandwidth
    fraction: Optional[float]  # floor_ms / step_ms: 1.0 is a step at the bytes floor

    def columns(self) -> str:
        def fmt(value: Optional[float], spec: str) -> str:
            return "n/a" if value is None else format(value, spec)

        how = "counted" if self.experts_counted else "uniform estimate"
        return (f"reads {self.total_bytes / 1e6:9.1f} MB (weights {self.weight_bytes / 1e6:.1f} incl. LM head "
                f"{self.lm_head_bytes / 1e6:.1f}, experts {self.expert_bytes / 1e6:.1f} for "
                f"{self.experts_touched:.1f}/layer {how}, cache {self.cache.total / 1e6:.1f}) | copy "
                f"{fmt(self.copy_gbps, '.0f')} GB/s ({self.copy_device}) | floor ms {fmt(self.floor_ms, '.3f')} | "
                f"fraction of the floor {fmt(self.fraction, '.3f')}")


def decode_floor(mb: ModelBytes, config, batch_size: int, context_len: int, kv_entry: int, index_entry: int,
                 touched: Optional[dict], copy_gbps: Optional[float], copy_device: str,
                 step_s: Optional[float]) -> BytesFloor:
    """BytesFloor of one decode step of `batch_size` requests at `context_len` tokens. `touched`: layer id ->
    distinct routed experts (ExpertTouches); None or a missing layer: uniform_touched over the batch's tokens."""
    touched = touched or {}
    expert_bytes = counts = 0.0
    for e in mb.experts:
        n = touched.get(e.layer_id)
        if n is None:  # this rank's share of the expected distinct experts of all of them
            n = uniform_touched(config.n_routed_experts, config.num_experts_per_tok, batch_size) \
                * e.routed / config.n_routed_experts
        counts += n
        expert_bytes += (n + e.shared_fused) * e.bytes_per_expert
    weights = mb.non_expert - mb.embedding + batch_size * mb.embedding_row
    cache = cache_bytes(config, [context_len] * batch_size, kv_entry, index_entry)
    total = weights + expert_bytes + cache.total
    floor_ms = total / (copy_gbps * 1e9) * 1e3 if copy_gbps else None
    step_ms = step_s * 1e3 if step_s is not None and step_s == step_s else None  # NaN: no decode step timed
    return BytesFloor(batch_size, context_len, weights, dict(mb.by_dtype), mb.lm_head, expert_bytes,
                      counts / max(1, len(mb.experts)),
                      bool(mb.experts) and all(e.layer_id in touched for e in mb.experts), cache, copy_gbps,
                      copy_device, step_ms, total, floor_ms,
                      floor_ms / step_ms if floor_ms is not None and step_ms else None)


def copy_bandwidth_gbps(device: torch.device, num_bytes: int = 2 << 30, iters: int = 20) -> float:
    """Copy bandwidth of `device` in GB/s, bytes read + written, median of `iters` copies of a `num_bytes` buffer
    into another: on a GPU a device-to-device copy timed by CUDA events (two 2 GiB bf16 buffers by default), on a
    CPU a memcpy timed by the wall clock."""
    a = torch.empty(num_bytes // 2, dtype=torch.bfloat16, device=device).normal_()
    b = torch.empty_like(a)
    cuda = device.type == "cuda"
    times = []
    for i in range(iters + 2):  # two warm-ups
        if cuda:
            start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
            start.record()
            b.copy_(a)
            end.record()
            end.synchronize()
            seconds = start.elapsed_time(end) / 1e3
        else:
            t = time.perf_counter()
            b.copy_(a)
            seconds = time.perf_counter() - t
        if i >= 2:
            times.append(seconds)
    times.sort()
    return 2 * nbytes(a) / times[len(times) // 2] / 1e9
