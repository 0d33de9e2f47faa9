"""Flags of upstream SGLang's DeepSeek-V4 recipes (its cookbook's launch commands) that pick kernels or features this
engine does not have: accepted, so a recipe's command line starts here, and each either mapped to what serves it
(`--moe-a2a-backend deepep` puts the routed experts over all TP ranks, as upstream does; `--cuda-graph-max-bs-decode`
is our `--cuda-graph-max-bs`, which only captures decode) or logged at start as changing nothing. Values outside
upstream's are errors naming the flag; so is a --speculative-draft-model-path other than the served checkpoint (the
draft here is always its own MTP layer; no separate draft is loaded). Upstream's SGLANG_OPT_FLASHMLA_SPARSE_PREFILL
is logged the same way when set. Stdlib and sglang.srt.environ only, like server_args.
"""

from __future__ import annotations

import json
import os

# Upstream's choices; every MXFP4 / FP8 expert path is served by our fused Triton MoE kernels (sgl_kernel).
MOE_RUNNER_BACKENDS = ("auto", "triton", "triton_kernel", "marlin", "flashinfer_mxfp4", "flashinfer_trtllm",
                       "flashinfer_trtllm_routed", "flashinfer_cutlass", "cutlass", "deep_gemm")
MOE_A2A_BACKENDS = ("none", "deepep", "megamoe", "mooncake", "mori", "nixl", "flashinfer", "ascend_fuseep")
DEEPEP_MODES = ("auto", "normal", "low_latency")
SPECULATIVE_ATTENTION_MODES = ("prefill", "decode")


def add_recipe_args(p) -> None:
    """The recipe flags, grouped in --help."""
    g = p.add_argument_group("accepted for upstream SGLang recipes",
                             "upstream DeepSeek-V4 launch commands start unchanged: each flag is mapped to what serves "
                             "it here or logged at start as changing nothing")
    g.add_argument("--moe-runner-backend", default="auto", choices=MOE_RUNNER_BACKENDS,
                   help="upstream's MoE kernel choice; every value runs the fused Triton MoE here (MXFP4 experts "
                        "W4A16, as marlin / flashinfer_mxfp4)")
    g.add_argument("--moe-a2a-backend", default="none", choices=MOE_A2A_BACKENDS,
                   help="upstream's expert all-to-all; any value but none puts the routed experts over all --tp "
                        "ranks (--ep = --tp, as upstream) and combines them with all-reduce (no DeepEP here)")
    g.add_argument("--deepep-mode", default="auto", choices=DEEPEP_MODES, help="changes nothing here (no DeepEP)")
    g.add_argument("--deepep-config", metavar="JSON",
                   help="a JSON object; changes nothing here (no DeepEP; default: none)")
    g.add_argument("--disable-flashinfer-autotune", action="store_true", help="changes nothing here (no FlashInfer)")
    g.add_argument("--cuda-graph-max-bs-decode", type=int, metavar="N",
                   help="the same as --cuda-graph-max-bs (only decode steps are captured here; default: none)")
    g.add_argument("--tokenizer-worker-num", type=int, default=1, metavar="N",
                   help="changes nothing here: long prompts are tokenized in worker threads of the HTTP process")
    g.add_argument("--enable-prefill-delayer", action="store_true",
                   help="changes nothing here: DP groups' prefills are not delayed to align them")
    g.add_argument("--prefill-delayer-max-delay-ms", type=float, metavar="MS",
                   help="with --enable-prefill-delayer; changes nothing (default: none)")
    g.add_argument("--enable-two-batch-overlap", action="store_true", help="changes nothing here (no TBO)")
    g.add_argument("--speculative-draft-model-path", metavar="PATH",
                   help="only --model-path's own checkpoint, whose MTP (NextN) layer is the draft here (changes "
                        "nothing); any other path is refused (default: none)")
    g.add_argument("--speculative-attention-mode", default="prefill", choices=SPECULATIVE_ATTENTION_MODES,
                   help="upstream's kernel family for verify / draft-extend attention; changes nothing here (verify "
                        "rows run the --attention-backend's decode kernels, captured in CUDA graphs)")
    g.add_argument("--speculative-draft-attention-backend", metavar="BACKEND",
                   help="changes nothing here: the draft layer uses --attention-backend (default: none)")
    g.add_argument("--enable-w4a4-mxfp4-megamoe", action="store_true",
                   help="upstream's Blackwell MegaMoE with FP4 activations; changes nothing here (the MXFP4 experts "
                        "take bf16 activations)")


