"""DeepSeek-V4 (Flash / Pro), written to read like docs/dsv4-architecture.md sections 3 to 7.

Letters: T packed token rows, D hidden, n hc streams, H heads, Dh head dim (K = V), Dr rotary dims,
G output groups, Ro o_lora_rank, nI/dI indexer heads/dim, E experts, k experts per token.
Parameter names are the hub checkpoint's native names (`layers.N.attn.wq_a.weight`, `hc_head_fn`, ...);
routed experts are stacked per layer (`ffn.experts.w1` [E, I, D]). Everything that touches the cache goes
through `forward_batch.attn_backend`.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Optional, Union

import torch
from torch import nn

from sglang.srt.configs.deepseek_v4 import CSA_RATIO, DeepseekV4Config
from sglang.srt.distributed.dp_attention import get_dp_attention
from sglang.srt.distributed.parallel_state import get_parallel_state
from sglang.srt.distributed.sharding import local_expert_range
from sglang.srt.eplb.expert_distribution import get_expert_distribution_recorder
from sglang.srt.layers.attention.dsv4.hadamard import hadamard_rotate
from sglang.srt.layers.logits_processor import LogitsProcessor, LogitsProcessorOutput
from sglang.srt.layers.fp32_linear import linear_fp32_out, uses_tensor_cores
from sglang.srt.layers.fused_linear import join_linears, record_joined
from sglang.srt.layers.gpu_kernels import sgl_kernel_op
from sglang.srt.layers.mhc import hc_head, hc_post_mixes, hc_pre_norm
from sglang.srt.layers.moe.experts import RoutedExperts, SharedExpert, append_shared_expert
from sglang.srt.layers.moe.router import Gate, for_local_experts
from sglang.srt.layers.norm import RMSNorm
from sglang.srt.layers.parallel_linear import ParallelLMHead, VocabParallelEmbedding
from sglang.srt.layers.quantization.fp8 import Fp8Activation, Fp8BlockLinear, w8a8_input_path
from sglang.srt.layers.rotary import RotaryEmbedding
from sglang.srt.model_executor.forward_batch_info import ForwardBatch


def make_rotary(config: DeepseekV4Config, compressed: bool) -> RotaryEmbedding:
    """Compressed layers: compress_rope_theta + YaRN; sliding-only and MTP layers: rope_theta, no YaRN."""
    if compressed:
        return RotaryEmbedding(config.qk_rope_head_dim, config.compress_rope_theta, config.rope_scaling)
    return RotaryEmbedding(config.qk_rope_head_dim, config.rope_theta, None)


class Compressor(nn.Module):
    """Gated channel-wise pooling of windows of `ratio` tokens into one entry of `head_dim` (arch 5.4).

    CSA (ratio 4) overlaps: each token projects 2*head_dim values, the A half feeding the next window's entry
    and the B half its own. The rest runs in the backend, in one op (it reads the staging ring): the pool, then this
    module's RMSNorm `norm` and RoPE `rotary` at the window's first position w*m, in the weights' dtype.
    """

    def __init__(self, config: DeepseekV4Config, layer_id: int, ratio: int, head_dim: int,
                 rotary: RotaryEmbedding, is_indexer: bool) -> None:
        super().__init__()
        self.layer_id, self.ratio, self.head_dim, self.is_indexer = layer_id, ratio, head_dim, is_indexer
        self.overlap = ratio == CSA_RATIO  # CSA: overlapping windows
        self.width = width = (2 if self.overlap else 1) * head_dim
        self.wkv = nn.Linear(config.hidden_size, width, bias=False)
        self.wgate = nn.Linear(config.hidden_size, width, bias=False)
        self.wkv_gate = None  # wkv and wgate as one linear, after loading (join_projections)
        self.ape = nn.Parameter(torch.zeros(ratio, width, dtype=torch.float32))
        self.norm = RMSNorm(head_dim, config.rms_norm_eps)
        self.rotary = rotary

    def join_projections(self) -> bool:
        """wkv and wgate (both read x) as one linear: one fp32 GEMM whose output is already the backend's
        [T, 2, width] (content, gate) layout."""
        return join_linears(self, ["wkv", "wgate"], "wkv_gate")

    def projection_weights(self) -> list:
        """The weights project() reads x with: the joined wkv_gate, or wkv and wgate."""
        return [self.wkv_gate.weight] if self.wkv_gate is not None else [self.wkv.weight, self.wgate.weight]

    def forward(self, x: torch.Tensor, positions: torch.Tensor, forward_batch: ForwardBatch,
                xf: Optional[torch.Tensor] = None, kv_gate: Optional[torch.Tensor] = None) -> None:
        """xf: x.float() where the caller has it (a CSA layer's two compressors share one cast); kv_gate: the
        projection below, where the caller computed it (Attention.compressor_inputs)."""
        if kv_gate is None:
            kv_gate = self.project(x, positions, forward_batch, xf)
        forward_batch.attn_backend.forward_compressor(self, kv_gate, forward_batch, compute_dtype=x.dtype)

    def project(self, x: torch.Tensor, positions: torch.Tensor, forward_batch: ForwardBatch,
                xf: Optional[torch.Tensor] = None) -> torch.Tensor:
        """-> [T, 2, width] fp32 (content, gate logit + ape): the torch path and reference of dsv4_compressor_proj."""
        # The reference computes both projections in fp32: of bf16 x and bf16-kept weights (model_builder) that is a
        # bf16 GEMM with fp32 output (layers/fp32_linear.py); ape is the bias of the token's slot in its window.
        if self.wkv_gate is not None:
            kv_gate = linear_fp32_out(x, self.wkv_gate.weight, xf).view(-1, 2, self.width)
        else:
            kv_gate = torch.stack((linear_fp32_out(x, self.wkv.weight, xf), linear_fp32_out(x, self.wgate.weight, xf)),
                                  1)
        offset = forward_batch.attn_metadata.ratios[self.ratio].window_offset  # positions % ratio, once per step
        # in place on the gate half's view: `kv_gate[:, 1] += ...` would also copy the sum back onto itself
        kv_gate[:, 1].add_(self.ape[positions % self.ratio if offset is None else offset])
        return kv_gate


@dataclass
class CompressorInputs:
    """A compressed layer's projections of x for its compressors and indexer (Attention.compressor_inputs): all of
    them from one fused launch, or only x.float() for the torch path (the rest None: computed by the modules)."""
    xf: Optional[torch.Tensor] = None  # x.float(), where the torch path's GEMMs read it
    kv_gate: Optional[torch.Tensor] = None  # [T, 2, width] fp32 of the attention's compressor
    index_kv_gate: Optional[torch.Tensor] = None  # the same of the indexer's compressor
    index_weights: Optional[torch.Tensor] = None  # [T, nI] fp32: weights_proj(x) * weight_scale


# Rows up to which the compressors' projections run as one fused launch (sgl_kernel/dsv4_compressor_proj.py has the
# H100 figures): at 1-2 rows it halves the torch path's time; from 4 rows cuBLAS's fp32 GEMMs win.
FUSED_PROJ_MAX_ROWS = 2
_PROJ_WEIGHT_DTYPES = (torch.float32, torch.bfloat16)  # the compressors' weights: bf16-kept or fp32 (model_builder)


def _compressor_proj_op(x: torch.Tensor):
    """sgl_kernel's dsv4_compressor_proj where x is a GPU tensor of rows it reads (at most FUSED_PROJ_MAX_ROWS),
    else None."""
    if not x.is_cuda or x.dim() != 2 or x.stride(-1) != 1 or x.shape[0] > FUSED_PROJ_MAX_ROWS:
        return None
    return sgl_kernel_op("dsv4_compressor_proj", "dsv4_compressor_proj")


class Indexer(nn.Module):
    """Lightning indexer of a CSA layer: picks the top-k visible compressed entries per query (arch 5.5)."""

    def __init__(self, config: DeepseekV4Config, layer_id: int, rotary: RotaryEmbedding) -> None:
        super().__init__()
        self.layer_id, self.ratio = layer_id, CSA_RATIO
        self.n_heads, self.head_dim, self.index_topk = config.index_n_heads, config.index_head_dim, config.index_topk
        self.wq_b = nn.Linear(config.q_lora_rank, self.n_heads * self.head_dim, bias=False)
        self.weights_proj = nn.Linear(config.hidden_size, self.n_heads, bias=False)
        self.compressor = Compressor(config, layer_id, CSA_RATIO, self.head_dim, rotary, is_indexer=True)
        self.rotary = rotary
        self.weight_scale = self.head_dim ** -0.5 * self.n_heads ** -0.5

    def forward(self, x: torch.Tensor, qr: torch.Tensor, positions: torch.Tensor, forward_batch: ForwardBatch,
                q_proj: Optional[torch.Tensor] = None, xf: Optional[torch.Tensor] = None,
                kv_gate: Optional[torch.Tensor] = None, weights: Optional[torch.Tensor] = None) -> torch.Tensor:
        """-> physical slots [T, index_topk] of the chosen compressed entries, -1 padded. q_proj: wq_b(qr), where the
        attention computed it (its joined wq_b_indexer); else computed here. xf: x.float(), where the caller has it.
        kv_gate, weights: the compressor's projection and the head weights, where the caller computed them."""
        self.compressor(x, positions, forward_batch, xf, kv_gate)  # the current token may complete a window
        if q_proj is None:
            q_proj = self.wq_b(qr)
        q = self.rotary.apply(q_proj.view(-1, self.n_heads, self.head_dim), positions)
        if weights is None:
            weights = self.weights_proj(x).float() * self.weight_scale  # from x, not from q
        return forward_batch.attn_backend.forward_indexer(self, q, weights, forward_batch)

    def rotate(self, x: torch.Tensor) -> torch.Tensor:
        """Hadamard rotation applied to queries when the stored keys are quantized after rotation."""
        return hadamard_rotate(x)


class Attention(nn.Module):
    """Shared-KV MQA over window + compressed entries, with sink and grouped low-rank output (arch 5)."""

    def __init__(self, config: DeepseekV4Config, layer_id: int) -> None:
        super().__init__()
        c = config
        self.layer_id = layer_id
        self.ratio = c.compress_ratio(layer_id)
        # Tensor parallel: this rank's heads and whole output groups (sharding.py); the shared K=V head, the
        # query latent, compressors and indexer are replicated. wo_b's partial sums are all-reduced.
        self.tp_group = get_parallel_state().attn_tp
        tp = self.tp_group.world_size
        self.n_heads, self.head_dim, self.groups = c.num_attention_heads // tp, c.head_dim, c.o_groups // tp
        self.softmax_scale = c.head_dim ** -0.5
        self.eps = c.rms_norm_eps
        self.wq_a = nn.Linear(c.hidden_size, c.q_lora_rank, bias=False)
        self.wq_kv_a = None  # wq_a and wkv as one linear, after loading (join_projections)
        self.q_kv_split = [c.q_lora_rank, c.head_dim]  # its output's two parts
        self.q_norm = RMSNorm(c.q_lora_rank, c.rms_norm_eps)
        self.wq_b = nn.Linear(c.q_lora_rank, self.n_heads * c.head_dim, bias=False)
        self.wkv = nn.Linear(c.hidden_size, c.head_dim, bias=False)
        self.kv_norm = RMSNorm(c.head_dim, c.rms_norm_eps)
        self.wo_a = nn.Linear(c.num_attention_heads * c.head_dim // c.o_groups, self.groups * c.o_lora_rank,
                              bias=False)
        self.wo_b = nn.Linear(self.groups * c.o_lora_rank, c.hidden_size, bias=False)
        self.attn_sink = nn.Parameter(torch.zeros(self.n_heads, dtype=torch.float32))
        self.rotary = make_rotary(c, compressed=self.ratio > 0)
        self.compressor = Compressor(c, layer_id, self.ratio, c.head_dim, self.rotary, False) if self.ratio else None
        self.indexer = Indexer(c, layer_id, self.rotary) if c.is_csa(layer_id) else None
        self.wq_b_indexer = None  # wq_b and the indexer's wq_b as one linear, after loading (join_projections)
        self.q_qi_split = [self.n_heads * c.head_dim, c.index_n_heads * c.index_head_dim]  # its output's two parts

    def join_projections(self) -> tuple:
        """Linears reading one input as one linear: one GEMM and, for FP8, one activation quantization. wq_a and wkv
        (both read x, both replicated under TP); on CSA layers wq_b and the indexer's wq_b (both read qr; this rank's
        heads of wq_b beside the replicated indexer weight). -> (wq_a + wkv joined, wq_b + indexer's joined); a pair
        that cannot be joined (fused_linear.concat_linears) stays apart."""
        fused = join_linears(self, ["wq_a", "wkv"], "wq_kv_a")
        fused_b = self.indexer is not None and join_linears(self, ["wq_b", "indexer.wq_b"], "wq_b_indexer")
        return fused, fused_b

    def compressor_inputs(self, x: torch.Tensor, positions: torch.Tensor,
                          forward_batch: ForwardBatch) -> CompressorInputs:
        """What the compressors and the indexer read of x. On GPUs sgl_kernel's dsv4_compressor_proj computes every
        projection (each compressor's wkv_gate with its ape, the indexer's weights_proj times its scale) in one launch,
        reading x in its dtype (at most FUSED_PROJ_MAX_ROWS rows); elsewhere (or with unjoined compressor weights of
        another dtype) x.float() once, for the compressors' torch path (Compressor.project), which is the kernel's
        reference, or nothing where their GEMMs read bf16 x as it is (bf16-kept weights on NVIDIA GPUs)."""
        compressors = [self.compressor] + ([self.indexer.compressor] if self.indexer is not None else [])
        op = _compressor_proj_op(x)
        if op is None or not all(type(c.wkv_gate) is nn.Linear and c.wkv_gate.weight.dtype in _PROJ_WEIGHT_DTYPES
                                 and c.ape.is_contiguous() for c in compressors):
            # x.float() once for both compressors, unless their GEMMs read bf16 x (fp32_linear.uses_tensor_cores)
            tensor_cores = all(uses_tensor_cores(x, w) for c in compressors for w in c.projection_weights())
            return CompressorInputs(xf=None if tensor_cores else x.float())
        offset = forward_batch.attn_metadata.ratios[self.ratio].window_offset
        wp = self.indexer.weights_proj if self.indexer is not None else None
        fold = type(wp) is nn.Linear and wp.weight.dtype == x.dtype and wp.weight.is_contiguous()
        kv_gates, weights = op(x, positions % self.ratio if offset is None else offset,
                               [c.wkv_gate.weight for c in compressors], [c.ape for c in compressors],
                               wp.weight if fold else None, self.indexer.weight_scale if fold else 1.0)
        return CompressorInputs(kv_gate=kv_gates[0], index_kv_gate=kv_gates[1] if len(kv_gates) > 1 else None,
                                index_weights=weights)

    def forward(self, x: torch.Tensor, positions: torch.Tensor, forward_batch: ForwardBatch,
                x_in: Union[torch.Tensor, Fp8Activation, None] = None) -> torch.Tensor:
        """x_in: wq_kv_a's input, x or x quantized by the norm that produced it (norm_for_linear); None: x."""
        if self.wq_kv_a is not None:
            q_a, kv = self.wq_kv_a(x if x_in is None else x_in).split(self.q_kv_split, -1)
        else:
            q_a, kv = self.wq_a(x), self.wkv(x)
        # Query: low-rank, normed latent qr (also the indexer's input), per-head unweighted RMSNorm, RoPE.
        q_idx = None
        if self.wq_b_indexer is not None:
            qr, qr_in = norm_for_linear(self.q_norm, q_a, self.wq_b_indexer)
            q, q_idx = self.wq_b_indexer(qr_in).split(self.q_qi_split, -1)
        else:
            qr, qr_in = norm_for_linear(self.q_norm, q_a, self.wq_b)
            q = self.wq_b(qr_in)
        # Norm and RoPE as one launch each on GPUs, reading the split views through their strides (no copies).
        q = self.rotary.apply_normed(q.view(-1, self.n_heads, self.head_dim), positions, self.eps)
        # One shared key = value vector per token.
        kv = self.rotary.apply_normed(kv, positions, self.kv_norm)
        # Compressed entries completed by these rows must exist before any row attends.
        topk_slots = None
        if self.compressor is not None:
            c_in = self.compressor_inputs(x, positions, forward_batch)
            self.compressor(x, positions, forward_batch, c_in.xf, c_in.kv_gate)
        if self.indexer is not None:
            topk_slots = self.indexer(x, qr, positions, forward_batch, q_proj=q_idx, xf=c_in.xf,
                                      kv_gate=c_in.index_kv_gate, weights=c_in.index_weights)
        o = forward_batch.attn_backend.forward(self, q, kv, forward_batch, topk_slots)
        # V carries RoPE in its last Dr dims: undo it at the query position, then the grouped output.
        if isinstance(self.wo_a, Fp8BlockLinear):  # one grouped FP8 GEMM
            path = w8a8_input_path(self.wo_a, o) if o.dim() == 3 else None  # o [T, H, Dh]: T rows
            # where it runs W8A8, the inverse RoPE writes wo_a's rows only quantized
            o_in = self.rotary.apply_fp8(o, positions, True, path) if path is not None else None
            if o_in is None:
                o_in = self.rotary.apply(o, positions, inverse=True).flatten(1)
            return self.tp_group.all_reduce(self.wo_b(self.wo_a(o_in)))
        o = self.rotary.apply(o, positions, inverse=True)
        o = o.reshape(-1, self.groups, self.n_heads * self.head_dim // self.groups)  # [T, G, H*Dh/G]
        wo_a = self.wo_a.weight.view(self.groups, -1, o.shape[-1])  # [G, Ro, H*Dh/G]
        return self.tp_group.all_reduce(self.wo_b(torch.einsum("tgi,goi->tgo", o, wo_a).flatten(1)))


class MoE(nn.Module):
    """Routed experts (hash or score routed) plus the always-on shared expert (arch 6).

    After `fuse_shared_experts()` the shared expert is routed expert E, picked by every token with weight 1."""

    def __init__(self, config: DeepseekV4Config, layer_id: int) -> None:
        super().__init__()
        c = config
        self.layer_id = layer_id
        self.gate = Gate(c.hidden_size, c.n_routed_experts, c.num_experts_per_tok, c.vocab_size,
                         c.routed_scaling_factor, use_hash=c.is_hash_layer(layer_id))
        # Expert / tensor parallel (sharding.py): this rank's experts, each with its part of the intermediate dim,
        # and its part of the shared expert; every rank sees every token, and one all-reduce sums the parts.
        state = get_parallel_state()
        pc = state.config
        self.tp_group = state.tp
        self.local_experts = local_expert_range(c.n_routed_experts, pc, state.coords)
        self.expert_parallel = pc.ep > 1
        self.experts = RoutedExperts(len(self.local_experts), c.hidden_size, c.moe_intermediate_size // pc.moe_tp,
                                     c.swiglu_limit)
        self.shared_experts = SharedExpert(c.hidden_size, c.moe_intermediate_size // pc.tp, c.swiglu_limit)
        self.shared_expert_id = None  # set when fused

    def fuse_shared_experts(self) -> None:
        if self.tp_group.world_size > 1:  # the shared expert's part differs from the routed experts' parts
            raise ValueError("shared-experts fusion needs --tp 1")
        self.shared_expert_id = e = append_shared_expert(self.experts, self.shared_experts)
        for w in ("w1", "w2", "w3"):  # where a weight update finds the shared expert's tensors
            record_joined(self, f"shared_experts.{w}", {"weight": (f"experts.{w}", e)})
        self.shared_experts = None

    def shared_input_linear(self) -> Optional[nn.Module]:
        """The FP8 linear reading x first in the shared expert, whose input the ffn norm may write quantized
        (norm_for_linear); None where the MoE gathers other DP groups' rows (their quantized copies are not here)."""
        if self.shared_experts is None or get_dp_attention().active:
            return None
        return self.shared_experts.w13

    def forward(self, x: torch.Tensor, input_ids: torch.Tensor,
                x_in: Union[torch.Tensor, Fp8Activation, None] = None) -> torch.Tensor:
        """x_in: the shared expert's input, x quantized by the ffn norm (shared_input_linear); None: x."""
        dp = get_dp_attention()
        if dp.active:  # every DP group's tokens through this rank's experts; the sum keeps this group's rows
            all_x = dp.gather(x)
            return dp.reduce_own(self._partial(all_x, dp.input_ids))
        return self.tp_group.all_reduce(self._partial(x, input_ids, x_in))  # fused shared expert: tp 1, the identity

    def _partial(self, x: torch.Tensor, input_ids: torch.Tensor,
                 x_in: Union[torch.Tensor, Fp8Activation, None] = None) -> torch.Tensor:
        """This rank's part of the MoE output: its experts' (and shared-expert part's) sum, before the all-reduce."""
        # Expert parallelism: pairs routed to another rank's experts get id -1, which the experts skip; fused: one
        # more column per token, expert E at weight 1 (the grouped pass adds it after the routed experts, in the
        # unfused order, so the sum is the same). On GPUs the gate's one launch does both (router.Gate.route).
        local = self.local_experts if self.expert_parallel else None
        recorder = get_expert_distribution_recorder()
        if recorder is None:
            weights, ids = self.gate.route(x, input_ids, local, self.shared_expert_id)
        else:  # --expert-distribution-recorder-mode: the router's global choices, counted on the device
            weights, ids = self.gate(x, input_ids)
            recorder.record(self.layer_id, ids)
            weights, ids = for_local_experts(weights, ids, local, self.shared_expert_id)
        if self.shared_experts is not None:  # computed first: the routed experts' last kernel adds it
            shared = self.shared_experts(x if x_in is None else x_in)
            return self.experts(x, ids, weights, add=shared)
        return self.experts(x, ids, weights)


def fuse_shared_experts(model: nn.Module) -> int:
    """Fuse the shared expert into the routed experts of every MoE of `model` (after loading); returns how many.
    Quantized routed experts (packed MXFP4, FP8) keep their shared expert beside them (its linears FP8 too)."""
    layers = [m for m in model.modules()
              if isinstance(m, MoE) and m.shared_experts is not None and isinstance(m.experts, RoutedExperts)]
    for moe in layers:
        moe.fuse_shared_experts()
    return len(layers)


def norm_for_linear(norm: RMSNorm, x: torch.Tensor, linear: Optional[nn.Module]) -> tuple:
    """(norm(x), the input for `linear`): where `linear` is an FP8 linear that would quantize these rows itself (its
    W8A8 paths), the norm's kernel writes them quantized too (an Fp8Activation), saving that launch; else norm(x)."""
    path = w8a8_input_path(linear, x) if x.dim() == 2 else None
    if path is None:
        y = norm(x)
        return y, y
    return norm.forward_fp8(x, path)


@dataclass
class JoinedProjections:
    """How many pairs `join_projections` joined, of how many candidates."""
    q_kv_a: int = 0  # attentions' wq_a + wkv, of `attentions`
    q_b_indexer: int = 0  # CSA attentions' wq_b + the indexer's wq_b, of `indexers`
    wkv_gate: int = 0  # compressors' wkv + wgate, of `compressors`
    shared_w13: int = 0  # FP8 shared experts' w1 + w3, of `fp8_shared_experts`
    attentions: int = 0
    indexers: int = 0
    compressors: int = 0
    fp8_shared_experts: int = 0


def join_projections(model: nn.Module) -> JoinedProjections:
    """After loading, the linears of `model` that read the same input joined into one (fused_linear.py): each
    attention's wq_a and wkv, each CSA attention's wq_b and its indexer's wq_b, each compressor's wkv and wgate, each
    FP8 shared expert's w1 and w3."""
    out = JoinedProjections()
    for m in list(model.modules()):
        if isinstance(m, Attention) and m.wq_a is not None:
            out.attentions += 1
            out.indexers += m.indexer is not None
            q_kv_a, q_b_indexer = m.join_projections()
            out.q_kv_a += q_kv_a
            out.q_b_indexer += q_b_indexer
        elif isinstance(m, Compressor) and m.wkv is not None:
            out.compressors += 1
            out.wkv_gate += m.join_projections()
        elif isinstance(m, SharedExpert) and isinstance(m.w1, Fp8BlockLinear):
            # FP8 only beside kept routed experts, never fused into bf16 ones (fuse_shared_experts needs w1 and w3)
            out.fp8_shared_experts += 1
            out.shared_w13 += join_linears(m, ["w1", "w3"], "w13")
    return out


class DeepseekV4DecoderLayer(nn.Module):
    """mHC pre -> attention -> mHC post -> mHC pre -> MoE -> mHC post (arch 3.1)."""

    def __init__(self, config: DeepseekV4Config, layer_id: int) -> None:
        super().__init__()
        c = config
        self.config = c
        self.attn_norm = RMSNorm(c.hidden_size, c.rms_norm_eps)
        self.ffn_norm = RMSNorm(c.hidden_size, c.rms_norm_eps)
        for part in ("attn", "ffn"):
            setattr(self, f"hc_{part}_fn", nn.Parameter(torch.zeros(c.hc_mix_dim, c.hc_mult * c.hidden_size,
                                                                    dtype=torch.float32)))
            setattr(self, f"hc_{part}_base", nn.Parameter(torch.zeros(c.hc_mix_dim, dtype=torch.float32)))
            setattr(self, f"hc_{part}_scale", nn.Parameter(torch.ones(3, dtype=torch.float32)))
        self.attn = Attention(c, layer_id)
        self.ffn = MoE(c, layer_id)

    def _pre_norm(self, streams: torch.Tensor, part: str, norm: RMSNorm, linear: Optional[nn.Module],
                  partials) -> tuple:
        """mHC pre and the sub-layer's norm -> (x, the input of `linear`, x's first reader, as norm_for_linear
        gives it, post, comb); `partials`: the streams' mixes with this sub-layer's fn, carried from hc_post_mixes
        (or None)."""
        c = self.config
        return hc_pre_norm(streams, getattr(self, f"hc_{part}_fn"), getattr(self, f"hc_{part}_scale"),
                           getattr(self, f"hc_{part}_base"), c.hc_sinkhorn_iters, c.hc_eps, c.rms_norm_eps, norm,
                           w8a8_input_path(linear, streams[:, 0]), partials)

    def forward(self, streams: torch.Tensor, positions: torch.Tensor, input_ids: torch.Tensor,
                forward_batch: ForwardBatch, partials=None, next_fn: Optional[torch.Tensor] = None) -> tuple:
        """streams -> (new streams, their partial mixes with `next_fn`, the fn of what reads them next: the next
        layer's hc_attn_fn or the head's, or None). `partials`: the input streams' with hc_attn_fn, or None. Each
        hc_post writes the next hc_pre's mixes where the GPU kernels run (layers/mhc.py hc_post_mixes)."""
        x, x_in, post, comb = self._pre_norm(streams, "attn", self.attn_norm, self.attn.wq_kv_a, partials)
        streams, partials = hc_post_mixes(self.attn(x, positions, forward_batch, x_in), streams, post, comb,
                                          self.hc_ffn_fn)
        x, x_in, post, comb = self._pre_norm(streams, "ffn", self.ffn_norm, self.ffn.shared_input_linear(), partials)
        return hc_post_mixes(self.ffn(x, input_ids, x_in), streams, post, comb, next_fn)


class DeepseekV4ForCausalLM(nn.Module):
    """embed -> n streams -> decoder layers -> HC head -> norm -> head (arch 3)."""

    def __init__(self, config: DeepseekV4Config) -> None:
        super().__init__()
        c = config
        self.config = c
        tp = get_parallel_state().attn_tp  # each DP group embeds and samples its own requests
        self.embed = VocabParallelEmbedding(c.vocab_size, c.hidden_size, tp)
        self.layers = nn.ModuleList(DeepseekV4DecoderLayer(c, i) for i in range(c.num_hidden_layers))
        self.norm = RMSNorm(c.hidden_size, c.rms_norm_eps)
        self.head = ParallelLMHead(c.hidden_size, c.vocab_size, tp)
        self.hc_head_fn = nn.Parameter(torch.zeros(c.hc_mult, c.hc_mult * c.hidden_size, dtype=torch.float32))
        self.hc_head_base = nn.Parameter(torch.zeros(c.hc_mult, dtype=torch.float32))
        self.hc_head_scale = nn.Parameter(torch.ones(1, dtype=torch.float32))
        self.logits_processor = LogitsProcessor(c)

    def forward(self, input_ids: torch.Tensor, positions: torch.Tensor,
                forward_batch: ForwardBatch) -> LogitsProcessorOutput:
        c = self.config
        if get_dp_attention().active:  # a round of every DP group (distributed/dp_attention.py)
            get_dp_attention().begin_forward("main", input_ids)
        streams = self.embed(input_ids).unsqueeze(1).repeat(1, c.hc_mult, 1)  # [T, n, D]
        partials = None  # the first hc_pre computes its own mixes
        for i, layer in enumerate(self.layers):
            if forward_batch.before_layer is not None:  # host-tier rows of this layer still landing
                forward_batch.before_layer(i)
            next_fn = self.layers[i + 1].hc_attn_fn if i + 1 < len(self.layers) else self.hc_head_fn
            streams, partials = layer(streams, positions, input_ids, forward_batch, partials, next_fn)
        hidden = self.norm(hc_head(streams, self.hc_head_fn, self.hc_head_scale, self.hc_head_base,
                                   c.hc_eps, c.rms_norm_eps, partials))
        return self.logits_processor(hidden, self.head, forward_batch,
                                     pre_hc_streams=streams if forward_batch.capture_hidden else None)

    def forward_idle(self) -> None:
        """DP attention: this group has nothing to run while another does; its MoE layers still serve the other
        groups' tokens (distributed/dp_attention.py)."""
        dp = get_dp_attention()
        weight = self.embed.weight
        dp.input_ids = dp.gather(torch.zeros(0, dtype=torch.int64, device=weight.device))
        x = weight.new_zeros(0, self.config.hidden_size)
        for layer in self.layers:
            layer.ffn(x, dp.input_ids[:0])

    def load_weights(self, weights) -> None:
        """Copy (native name, tensor) pairs into parameters; per-expert tensors fill the stacked slices."""
        from sglang.srt.models.weight_loading import load_native_weights

        load_native_weights(self, weights)


EntryClass = DeepseekV4ForCausalLM
