"""The MTP (NextN) draft logits equal a direct computation from the spec (docs/dsv4-architecture.md section 7).

Engine side: the ModelRunner with the draft loaded, driven by hand. One request of S = 40 tokens (more than two
sliding windows of 16): the main model runs once over the prompt and returns its pre-HC-head streams Hs
[S, n_hc, D]; then `forward_draft` runs the draft rows p = 0..S-2 carrying (Hs_p, x_{p+1}) at position p, in one
pass and again split into two chunks (the second chunk reads the window KV the first left in the draft's pool
layer num_hidden_layers).

Spec side, independent of the engine's model code:
* Hs_p from HF transformers (a pre-hook on `model.hc_head` captures its input);
* e = RMSNorm(Embed(x_{p+1}); enorm), h_j = RMSNorm(Hs_p[j]; hnorm), S0_j = h_j h_proj^T + e e_proj^T in plain
  torch on the checkpoint tensors (read with safetensors);
* the decoder block, HC head, norm and LM head by an HF DeepseekV4ForCausalLM with ONE sliding-attention,
  score-routed layer whose weights are the `mtp.0.*` tensors (top-level norm / hc_head_* = the MTP's own,
  embed / head = the main model's), with S0 fed in place of the expanded embeddings (pre-hook on layer 0).

Measured (CPU, fp32): draft vs spec max |diff| ~4e-6 in one pass and in two chunks (tolerance 1e-4); the draft
logits differ from the main model's next-token logits by ~5.7, so the comparison cannot pass by accident.
"""

from __future__ import annotations

import functools
import glob
import json
import os

import torch
from safetensors.torch import load_file, save_file

from oracle import checkpoint, engine, hf_model, random_ids
from sglang.srt.model_executor.forward_batch_info import ForwardBatch, ForwardMode

NAME = "tiny"
S = 40  # > 2 windows of 16
TOL = 1e-4
# The MTP's own tensors that are not part of its decoder block.
_MTP_INPUT = ("e_proj.weight", "h_proj.weight", "enorm.weight", "hnorm.weight")
_MTP_TOP = ("norm.weight", "hc_head_fn", "hc_head_base", "hc_head_scale")


@functools.lru_cache(maxsize=None)
def native_tensors(name: str) -> dict:
    out = {}
    for f in sorted(glob.glob(os.path.join(checkpoint(name), "*.safetensors"))):
        out.update(load_file(f))
    return out


@functools.lru_cache(maxsize=None)
def hf_mtp_block(name: str):
    """HF DeepseekV4ForCausalLM with one sliding/score-routed layer carrying the mtp.0.* weights (native names)."""
    from transformers import DeepseekV4Config, DeepseekV4ForCausalLM

    with open(os.path.join(checkpoint(name), "config.json")) as f:
        native = json.load(f)
    for key in ("compress_ratios", "num_hash_layers", "rope_scaling", "quantization_config", "expert_dtype",
                "torch_dtype", "architectures", "model_type"):
        native.pop(key, None)
    native.update(num_hidden_layers=1, layer_types=["sliding_attention"], mlp_layer_types=["moe"])
    config = DeepseekV4Config(**native)
    tensors = native_tensors(name)
    state = {"embed.weight": tensors["embed.weight"], "head.weight": tensors["head.weight"]}
    for key, t in tensors.items():
        if not key.startswith("mtp.0."):
            continue
        rest = key[len("mtp.0."):]
        if rest in _MTP_INPUT:
            continue
        state[rest if rest in _MTP_TOP else "layers.0." + rest] = t.contiguous()
    out = checkpoint(name) + "-mtp-block-hf"  # beside the test run's other checkpoints
    config.save_pretrained(out)
    save_file(state, os.path.join(out, "model.safetensors"))
    model, info = DeepseekV4ForCausalLM.from_pretrained(out, dtype=torch.float32, output_loading_info=True)
    assert not any(info[k] for k in ("missing_keys", "unexpected_keys", "mismatched_keys")), info
    assert model.config.qk_rope_head_dim == native["qk_rope_head_dim"]
    # Spot-check that the renamed tensors landed where the spec says.
    m = model.model
    assert torch.equal(m.hc_head.hc_fn, tensors["mtp.0.hc_head_fn"])
    assert torch.equal(m.norm.weight, tensors["mtp.0.norm.weight"])
    assert torch.equal(model.lm_head.weight, tensors["head.weight"])
    assert torch.equal(m.layers[0].self_attn.sinks, tensors["mtp.0.attn.attn_sink"])
    assert torch.equal(m.layers[0].mlp.gate.e_score_correction_bias, tensors["mtp.0.ffn.gate.bias"])
    return model.eval()


def rms_norm(x: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
    x = x.float()
    return x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + eps) * weight


