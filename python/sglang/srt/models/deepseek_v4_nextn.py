"""DeepSeek-V4 MTP (NextN) draft module, arch section 7; speculative/eagle_worker.py drives it.

For a draft row carrying (Hs_p, x_{p+1}) at position p, with Hs_p the main model's pre-HC-head streams:
  e = enorm(Embed(x_{p+1})); h_j = hnorm(Hs_p[j]); S_j = h_proj(h_j) + e_proj(e)
  S = Block_mtp(S)   (sliding-window attention only, score-routed MoE)
  logits = head(norm(HC_head_mtp(S)))
Embedding and LM head are the target model's (shared, not stored in mtp.*). Parameters live under `mtp.J.`
exactly as in the hub checkpoint; the block's window KV is pool layer `num_hidden_layers + J`.
"""

from __future__ import annotations

import torch
from torch import nn

from sglang.srt.configs.deepseek_v4 import DeepseekV4Config
from sglang.srt.distributed.dp_attention import get_dp_attention
from sglang.srt.layers.logits_processor import LogitsProcessor, LogitsProcessorOutput
from sglang.srt.layers.mhc import hc_head
from sglang.srt.layers.norm import RMSNorm
from sglang.srt.model_executor.forward_batch_info import ForwardBatch
from sglang.srt.models.deepseek_v4 import DeepseekV4DecoderLayer, norm_for_linear


class MTPBlock(DeepseekV4DecoderLayer):
    def __init__(self, config: DeepseekV4Config, layer_id: int) -> None:
        super().__init__(config, layer_id)  # layer_id >= num_hidden_layers: ratio 0, plain RoPE, score routing
        d = config.hidden_size
        self.e_proj = nn.Linear(d, d, bias=False)
        self.h_proj = nn.Linear(d, d, bias=False)
        self.enorm = RMSNorm(d, config.rms_norm_eps)
        self.hnorm = RMSNorm(d, config.rms_norm_eps)
        self.norm = RMSNorm(d, config.rms_norm_eps)
        self.hc_head_fn = nn.Parameter(torch.zeros(config.hc_mult, config.hc_mult * d, dtype=torch.float32))
        self.hc_head_base = nn.Parameter(torch.zeros(config.hc_mult, dtype=torch.float32))
        self.hc_head_scale = nn.Parameter(torch.ones(1, dtype=torch.float32))

    def forward(self, prev_streams: torch.Tensor, embedded: torch.Tensor, positions: torch.Tensor,
                input_ids: torch.Tensor, forward_batch: ForwardBatch) -> tuple:
        """Hs_p [T, n, D] and Embed(x_{p+1}) [T, D] -> (S [T, n, D], the block's output streams; hidden [T, D] for
        the shared head)."""
        c = self.config
        # As in the decoder layers: where h_proj / e_proj are FP8 linears on a GPU, each norm's kernel also writes its
        # rows quantized for them (no separate activation-quantization launch)
        _, h_in = norm_for_linear(self.hnorm, prev_streams.flatten(0, 1), self.h_proj)
        _, e_in = norm_for_linear(self.enorm, embedded, self.e_proj)
        streams = self.h_proj(h_in).view(prev_streams.shape) + self.e_proj(e_in).unsqueeze(1)
        streams, partials = super().forward(streams, positions, input_ids, forward_batch, next_fn=self.hc_head_fn)
        hidden = self.norm(hc_head(streams, self.hc_head_fn, self.hc_head_scale, self.hc_head_base,
                                   c.hc_eps, c.rms_norm_eps, partials))
        return streams, hidden


class DeepseekV4ForCausalLMNextN(nn.Module):
    def __init__(self, config: DeepseekV4Config) -> None:
        super().__init__()
        if config.num_nextn_predict_layers < 1:
            raise ValueError("config field 'num_nextn_predict_layers' is 0: the checkpoint has no MTP module")
        self.config = config
        n = config.num_hidden_layers
        self.mtp = nn.ModuleList(MTPBlock(config, n + j) for j in range(config.num_nextn_predict_layers))
        self.logits_processor = LogitsProcessor(config)
        self._shared: tuple = ()  # (embed, head) of the target model; not registered, so not duplicated

    def set_embed_and_head(self, embed: nn.Embedding, head: nn.Linear) -> None:
        self._shared = (embed, head)

    def forward(self, input_ids: torch.Tensor, positions: torch.Tensor, forward_batch: ForwardBatch,
                step: int = 0) -> LogitsProcessorOutput:
        """input_ids [T] = x_{p+1}; forward_batch.spec_hidden_states [T, n, D] = Hs_p; rows at positions p."""
        if not self._shared:
            raise RuntimeError("call set_embed_and_head(target.embed, target.head) before running the draft")
        embed, head = self._shared
        if get_dp_attention().active:  # a round of every DP group (distributed/dp_attention.py)
            get_dp_attention().begin_forward(f"draft{step}", input_ids)
        streams, hidden = self.mtp[step](forward_batch.spec_hidden_states, embed(input_ids), positions, input_ids,
                                         forward_batch)
        return self.logits_processor(hidden, head, forward_batch,
                                     pre_hc_streams=streams if forward_batch.capture_hidden else None)

    def forward_idle(self, step: int) -> None:
        """DP attention: another group runs MTP layer `step`; this one serves its MoE with no tokens of its own."""
        dp = get_dp_attention()
        weight = self._shared[0].weight  # the target's embedding: the model's dtype and device
        dp.input_ids = dp.gather(torch.zeros(0, dtype=torch.int64, device=weight.device))
        self.mtp[step].ffn(weight.new_zeros(0, self.config.hidden_size), dp.input_ids[:0])

    def load_weights(self, weights) -> None:
        from sglang.srt.models.weight_loading import load_native_weights

        load_native_weights(self, weights)


EntryClass = DeepseekV4ForCausalLMNextN
