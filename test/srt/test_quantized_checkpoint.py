"""The tiny checkpoint quantized exactly as the hub one (FP8 e4m3 + ue8m0 128x128 linears, MXFP4 routed
experts) loads, dequantized at load on CPU, and equals HF transformers run on the dequantized weights."""

from __future__ import annotations

import torch

from oracle import checkpoint, engine, hf_greedy, hf_model, hf_prompt_logprobs, max_abs_diff, random_ids
from sglang.srt.model_loader.loader import iter_checkpoint
from sglang.srt.model_loader.loader import load_config


def test_quantized_checkpoint_is_stored_quantized():
    from safetensors import safe_open
    import glob

    dtypes = {}
    for path in glob.glob(f"{checkpoint('tiny', quantize=True)}/*.safetensors"):
        with safe_open(path, "pt") as f:
            for name in f.keys():
                dtypes[name] = f.get_slice(name).get_dtype()
    assert dtypes["layers.1.attn.wq_a.weight"] == "F8_E4M3" and dtypes["layers.1.attn.wq_a.scale"] == "F8_E8M0"
    assert dtypes["layers.2.ffn.experts.0.w1.weight"] == "I8" and dtypes["layers.2.ffn.experts.0.w1.scale"] == "F8_E8M0"
    assert dtypes["layers.1.attn.compressor.wkv.weight"] in ("BF16", "F32")


def test_quantized_matches_hf_on_dequantized_weights():
    ids = random_ids(77, seed=5)
    hf = hf_model("tiny", quantize=True)
    tokens, token_lps = hf_greedy(hf, ids, 32)
    eng = engine("tiny", quantize=True)
    out = eng.generate(input_ids=ids, sampling_params={"temperature": 0, "max_new_tokens": 32, "ignore_eos": True},
                       return_logprob=True, logprob_start_len=0)
    got = [lp for lp, _, _ in out["meta_info"]["input_token_logprobs"]][1:]
    assert max_abs_diff(got, hf_prompt_logprobs(hf, ids)) <= 1e-4
    assert out["output_ids"] == tokens
    assert max_abs_diff([lp for lp, _, _ in out["meta_info"]["output_token_logprobs"]], token_lps) <= 1e-4
    eng.model_runner.token_allocator.check_all_free()


def test_quantized_weights_differ_from_unquantized():
    """The quantized model really runs on rounded weights (else the test above would prove little)."""
    path_q, path_f = checkpoint("tiny", quantize=True), checkpoint("tiny")
    config = load_config(path_f)
    q = dict(iter_checkpoint(path_q, load_config(path_q)))
    f = dict(iter_checkpoint(path_f, config))
    w_q, w_f = q["layers.1.attn.wq_a.weight"], f["layers.1.attn.wq_a.weight"]
    assert not torch.equal(w_q, w_f) and torch.allclose(w_q, w_f, rtol=0.07, atol=1e-3)