@functools.lru_cache(maxsize=None)
def spec_logits(name: str, ids: tuple) -> tuple:
    """(MTP logits [S-1, V] for rows p = 0..S-2, HF main-model logits [S, V]) computed from the spec."""
    hf = hf_model(name)
    captured = {}
    hook = hf.model.hc_head.register_forward_pre_hook(lambda mod, args: captured.__setitem__("hs", args[0]))
    try:
        with torch.no_grad():
            main_logits = hf(torch.tensor([list(ids)])).logits[0].float()
    finally:
        hook.remove()
    hs = captured["hs"][0].float()  # [S, n_hc, D]: the main model's pre-HC-head streams
    t = native_tensors(name)
    eps = hf.config.rms_norm_eps
    nxt = torch.tensor(ids[1:])
    e = rms_norm(t["embed.weight"][nxt], t["mtp.0.enorm.weight"], eps)  # [S-1, D]
    h = rms_norm(hs[:-1], t["mtp.0.hnorm.weight"], eps)  # [S-1, n_hc, D]
    s0 = h @ t["mtp.0.h_proj.weight"].T + (e @ t["mtp.0.e_proj.weight"].T)[:, None, :]

    block = hf_mtp_block(name)

    def feed_s0(module, args):  # replace the expanded embeddings by S0 (positions default to 0..S-2)
        return (s0[None].to(args[0].dtype),) + tuple(args[1:])

    hook = block.model.layers[0].register_forward_pre_hook(feed_s0)
    try:
        with torch.no_grad():
            mtp_logits = block(nxt[None]).logits[0].float()
    finally:
        hook.remove()
    return mtp_logits, main_logits


@functools.lru_cache(maxsize=None)
def draft_engine(name: str):
    return engine(name, speculative_algorithm="EAGLE", chunked_prefill_size=-1)


def run_draft(runner, alloc, ids: list, full: torch.Tensor, hs: torch.Tensor, lo: int, hi: int) -> torch.Tensor:
    """Draft rows p = lo..hi-1 (input x_{p+1}, streams Hs_p, position p); logits of every row [hi-lo, V]."""
    captured = {}
    proc = runner.draft_model.logits_processor
    hook = proc.register_forward_pre_hook(lambda mod, args: captured.__setitem__("hidden", args[0].clone()))
    try:
        forward_batch = ForwardBatch.build(ForwardMode.DRAFT_EXTEND, ids[lo + 1:hi + 1], [alloc.req_pool_idx], [lo],
                                           [hi - lo], full[lo:hi], runner.device)
        forward_batch.spec_hidden_states = hs[lo:hi]
        out = runner.forward_draft(forward_batch)
    finally:
        hook.remove()
    with torch.inference_mode():
        logits = (captured["hidden"] @ runner.model.head.weight.T).float()
    # The captured rows are what the logits processor turns into logits: its own last row agrees.
    assert (logits[-1] - out.next_token_logits[0]).abs().max().item() <= 1e-5
    return logits.cpu()  # the spec side is computed on the CPU


def test_mtp_draft_matches_spec():
    ids = random_ids(S, seed=5)
    ref, main_logits = spec_logits(NAME, tuple(ids))
    eng = draft_engine(NAME)
    runner = eng.model_runner
    allocator = runner.token_allocator
    pool = runner.token_to_kv_pool
    n_main = runner.model_config.num_hidden_layers
    assert pool.num_layers == n_main + 1  # the draft's window KV is its own pool layer

    alloc = allocator.alloc_req()
    try:
        full = allocator.extend(alloc, S)
        forward_batch = ForwardBatch.build(ForwardMode.EXTEND, ids, [alloc.req_pool_idx], [0], [S], full, runner.device,
                                           capture_hidden=True)
        hs = runner.forward(forward_batch).hidden_states
        assert hs.shape == (S, runner.model_config.hc_mult, runner.model_config.hidden_size)

        swa = allocator.full_to_swa[full]
        main_window = [pool.get_window_kv(i, swa).clone() for i in range(n_main)]
        pool.window_kv[n_main].zero_()

        one_pass = run_draft(runner, alloc, ids, full, hs, 0, S - 1)
        err_one = (one_pass - ref).abs().max().item()
        assert err_one <= TOL, err_one

        # The draft wrote its window KV to pool layer n_main only.
        assert pool.get_window_kv(n_main, swa[:S - 1]).abs().amax(-1).gt(0).all()
        for i in range(n_main):
            assert torch.equal(pool.get_window_kv(i, swa), main_window[i])

        split = 23  # the second chunk's window reaches back into the first chunk
        pool.window_kv[n_main].zero_()
        two = torch.cat([run_draft(runner, alloc, ids, full, hs, 0, split),
                         run_draft(runner, alloc, ids, full, hs, split, S - 1)])
        err_two = (two - ref).abs().max().item()
        assert err_two <= TOL, err_two

        # Not trivially equal to the main model's logits (row p of the draft predicts x_{p+2}).
        for other in (main_logits[1:], main_logits[:-1]):
            assert (one_pass - other).abs().max().item() > 100 * TOL
        assert (one_pass.argmax(-1) != main_logits[1:].argmax(-1)).any()
    finally:
        allocator.free_req(alloc)
    allocator.check_all_free()
