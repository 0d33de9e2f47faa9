"""The tiny checkpoint quantized exactly as the hub one (FP8 e4m3 + ue8m0 128x128 linears, MXFP4 routed
experts) loads, dequantized at load on CPU, and equals HF transformers run on the dequantized weights."""

from __future__ import annotations

import torch

from oracle import assert_matches_hf, checkpoint, engine, greedy_run, hf_reference, random_ids
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
    ref = hf_reference("tiny", tuple(random_ids(77, seed=5)), 32, quantize=True)
    eng = engine("tiny", quantize=True)
    assert_matches_hf(greedy_run(eng, ref[0], 32), ref)
    eng.model_runner.token_allocator.check_all_free()


def test_quantized_weights_differ_from_unquantized():
    """The quantized model really runs on rounded weights (else the test above would prove little)."""
    path_q, path_f = checkpoint("tiny", quantize=True), checkpoint("tiny")
    config = load_config(path_f)
    q = dict(iter_checkpoint(path_q, load_config(path_q)))
    f = dict(iter_checkpoint(path_f, config))
    w_q, w_f = q["layers.1.attn.wq_a.weight"], f["layers.1.attn.wq_a.weight"]
    assert not torch.equal(w_q, w_f) and torch.allclose(w_q, w_f, rtol=0.07, atol=1e-3)
