"""The released DeepSeek-V4 Flash and Pro config.json values (native hub form, docs/dsv4-configs.md section 1).

Used by pool-size reports, the capacity planner, benchmarks and tests; no weights are implied.
"""

from __future__ import annotations

_COMMON = {
    "architectures": ["DeepseekV4ForCausalLM"], "model_type": "deepseek_v4", "vocab_size": 129280,
    "num_key_value_heads": 1, "head_dim": 512, "qk_rope_head_dim": 64, "o_lora_rank": 1024, "sliding_window": 128,
    "compress_rope_theta": 160000, "rope_theta": 10000,
    "rope_scaling": {"type": "yarn", "factor": 16, "original_max_position_embeddings": 65536, "beta_fast": 32,
                     "beta_slow": 1},
    "max_position_embeddings": 1048576, "index_n_heads": 64, "index_head_dim": 128, "n_shared_experts": 1,
    "num_experts_per_tok": 6, "scoring_func": "sqrtsoftplus", "topk_method": "noaux_tc", "norm_topk_prob": True,
    "num_hash_layers": 3, "swiglu_limit": 10.0, "hc_mult": 4, "hc_sinkhorn_iters": 20, "hc_eps": 1e-6,
    "rms_norm_eps": 1e-6, "num_nextn_predict_layers": 1, "hidden_act": "silu", "attention_bias": False,
    "tie_word_embeddings": False, "bos_token_id": 0, "eos_token_id": 1, "torch_dtype": "bfloat16",
    "expert_dtype": "fp4",
    "quantization_config": {"activation_scheme": "dynamic", "fmt": "e4m3", "quant_method": "fp8",
                            "scale_fmt": "ue8m0", "weight_block_size": [128, 128]},
}

FLASH = {**_COMMON, "hidden_size": 4096, "num_hidden_layers": 43, "num_attention_heads": 64, "q_lora_rank": 1024,
         "o_groups": 8, "index_topk": 512, "n_routed_experts": 256, "moe_intermediate_size": 2048,
         "routed_scaling_factor": 1.5, "compress_ratios": [0, 0] + [4, 128] * 20 + [4, 0]}

PRO = {**_COMMON, "hidden_size": 7168, "num_hidden_layers": 61, "num_attention_heads": 128, "q_lora_rank": 1536,
       "o_groups": 16, "index_topk": 1024, "n_routed_experts": 384, "moe_intermediate_size": 3072,
       "routed_scaling_factor": 2.5, "compress_ratios": [128, 128] + [4, 128] * 29 + [4, 0]}

# Hub repositories known without a download (the capacity planner's presets): id -> (config.json, the routed experts'
# stored format). The sgl-project repacks hold the same weights with FP8 routed experts (128 x 128 blocks) in place
# of MXFP4, for GPUs without FP4 support.
HUB_MODELS = {
    "deepseek-ai/DeepSeek-V4-Flash": (FLASH, "fp4"),
    "deepseek-ai/DeepSeek-V4-Pro": (PRO, "fp4"),
    "sgl-project/DeepSeek-V4-Flash-FP8": ({**FLASH, "expert_dtype": "fp8"}, "fp8"),
    "sgl-project/DeepSeek-V4-Pro-FP8": ({**PRO, "expert_dtype": "fp8"}, "fp8"),
}
# Short names of the planner and pool_sizing.
PRESETS = {"flash": "deepseek-ai/DeepSeek-V4-Flash", "pro": "deepseek-ai/DeepSeek-V4-Pro"}