def apply_recipe_args(args) -> list:
    """Check the recipe flags of ServerArgs `args` and map the ones that mean something here; returns the lines to log
    at start (ValueError naming a flag with a value upstream does not take either)."""
    for flag, value, choices in (("--moe-runner-backend", args.moe_runner_backend, MOE_RUNNER_BACKENDS),
                                 ("--moe-a2a-backend", args.moe_a2a_backend, MOE_A2A_BACKENDS),
                                 ("--deepep-mode", args.deepep_mode, DEEPEP_MODES),
                                 ("--speculative-attention-mode", args.speculative_attention_mode,
                                  SPECULATIVE_ATTENTION_MODES)):
        if value not in choices:
            raise ValueError(f"{flag} must be one of {choices}, got {value!r}")
    if args.tokenizer_worker_num < 1:
        raise ValueError(f"--tokenizer-worker-num must be >= 1, got {args.tokenizer_worker_num}")
    draft = args.speculative_draft_model_path
    if draft is not None and not _same_checkpoint(draft, args.model_path):
        raise ValueError(f"--speculative-draft-model-path {draft!r}: the draft here is always --model-path's own MTP "
                         f"(NextN) layer, and a separate draft checkpoint is not loaded; drop the flag (or give "
                         f"--model-path's path)")
    if args.deepep_config is not None:
        try:
            json.loads(args.deepep_config)
        except ValueError:
            raise ValueError(f"--deepep-config must be a JSON object, got {args.deepep_config!r}") from None
    notes = []
    if args.moe_runner_backend not in ("auto", "triton"):
        notes.append(f"--moe-runner-backend {args.moe_runner_backend}: the routed experts run the fused Triton MoE "
                     f"(sgl_kernel), activations {args.mxfp4_moe_precision}")
    if args.moe_a2a_backend != "none":
        if args.ep_size == 1:
            args.ep_size = args.tp_size
        notes.append(f"--moe-a2a-backend {args.moe_a2a_backend}: routed experts over {args.ep_size} expert-parallel "
                     f"ranks, combined by all-reduce (no DeepEP / MegaMoE kernels here)")
    if args.cuda_graph_max_bs_decode is not None:
        if args.cuda_graph_max_bs not in (None, args.cuda_graph_max_bs_decode):
            raise ValueError(f"--cuda-graph-max-bs-decode {args.cuda_graph_max_bs_decode} and --cuda-graph-max-bs "
                             f"{args.cuda_graph_max_bs} differ; only decode is captured here: give one")
        args.cuda_graph_max_bs = args.cuda_graph_max_bs_decode
    inert = [("--deepep-mode", args.deepep_mode != "auto"), ("--deepep-config", args.deepep_config is not None),
             ("--disable-flashinfer-autotune", args.disable_flashinfer_autotune),
             ("--tokenizer-worker-num", args.tokenizer_worker_num != 1),
             ("--enable-prefill-delayer", args.enable_prefill_delayer),
             ("--prefill-delayer-max-delay-ms", args.prefill_delayer_max_delay_ms is not None),
             ("--enable-two-batch-overlap", args.enable_two_batch_overlap),
             ("--speculative-draft-model-path", args.speculative_draft_model_path is not None),
             ("--speculative-attention-mode", args.speculative_attention_mode != "prefill"),
             ("--speculative-draft-attention-backend", args.speculative_draft_attention_backend is not None),
             ("--enable-w4a4-mxfp4-megamoe", args.enable_w4a4_mxfp4_megamoe)]
    given = [flag for flag, on in inert if on]
    if sparse_prefill_set():
        given.append("SGLANG_OPT_FLASHMLA_SPARSE_PREFILL")
    if given:
        notes.append(f"{', '.join(given)}: accepted from upstream's recipes; change nothing here")
    return notes


def _same_checkpoint(draft: str, model_path: str) -> bool:
    """Whether `draft` names the served checkpoint: the same text, or the same directory."""
    if draft.rstrip("/") == model_path.rstrip("/"):
        return True
    try:
        return os.path.samefile(draft, model_path)
    except OSError:  # either is not a path here (a hub id): they differ
        return False


def sparse_prefill_set() -> bool:
    """Whether upstream's SGLANG_OPT_FLASHMLA_SPARSE_PREFILL is set (its value checked: a typo is an error naming it).
    There is no separate sparse-prefill kernel to switch: prefill and decode run one sparse attention kernel."""
    from sglang.srt.environ import envs

    var = envs.SGLANG_OPT_FLASHMLA_SPARSE_PREFILL
    if not var.is_set():
        return False
    var.get()
    return True
