"""ModelRunner: loads the model (and optionally the MTP draft), sizes and owns the pools, runs forwards."""

from __future__ import annotations

import dataclasses
import functools
import logging
import os
from typing import Optional

import torch

from sglang.srt.configs.deepseek_v4 import DeepseekV4Config
from sglang.srt.distributed.dp_attention import get_dp_attention
from sglang.srt.distributed.parallel_state import get_parallel_state
from sglang.srt.environ import envs
from sglang.srt.eplb.expert_distribution import ExpertDistributionRecorder, set_expert_distribution_recorder
from sglang.srt.layers.attention.dsv4.torch_backend import TorchAttnBackend
from sglang.srt.layers.logits_processor import LogitsProcessorOutput
from sglang.srt.layers.quantization.mxfp4 import Mxfp4RoutedExperts
from sglang.srt.mem_cache.deepseek_v4_allocator import DeepSeekV4TokenAllocator
from sglang.srt.mem_cache.deepseek_v4_pool import DeepSeekV4TokenToKVPool
from sglang.srt.mem_cache.file_tier import FileTier
from sglang.srt.mem_cache.host_tier import HostTier
from sglang.srt.mem_cache.pool_sizing import plan_pools_for_args, pool_budget_bytes
from sglang.srt.mem_cache.req_to_token_pool import ReqToTokenPool
from sglang.srt.model_executor.cuda_graph_runner import CudaGraphRunner, StaticGraphRunner
from sglang.srt.model_executor.forward_batch_info import ForwardBatch
from sglang.srt.model_loader.model_builder import PartialUpdateError, load_models, reload_weights
from sglang.srt.model_loader.model_path import resolve_model_path
from sglang.srt.models.deepseek_v4 import fuse_shared_experts, join_projections
from sglang.srt.platform import memory_budget_bytes
from sglang.srt.server_args import ServerArgs

logger = logging.getLogger(__name__)

_DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16, "float16": torch.float16}


# Config fields that say how weights are stored, not what they compute: a weight update may change them where the
# served weights do not keep the stored formats (reload_weights compares the kept formats).
_STORAGE_FIELDS = frozenset(("quantization_config", "expert_dtype"))


class ModelRunner:
    def __init__(self, server_args: ServerArgs) -> None:
        self.server_args = args = server_args
        self.device = torch.device(args.device)
        self.dtype = _DTYPES[args.dtype]
        self.model_path = resolve_model_path(args.model_path)
        self.model_config = config = DeepseekV4Config.from_pretrained(self.model_path)
        torch.manual_seed(args.random_seed)  # the same on every rank: sampling agrees without a broadcast
        state = get_parallel_state()
        if state.config != args.parallel_config():
            raise RuntimeError(f"--tp {args.tp_size} --ep {args.ep_size}: this process joined {state.config}; "
                               f"multi-rank engines start through launch_server or Engine(launch_subprocess=True)")
        self.tp_rank = state.rank
        if self.device.type == "cpu":
            torch.set_num_threads(envs.SGLANG_CPU_NUM_THREADS.get())

        recorder = None
        if args.expert_distribution_recorder_mode:  # before the graphs are captured: they record too
            recorder = ExpertDistributionRecorder(config.num_hidden_layers + config.num_nextn_predict_layers,
                                                  config.n_routed_experts, self.device, state.rank)
        set_expert_distribution_recorder(recorder)
        loaded = load_models(args, self.model_path, config, self.dtype, self.device)
        self.model, self.draft_model = loaded.model, loaded.draft_model
        dp = get_dp_attention()
        if dp.active:  # the idle forwards this rank runs for other DP groups' rounds (distributed/dp_attention.py)
            dp.idle = {"main": self.model.forward_idle}
            for j in range(len(self.draft_model.mtp) if self.draft_model is not None else 0):
                dp.idle[f"draft{j}"] = functools.partial(self.draft_model.forward_idle, j)
        self.weight_bytes, self.checkpoint_bytes = loaded.weight_bytes, loaded.checkpoint_bytes
        self.kept_formats = loaded.kept
        for name, m in (("model", self.model), ("draft model", self.draft_model)):
            if m is not None:
                j = join_projections(m)
                logger.info("%s: projections joined after loading: wq_a + wkv in %d of %d attentions, wq_b + the "
                            "indexer's wq_b in %d of %d, wkv + wgate in %d of %d compressors, w1 + w3 in %d of %d "
                            "FP8 shared experts", name, j.q_kv_a, j.attentions, j.q_b_indexer, j.indexers, j.wkv_gate,
                            j.compressors, j.shared_w13, j.fp8_shared_experts)
        if args.platform_decisions.shared_experts_fusion:
            fused = sum(fuse_shared_experts(m) for m in (self.model, self.draft_model) if m is not None)
            logger.info("shared-experts fusion: the shared expert is routed expert %d in %d MoE layers",
                        config.n_routed_experts, fused)
        # The static path (captured as graphs on a GPU): DECODE steps, or whole speculative cycles.
        static_decode = not args.disable_cuda_graph
        capture = static_decode and self.device.type == "cuda"
        # Graph memory comes out of the pool budget: measured first, by capturing the largest batch on minimal pools.
        self.graph_memory_bytes = self.measure_graph_memory() if capture else 0
        self.init_memory_pool(reserved_bytes=self.graph_memory_bytes)
        self.attn_backend = self.make_attn_backend()
        self.graph_runner: Optional[StaticGraphRunner] = None
        if static_decode:
            self.graph_runner = self.graph_runner_cls()(self, args.cuda_graph_bs, use_graphs=capture)

    def update_weights_from_disk(self, model_path: str) -> str:
        """Load another checkpoint of this architecture into the served parameters in place (model_builder.
        reload_weights); the caller holds no request and empties the prefix cache after. A checkpoint that does not
        fit is refused before anything is written (ValueError); one that fails midway is rolled back by loading the
        served checkpoint again (ValueError saying so). Returns the message for the client."""
        path = resolve_model_path(model_path)
        config = DeepseekV4Config.from_pretrained(path)
        differ = [f.name for f in dataclasses.fields(config) if f.name not in _STORAGE_FIELDS and getattr(
            config, f.name) != getattr(self.model_config, f.name)]
        if differ:
            raise ValueError(f"the checkpoint at {model_path} is another architecture (config differs in "
                             f"{', '.join(differ[:6])}); a weight update takes checkpoints of the served model")
        models = {"main": self.model, **({"mtp": self.draft_model} if self.draft_model is not None else {})}
        def load(path: str, config: DeepseekV4Config) -> None:
            reload_weights(self.server_args, path, config, self.dtype, self.device, models, self.kept_formats)

        before = self._planes_fit()
        try:
            load(path, config)
            if self._planes_fit() != before:  # captured decode graphs chose their MoE path by it
                raise PartialUpdateError("its MXFP4 scale bytes leave the range the served decode path was built for")
        except PartialUpdateError as e:
            load(self.model_path, self.model_config)
            raise ValueError(f"{e}; the served weights ({self.model_path}) were loaded again") from None
        self.model_path, self.model_config = path, config  # config: differs at most in _STORAGE_FIELDS
        logger.info("weights updated from %s", path)
        return f"weights updated from {model_path}"

    def update_weights_from_tensor(self, named_tensors: list) -> str:
        """Copy (checkpoint name, tensor) pairs into the served weights in place (upstream's update_weights_from_tensor:
        RL loops that hold new weights in memory; any subset of the checkpoint's tensors, whole, each rank taking its
        part). Weights served in a float dtype take any float tensor; others (kept FP8, integer buffers) their own
        dtype only; packed experts are not addressable. All are checked before any is written (ValueError); the
        caller empties the prefix cache."""
        from sglang.srt.distributed.sharding import rank_tensor
        from sglang.srt.models.weight_loading import find_weight

        state = get_parallel_state()
        writes = []
        for item in named_tensors:
            if not (isinstance(item, (tuple, list)) and len(item) == 2 and isinstance(item[0], str)
                    and isinstance(item[1], torch.Tensor)):
                raise ValueError("named_tensors must be (checkpoint name, torch.Tensor) pairs")
            name, tensor = item
            part = (name, tensor) if state.config.tp == 1 else rank_tensor(
                name, tensor, state.config, state.coords, self.model_config.n_routed_experts)
            if part is None:  # an expert another rank holds
                continue
            target = next((t for m in (self.model, self.draft_model) if m is not None
                           for t in [find_weight(m, part[0])] if t is not None), None)
            if target is None:
                raise ValueError(f"no served weight is loaded from checkpoint tensor {name!r} (packed MXFP4 / FP8 "
                                 f"experts are not addressable)")
            if tuple(part[1].shape) != tuple(target.shape):
                raise ValueError(f"tensor {name!r} has shape {tuple(tensor.shape)}; this rank's weight is "
                                 f"{tuple(target.shape)}")
            float_target = target.dtype in _DTYPES.values()
            if not (part[1].is_floating_point() if float_target else part[1].dtype == target.dtype):
                raise ValueError(f"tensor {name!r} is {part[1].dtype}; the served weight is {target.dtype}")
            writes.append((target, part[1]))
        with torch.no_grad():
            for target, tensor in writes:
                target.copy_(tensor)
        logger.info("weights updated from %d tensors", len(writes))
        return f"updated {len(writes)} weight tensors"

    def get_weights_by_name(self, name: str, truncate_size: int = 100) -> list:
        """The first `truncate_size` rows of the weight loaded from checkpoint tensor `name` (upstream's
        /get_weights_by_name: a nested list, float32); see `weight_rows`."""
        return self.weight_rows(name, truncate_size).tolist()

    def weight_rows(self, name: str, truncate_size: int = 100, max_values: Optional[int] = None) -> torch.Tensor:
        """The first `truncate_size` rows of the weight loaded from checkpoint tensor `name`, a float32 CPU tensor,
        from the target model or the MTP draft. ValueError for a name that maps to no served tensor, under tensor
        parallelism (each rank holds a part), and for rows holding more than `max_values` values (checked before
        anything is copied)."""
        from sglang.srt.models.weight_loading import find_weight

        if get_parallel_state().config.tp > 1:
            raise ValueError("get_weights_by_name reads whole weights: serve with --tp 1")
        found = None
        for model in (self.model, self.draft_model):
            found = find_weight(model, name) if model is not None and found is None else found
        if found is None:
            raise ValueError(f"no served weight is loaded from checkpoint tensor {name!r} (names as in the checkpoint, "
                             f"e.g. 'layers.0.attn.wq_a.weight'; packed MXFP4 / FP8 experts are not readable)")
        rows = found[:truncate_size]
        if max_values is not None and rows.numel() > max_values:
            per_row = max(1, rows[:1].numel())
            raise ValueError(f"truncate_size {truncate_size}: {len(rows)} rows of {name!r} (shape "
                             f"{tuple(found.shape)}) hold {rows.numel():,} values, more than one answer may "
                             f"({max_values:,}); ask for at most {max_values // per_row} rows")
        return rows.float().cpu()

    def _planes_fit(self) -> tuple:
        """Each packed-MXFP4 expert module's scales_fit_planes (what its decode path was chosen by)."""
        return tuple(m.scales_fit_planes for model in (self.model, self.draft_model) if model is not None
                     for m in model.modules() if isinstance(m, Mxfp4RoutedExperts))

    def graph_runner_cls(self) -> type:
        if self.draft_model is None:
            return CudaGraphRunner
        from sglang.srt.speculative.eagle_cuda_graph_runner import EagleCudaGraphRunner

        return EagleCudaGraphRunner

    def make_attn_backend(self):
        args = self.server_args
        backend_cls = TorchAttnBackend
        if args.attention_backend == "triton":
            from sglang.srt.layers.attention.dsv4.triton_backend import TritonAttnBackend

            backend_cls = TritonAttnBackend
        return backend_cls(self.model_config, self.token_to_kv_pool, self.token_allocator, args.page_size,
                           self.pool_plan.shape.num_draft_tokens)

    def measure_graph_memory(self) -> int:
        """Bytes the graphs take (their memory pool plus the capture's warm-up peak): capture the largest batch
        size on pools of one request and two pages, then free everything. The graphs' activations depend on the batch
        size and the context length, not on the pool sizes, so the figure holds for the real pools."""
        import gc

        gc.collect()  # no free cached blocks first: the allocator would release them when a capture allocation
        torch.cuda.empty_cache()  # missed, and the figure would come out too small, even negative
        before = torch.cuda.memory_reserved(self.device)
        self.init_memory_pool(probe=True)
        self.attn_backend = self.make_attn_backend()
        probe = self.graph_runner_cls()(self, [max(self.server_args.cuda_graph_bs)], use_graphs=True)
        measured = torch.cuda.memory_reserved(self.device) - before
        probe.release()
        del probe
        self.attn_backend = self.token_to_kv_pool = self.token_allocator = self.req_to_token_pool = None
        gc.collect()
        torch.cuda.empty_cache()
        logger.info("CUDA graph memory: %.2f GiB reserved before sizing the pools", measured / 2**30)
        return measured

    # ---- memory pool ------------------------------------------------------------------------------
    def init_memory_pool(self, reserved_bytes: int = 0, probe: bool = False) -> None:
        """Size and allocate the pools within --mem-fraction-static, less `reserved_bytes` (CUDA graphs). `probe`:
        pools of one request and two pages (measure_graph_memory)."""
        args, config = self.server_args, self.model_config
        free, total = memory_budget_bytes(args.device)
        budget = pool_budget_bytes(self.device.type, free, total, args.mem_fraction_static, reserved_bytes)
        self.pool_plan, kv_format, index_format, index_kind = plan_pools_for_args(
            config, args, budget, self.dtype, with_draft=self.draft_model is not None, probe=probe)
        num_layers = config.num_hidden_layers + (config.num_nextn_predict_layers if self.draft_model else 0)
        shape = self.pool_plan.shape
        self.req_to_token_pool = ReqToTokenPool(shape.max_num_reqs, args.context_length, self.device)
        self.token_allocator = DeepSeekV4TokenAllocator(self.req_to_token_pool, shape.num_pages, shape.page_size,
                                                        shape.num_swa_slots, self.device, window=config.sliding_window,
                                                        num_state_slots=shape.num_state_slots)
        self.token_to_kv_pool = DeepSeekV4TokenToKVPool(config, num_layers, shape, kv_format, index_format,
                                                        index_keys_rotated=index_kind in ("fp4", "fp8"),
                                                        device=self.device)
        if not probe:
            logger.info("%s", self.pool_plan.format())
            if shape.num_state_slots:
                w, ps = config.sliding_window, shape.page_size
                logger.info("prefix cache: on (--disable-radix-cache to turn off); each running request keeps up to "
                            "%d window slots, a cached session tail %d: the window pool (%d slots, "
                            "--swa-full-tokens-ratio) keeps the tails of up to %d idle sessions, %d state slots",
                            w + ps, w, shape.num_swa_slots - 1, (shape.num_swa_slots - 1) // w, shape.num_state_slots)
        if self.pool_plan.host is not None and not probe:
            tier = HostTier(self.token_to_kv_pool, self.pool_plan.host, args.hicache_write_policy,
                            args.hicache_io_backend)
            if args.hicache_storage_backend == "file":
                tier.files = FileTier(tier.pool, args.file_tier_config(), args.hicache_storage_prefetch_policy,
                                      model_identity=os.path.realpath(self.model_path))
            self.token_allocator.attach_host_tier(tier)
            logger.info("prefix cache %s", tier.describe())

    # ---- forward ----------------------------------------------------------------------------------
    def attach(self, forward_batch: ForwardBatch, attn_backend=None) -> None:
        """Give the batch the page table and an attention backend (default: the runner's), and build its metadata."""
        backend = attn_backend or self.attn_backend
        forward_batch.req_to_token_pool = self.req_to_token_pool
        forward_batch.attn_backend = backend
        backend.init_forward_metadata(forward_batch)

    @torch.inference_mode()
    def forward(self, forward_batch: ForwardBatch) -> LogitsProcessorOutput:
        self.attach(forward_batch)
        return self.model(forward_batch.input_ids, forward_batch.positions, forward_batch)

    @torch.inference_mode()
    def finish_dp_round(self) -> None:
        """DP attention: after this rank's step, serve the other DP groups' forwards with idle ones until every rank
        is done (distributed/dp_attention.py); nothing without DP attention."""
        dp = get_dp_attention()
        if dp.active:
            dp.finish_round()

    def can_run_decode_graph(self, batch_size: int) -> bool:
        """Whether a DECODE batch of this size runs the static path (replayed graphs on a GPU)."""
        return isinstance(self.graph_runner, CudaGraphRunner) and self.graph_runner.can_run(batch_size)

    def forward_decode(self, input_ids: Optional[list], slots: torch.Tensor,
                       input_ids_device: Optional[torch.Tensor] = None) -> LogitsProcessorOutput:
        """One DECODE forward through the static buffers (see can_run_decode_graph); `slots`: the allocator's
        plan_extend table of the step (written to the device by the forward). The input tokens come from the host
        (`input_ids`) or are already on the device (`input_ids_device`: the previous step's samples, overlap)."""
        return self.graph_runner.forward(input_ids, slots, input_ids_device)

    @torch.inference_mode()
    def forward_draft(self, forward_batch: ForwardBatch, step: int = 0,
                      metadata_ready: bool = False) -> LogitsProcessorOutput:
        """One MTP pass over rows (Hs_p, x_{p+1}) at positions p; see models/deepseek_v4_nextn.py.
        `metadata_ready`: the multi-step draft backend already attached pools and built this step's metadata."""
        if self.draft_model is None:
            raise RuntimeError("the draft model is not loaded (start with --speculative-algorithm EAGLE)")
        if not metadata_ready:
            self.attach(forward_batch)
        return self.draft_model(forward_batch.input_ids, forward_batch.positions, forward_batch, step)
