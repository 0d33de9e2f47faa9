"""Checkpoint loading: tiny maker, native / HF-saved / HF-module names, quantized formats, HF export, errors."""

from __future__ import annotations

import json
import os
import shutil

import pytest
import torch
from safetensors import safe_open
from safetensors.torch import load_file, save_file

from sglang.srt.configs.deepseek_v4 import ConfigError, DeepseekV4Config
from sglang.srt.model_loader.checkpoint_spec import TensorKind, expected_tensors
from sglang.srt.model_loader.hf_export import export_hf_checkpoint, hf_config_dict
from sglang.srt.model_loader.loader import CheckpointError, iter_checkpoint, load_checkpoint, load_config
from sglang.srt.model_loader.name_mapping import FusedExperts, native_items, to_hf_saved, to_native
from sglang.srt.model_loader.quant_formats import e8m0_to_float
from sglang.srt.model_loader.tiny_checkpoint import (
    TINY_CONFIG,
    builtin_model_path,
    is_builtin_model_name,
    make_tiny_checkpoint,
)

transformers = pytest.importorskip("transformers")

CFG = DeepseekV4Config.from_dict(TINY_CONFIG)
FP4_MAGS = [0.0, 0.5, 1.0, 1.5, 2.0, 3.0, 4.0, 6.0]


@pytest.fixture(scope="module")
def ckpts(tmp_path_factory):
    root = tmp_path_factory.mktemp("ckpt")
    return {
        "f32": make_tiny_checkpoint(str(root / "f32"), TINY_CONFIG, seed=0, dtype="float32"),
        "quant": make_tiny_checkpoint(str(root / "quant"), TINY_CONFIG, seed=0, quantize=True),
        "sharded": make_tiny_checkpoint(str(root / "sharded"), TINY_CONFIG, seed=0, quantize=True, num_shards=3),
    }


def _load_all(path, **kw):
    """Every (name, tensor) of both parts, checking each name is yielded once."""
    out = {}
    for part in ("main", "mtp"):
        for name, t in iter_checkpoint(path, load_config(path), part=part, **kw):
            assert name not in out, f"{name} yielded twice"
            out[name] = t
    return out


def _spec_all(cfg=CFG):
    return {**expected_tensors(cfg, "main"), **expected_tensors(cfg, "mtp")}


def _rewrite(src, dst, edit, config_edit=None):
    """Copy a single-file checkpoint, applying `edit` to its tensor dict (and `config_edit` to config.json)."""
    shutil.copytree(src, dst)
    path = os.path.join(dst, "model.safetensors")
    tensors = load_file(path)
    edit(tensors)
    save_file(tensors, path)
    if config_edit is not None:
        with open(os.path.join(dst, "config.json")) as f:
            raw = json.load(f)
        config_edit(raw)
        with open(os.path.join(dst, "config.json"), "w") as f:
            json.dump(raw, f)
    return dst


def _randomize_hf_model(model, seed=0):
    g = torch.Generator().manual_seed(seed)
    E = model.config.n_routed_experts
    with torch.no_grad():
        for name, t in model.state_dict().items():
            if name.endswith("tid2eid"):
                t.copy_(torch.rand(t.shape[0], E, generator=g).argsort(1)[:, : t.shape[1]])
            else:
                t.copy_(torch.randn(t.shape, generator=g) * 0.1 + 1.0)


def _hf_native(model):
    """The HF model's own parameters under native names."""
    out = {}
    for name, t in model.state_dict().items():
        out.update(native_items(name, t))
    return out


# ---- the tiny maker and native loading -----------------------------------------------------------
@pytest.mark.parametrize("which", ["f32", "quant", "sharded"])
def test_every_spec_tensor_loads_once(ckpts, which):
    got = _load_all(ckpts[which])
    spec = _spec_all()
    assert set(got) == set(spec)
    for name, s in spec.items():
        t = got[name]
        assert tuple(t.shape) == s.shape, name
        want = {TensorKind.INDEX: torch.int64}.get(s.kind, torch.float32)
        assert t.dtype == want, name
    for name in ("layers.0.ffn.gate.tid2eid", "layers.1.ffn.gate.tid2eid"):
        rows = got[name]
        assert bool((rows[:, 0] != rows[:, 1]).all()) and int(rows.max()) < CFG.n_routed_experts


def test_dtype_argument_and_fp32_kept(ckpts):
    got = dict(iter_checkpoint(ckpts["quant"], CFG, dtype=torch.bfloat16))
    assert got["layers.0.attn.wq_a.weight"].dtype == torch.bfloat16
    assert got["layers.0.ffn.experts.3.w2.weight"].dtype == torch.bfloat16
    for name in ("layers.0.hc_attn_fn", "layers.1.attn.attn_sink", "layers.1.attn.compressor.ape",
                 "layers.2.ffn.gate.bias", "hc_head_scale"):
        assert got[name].dtype == torch.float32, name
    assert got["layers.0.ffn.gate.tid2eid"].dtype == torch.int64


def test_f32_native_load_is_the_stored_tensors(ckpts):
    stored = load_file(os.path.join(ckpts["f32"], "model.safetensors"))
    got = _load_all(ckpts["f32"])
    assert set(stored) == set(got)
    assert all(torch.equal(stored[n], got[n]) for n in got)
    spec = _spec_all()
    # Constant-initialised params are randomised (norms around 1, not exactly 1).
    for name in ("layers.0.attn.attn_sink", "layers.1.attn.compressor.ape", "layers.0.hc_attn_base",
                 "layers.0.hc_attn_scale", "layers.0.attn_norm.weight", "layers.2.ffn.gate.bias", "mtp.0.enorm.weight"):
        assert got[name].unique().numel() == got[name].numel() > 0, name
    assert spec["layers.0.attn.wq_a.weight"].kind == TensorKind.LINEAR


def test_quantized_storage_and_load_equal_hand_dequant(ckpts):
    raw = load_file(os.path.join(ckpts["quant"], "model.safetensors"))
    assert raw["layers.0.attn.wkv.weight"].dtype == torch.float8_e4m3fn
    assert raw["layers.0.attn.wkv.scale"].dtype == torch.float8_e8m0fnu
    assert raw["layers.0.attn.wkv.scale"].shape == (1, 2)
    assert raw["mtp.0.e_proj.weight"].dtype == torch.float8_e4m3fn
    assert raw["layers.1.attn.indexer.wq_b.scale"].shape == (8, 1)
    assert raw["layers.0.ffn.experts.0.w1.weight"].dtype == torch.int8
    assert raw["layers.0.ffn.experts.0.w1.weight"].shape == (128, 128)
    assert raw["layers.0.ffn.experts.0.w1.scale"].shape == (128, 8)
    assert raw["layers.0.ffn.experts.0.w2.scale"].shape == (256, 4)
    assert raw["layers.1.attn.compressor.wkv.weight"].dtype == torch.bfloat16
    assert raw["layers.0.hc_attn_fn"].dtype == torch.float32 and raw["layers.0.ffn.gate.tid2eid"].dtype == torch.int64
    got = _load_all(ckpts["quant"])
    # FP8: e4m3 * 2^(byte-127) per 128x128 block, in float64.
    w, s = raw["layers.0.attn.wq_b.weight"], raw["layers.0.attn.wq_b.scale"]
    mult = torch.pow(2.0, s.view(torch.uint8).double() - 127).repeat_interleave(128, 0).repeat_interleave(128, 1)
    assert torch.equal(got["layers.0.attn.wq_b.weight"], (w.double() * mult[: w.shape[0], : w.shape[1]]).float())
    # FP4: low nibble first, e2m1 table, 2^(byte-127) per 32 inputs.
    p, s = raw["layers.2.ffn.experts.5.w2.weight"], raw["layers.2.ffn.experts.5.w2.scale"]
    rows = []
    for r in range(p.shape[0]):
        vals = []
        for j, byte in enumerate(p[r].view(torch.uint8).tolist()):
            for k, code in enumerate((byte & 15, byte >> 4)):
                mag = FP4_MAGS[code & 7] * 2.0 ** (s[r, (2 * j + k) // 32].view(torch.uint8).item() - 127)
                vals.append(-mag if code & 8 else mag)
        rows.append(vals)
    assert torch.equal(got["layers.2.ffn.experts.5.w2.weight"], torch.tensor(rows, dtype=torch.float32))


def test_sharded_equals_single_file_and_index(ckpts):
    with open(os.path.join(ckpts["sharded"], "model.safetensors.index.json")) as f:
        index = json.load(f)
    assert len(set(index["weight_map"].values())) == 3
    single, sharded = _load_all(ckpts["quant"]), _load_all(ckpts["sharded"])
    assert all(torch.equal(single[n], sharded[n]) for n in single)


def test_streamed_shards_equal_single_file(ckpts, tmp_path):
    """shard_gb streams the tensors into shards as they are drawn (benchmark-sized configs): the same tensors, an
    index naming every shard; one file when everything fits one shard."""
    streamed = make_tiny_checkpoint(str(tmp_path / "s"), TINY_CONFIG, seed=0, quantize=True, shard_gb=0.0005)
    with open(os.path.join(streamed, "model.safetensors.index.json")) as f:
        shards = set(json.load(f)["weight_map"].values())
    assert len(shards) > 2 and shards == {n for n in os.listdir(streamed) if n.endswith(".safetensors")}
    single, got = _load_all(ckpts["quant"]), _load_all(streamed)
    assert single.keys() == got.keys() and all(torch.equal(single[n], got[n]) for n in single)
    one = make_tiny_checkpoint(str(tmp_path / "one"), TINY_CONFIG, seed=0, quantize=True, shard_gb=10.0)
    assert sorted(n for n in os.listdir(one) if "safetensors" in n) == ["model.safetensors"]


def test_maker_is_deterministic(tmp_path):
    a = make_tiny_checkpoint(str(tmp_path / "a"), TINY_CONFIG, seed=3, quantize=True, num_shards=2)
    b = make_tiny_checkpoint(str(tmp_path / "b"), TINY_CONFIG, seed=3, quantize=True, num_shards=2)
    c = make_tiny_checkpoint(str(tmp_path / "c"), TINY_CONFIG, seed=4, quantize=True, num_shards=2)
    files = sorted(os.listdir(a))
    assert files == sorted(os.listdir(b)) and "tokenizer.json" in files and "tokenizer_config.json" in files
    for fname in files:
        with open(os.path.join(a, fname), "rb") as fa, open(os.path.join(b, fname), "rb") as forward_batch:
            assert fa.read() == forward_batch.read(), fname
    with open(os.path.join(a, "model-00001-of-00002.safetensors"), "rb") as fa, \
            open(os.path.join(c, "model-00001-of-00002.safetensors"), "rb") as fc:
        assert fa.read() != fc.read()
    with open(os.path.join(a, "config.json")) as f:
        cfg = json.load(f)
    assert cfg["expert_dtype"] == "fp4" and cfg["quantization_config"]["quant_method"] == "fp8"
    assert cfg["compress_ratios"] == [0, 4, 8, 4, 0] and cfg["num_hash_layers"] == 2


def test_unquantized_config_drops_quantization(ckpts):
    with open(os.path.join(ckpts["f32"], "config.json")) as f:
        cfg = json.load(f)
    assert "quantization_config" not in cfg and "expert_dtype" not in cfg and cfg["torch_dtype"] == "float32"


def test_parts_ignore_each_other(ckpts, tmp_path):
    main = dict(iter_checkpoint(ckpts["f32"], CFG, part="main"))
    mtp = dict(iter_checkpoint(ckpts["f32"], CFG, part="mtp"))
    assert not any(n.startswith("mtp.") for n in main) and all(n.startswith("mtp.0.") for n in mtp)
    assert "mtp.0.ffn.gate.bias" in mtp and "mtp.0.ffn.gate.tid2eid" not in mtp
    assert not any("compressor" in n or "indexer" in n for n in mtp)
    no_mtp = _rewrite(ckpts["f32"], str(tmp_path / "nomtp"),
                      lambda t: [t.pop(n) for n in list(t) if n.startswith("mtp.")])
    assert len(dict(iter_checkpoint(no_mtp, CFG, part="main"))) == len(main)
    with pytest.raises(CheckpointError, match="mtp.0.e_proj.weight"):
        list(iter_checkpoint(no_mtp, CFG, part="mtp"))


# ---- HF name forms and export --------------------------------------------------------------------
@pytest.fixture(scope="module")
def hf_model():
    hf_cfg = transformers.DeepseekV4Config(**hf_config_dict(CFG))
    model = transformers.DeepseekV4ForCausalLM(hf_cfg).float().eval()
    _randomize_hf_model(model)
    return model


def test_hf_saved_names_load_like_the_hf_model(hf_model, tmp_path):
    out = str(tmp_path / "hf_saved")
    hf_model.save_pretrained(out)
    with safe_open(os.path.join(out, "model.safetensors"), "pt") as f:
        keys = set(f.keys())
    assert {"model.embed_tokens.weight", "model.hc_head.hc_fn", "model.layers.0.attn.norm.weight",
            "model.norm.weight", "head.weight", "model.layers.1.attn.indexer.compressor.ape"} <= keys
    cfg = load_config(out)
    assert cfg.compress_ratios == CFG.compress_ratios and cfg.qk_rope_head_dim == 32
    assert cfg.rope_scaling == CFG.rope_scaling and cfg.mlp_layer_types == CFG.mlp_layer_types
    got = dict(iter_checkpoint(out, cfg, part="main"))
    want = _hf_native(hf_model)
    assert set(got) == set(want) == set(expected_tensors(CFG, "main"))
    bad = [n for n in want if not torch.equal(got[n], want[n].to(got[n].dtype))]
    assert not bad, bad[:5]


def test_hf_module_names_load_like_native(hf_model, tmp_path):
    out = tmp_path / "hf_module"
    out.mkdir()
    save_file({k: v.contiguous() for k, v in hf_model.state_dict().items()}, str(out / "model.safetensors"))
    with open(out / "config.json", "w") as f:
        json.dump(hf_config_dict(CFG), f)
    got = dict(iter_checkpoint(str(out), part="main"))
    want = _hf_native(hf_model)
    assert set(got) == set(want)
    assert all(torch.equal(got[n], want[n].to(got[n].dtype)) for n in want)
    # Fused experts split as w1 rows then w3 rows.
    fused = hf_model.state_dict()["model.layers.2.mlp.experts.gate_up_proj"]
    assert torch.equal(got["layers.2.ffn.experts.6.w1.weight"], fused[6, :128])
    assert torch.equal(got["layers.2.ffn.experts.6.w3.weight"], fused[6, 128:])


@pytest.mark.parametrize("name, native", [
    ("layers.2.attn.wq_a.scale", "layers.2.attn.wq_a.scale"),
    ("model.embed_tokens.weight", "embed.weight"),
    ("lm_head.weight", "head.weight"),
    ("head.weight", "head.weight"),
    ("model.norm.weight", "norm.weight"),
    ("model.hc_head.hc_scale", "hc_head_scale"),
    ("model.layers.0.attn.norm.weight", "layers.0.attn.kv_norm.weight"),
    ("model.layers.1.attn.compressor.norm.weight", "layers.1.attn.compressor.norm.weight"),
    ("model.layers.1.self_attn.compressor.kv_norm.weight", "layers.1.attn.compressor.norm.weight"),
    ("model.layers.1.self_attn.compressor.indexer.kv_norm.weight", "layers.1.attn.indexer.compressor.norm.weight"),
    ("model.layers.1.self_attn.compressor.indexer.scorer.weights_proj.weight",
     "layers.1.attn.indexer.weights_proj.weight"),
    ("model.layers.1.self_attn.compressor.indexer.q_b_proj.weight_scale_inv", "layers.1.attn.indexer.wq_b.scale"),
    ("model.layers.3.self_attn.o_a_proj.weight_scale_inv", "layers.3.attn.wo_a.scale"),
    ("model.layers.3.attn.wo_a.weight_scale_inv", "layers.3.attn.wo_a.scale"),
    ("model.layers.3.attn_hc.base", "layers.3.hc_attn_base"),
    ("model.layers.3.self_attn.sinks", "layers.3.attn.attn_sink"),
    ("model.layers.3.mlp.gate.e_score_correction_bias", "layers.3.ffn.gate.bias"),
    ("model.layers.3.mlp.shared_experts.up_proj.weight", "layers.3.ffn.shared_experts.w3.weight"),
    ("mtp.0.hc_head_fn", "mtp.0.hc_head_fn"),
])
def test_name_table(name, native):
    assert to_native(name) == native
    hf = to_hf_saved(native)
    assert hf is None if native.startswith("mtp.") else to_native(hf) == native


def test_fused_expert_names():
    fused = to_native("model.layers.2.mlp.experts.down_proj")
    assert fused == FusedExperts("layers.2", "down")
    assert fused.parts((2, 256, 128)) == [("layers.2.ffn.experts.0.w2.weight", (0,)),
                                          ("layers.2.ffn.experts.1.w2.weight", (1,))]
    t = torch.arange(2 * 6 * 3).view(2, 6, 3)
    items = dict(native_items("model.layers.0.mlp.experts.gate_up_proj", t))
    assert torch.equal(items["layers.0.ffn.experts.1.w1.weight"], t[1, :3])
    assert torch.equal(items["layers.0.ffn.experts.1.w3.weight"], t[1, 3:])


def test_hf_fp8_spelling_with_float_scales(ckpts, tmp_path):
    """HF module names with `weight_scale_inv` as float multipliers, mixed with native names."""
    def edit(t):
        for name in [n for n in t if n.endswith(".scale") and ".experts." not in n]:
            scale, weight = t.pop(name), t.pop(name[: -len("scale")] + "weight")
            hf = "model." + name[: -len(".scale")].replace("attn.wq_a", "self_attn.q_a_proj")
            t[hf + ".weight"], t[hf + ".weight_scale_inv"] = weight, e8m0_to_float(scale)
    mixed = _rewrite(ckpts["quant"], str(tmp_path / "x"), edit)
    assert "model.layers.0.self_attn.q_a_proj.weight_scale_inv" in load_file(os.path.join(mixed, "model.safetensors"))
    got, want = _load_all(mixed), _load_all(ckpts["quant"])
    assert set(got) == set(want) and all(torch.equal(got[n], want[n]) for n in want)


def test_fp8_converted_experts_detected_by_dtype(ckpts, tmp_path):
    """Routed experts stored FP8 e4m3 + 128x128 ue8m0 scales (the FP8 checkpoints) load like FP4 ones."""
    from sglang.srt.model_loader.quant_formats import dequantize_fp8_block, quantize_fp8_block

    want = {}

    def edit(t):
        for name in [n for n in t if ".experts." in n and n.endswith(".weight")]:
            fp32 = t[name]
            w8, s8 = quantize_fp8_block(fp32)
            t[name], t[name[: -len("weight")] + "scale"] = w8, s8
            want[name] = dequantize_fp8_block(w8, s8)

    fp8 = _rewrite(ckpts["f32"], str(tmp_path / "fp8x"), edit)
    assert want and load_file(os.path.join(fp8, "model.safetensors"))["layers.0.ffn.experts.0.w1.weight"].dtype \
        == torch.float8_e4m3fn
    got = _load_all(fp8)
    assert all(torch.equal(got[n], w) for n, w in want.items())
    plain = _load_all(ckpts["f32"])
    assert all(torch.equal(got[n], plain[n]) for n in plain if n not in want)


def test_export_then_hf_from_pretrained(ckpts, tmp_path):
    out = export_hf_checkpoint(ckpts["quant"], str(tmp_path / "export"))
    with open(os.path.join(out, "config.json")) as f:
        cfg = json.load(f)
    for key in ("compress_ratios", "num_hash_layers", "rope_scaling", "quantization_config", "expert_dtype"):
        assert key not in cfg, key
    assert cfg["compress_rates"] == {"compressed_sparse_attention": 4, "heavily_compressed_attention": 8}
    assert cfg["qk_rope_head_dim"] == 32 and cfg["rope_parameters"]["rope_type"] == "yarn"
    model, info = transformers.DeepseekV4ForCausalLM.from_pretrained(out, dtype=torch.float32, output_loading_info=True)
    assert not info["missing_keys"] and not info["unexpected_keys"] and not info["mismatched_keys"], info
    assert model.config.qk_rope_head_dim == 32
    ours = dict(iter_checkpoint(ckpts["quant"], CFG, part="main"))
    theirs = _hf_native(model)
    assert set(ours) == set(theirs)
    bad = [n for n in ours if not torch.equal(ours[n], theirs[n])]
    assert not bad, bad[:5]
    # MTP rides along under native names and our loader reads it back.
    assert len(dict(iter_checkpoint(out, part="mtp"))) == len(expected_tensors(CFG, "mtp"))


def test_export_rejects_two_hca_ratios(tmp_path):
    cfg = dict(TINY_CONFIG, num_hidden_layers=5, compress_ratios=[0, 4, 8, 16, 4, 0])
    with pytest.raises(ConfigError, match="compress_ratios"):
        hf_config_dict(DeepseekV4Config.from_dict(cfg))


# ---- bad checkpoints -----------------------------------------------------------------------------
def _error(path, part="main"):
    with pytest.raises(CheckpointError) as exc:
        list(iter_checkpoint(path, part=part))
    return str(exc.value)


def test_missing_tensor(ckpts, tmp_path):
    bad = _rewrite(ckpts["f32"], str(tmp_path / "x"),
                   lambda t: (t.pop("layers.1.attn.indexer.wq_b.weight"), t.pop("layers.3.ffn.experts.7.w3.weight")))
    msg = _error(bad)
    assert "missing 2 tensor(s)" in msg and "'layers.1.attn.indexer.wq_b.weight'" in msg and "[1024, 128]" in msg
    assert "'layers.3.ffn.experts.7.w3.weight'" in msg


def test_wrong_shape(ckpts, tmp_path):
    bad = _rewrite(ckpts["f32"], str(tmp_path / "x"),
                   lambda t: t.update({"layers.0.attn.wkv.weight": torch.zeros(95, 256)}))
    msg = _error(bad)
    assert "'layers.0.attn.wkv.weight'" in msg and "[95, 256]" in msg and "expected [96, 256]" in msg


def test_wrong_dtype(ckpts, tmp_path):
    bad = _rewrite(ckpts["f32"], str(tmp_path / "x"), lambda t: t.update({
        "layers.2.ffn.gate.weight": torch.zeros(8, 256, dtype=torch.int32),
        "layers.0.ffn.gate.tid2eid": torch.zeros(512, 2)}))
    msg = _error(bad)
    assert "'layers.2.ffn.gate.weight' has dtype I32" in msg
    assert "'layers.0.ffn.gate.tid2eid' has dtype F32, expected I64 or I32" in msg


def test_fp8_weight_without_scale_and_scale_without_weight(ckpts, tmp_path):
    def edit(t):
        t.pop("layers.0.attn.wq_a.scale")
        t["layers.0.attn.bogus.scale"] = torch.ones(1, 1)
    bad = _rewrite(ckpts["quant"], str(tmp_path / "x"), edit)
    msg = _error(bad)
    assert "'layers.0.attn.wq_a.weight' is stored FP8 but its '.scale' tensor is missing" in msg
    assert "'layers.0.attn.bogus.scale' is a '.scale' with no matching '.weight'" in msg


def test_bad_fp4_scale_and_unexpected_name(ckpts, tmp_path):
    def edit(t):
        t["layers.0.ffn.experts.1.w1.scale"] = t["layers.0.ffn.experts.1.w1.scale"][:, :4].clone()
        t["layers.0.attn.wq_c.weight"] = torch.zeros(2, 2)
    msg = _error(_rewrite(ckpts["quant"], str(tmp_path / "x"), edit))
    assert "'layers.0.ffn.experts.1.w1.scale' has shape [128, 4], expected [128, 8]" in msg
    assert "unexpected tensor 'layers.0.attn.wq_c.weight'" in msg


def test_tid2eid_out_of_range(ckpts, tmp_path):
    def edit(t):
        t["layers.1.ffn.gate.tid2eid"][7, 1] = CFG.n_routed_experts
    msg = _error(_rewrite(ckpts["f32"], str(tmp_path / "x"), edit))
    assert "'layers.1.ffn.gate.tid2eid'" in msg and "outside [0, 8)" in msg and "row 7" in msg


def test_shard_listed_but_absent(ckpts, tmp_path):
    bad = shutil.copytree(ckpts["sharded"], str(tmp_path / "x"))
    os.remove(os.path.join(bad, "model-00002-of-00003.safetensors"))
    assert "model-00002-of-00003.safetensors" in _error(bad)


def test_index_lists_tensor_missing_from_shard(ckpts, tmp_path):
    bad = shutil.copytree(ckpts["sharded"], str(tmp_path / "x"))
    index_path = os.path.join(bad, "model.safetensors.index.json")
    with open(index_path) as f:
        index = json.load(f)
    index["weight_map"]["layers.0.attn.ghost.weight"] = "model-00001-of-00003.safetensors"
    with open(index_path, "w") as f:
        json.dump(index, f)
    msg = _error(bad)
    assert "layers.0.attn.ghost.weight" in msg and "model-00001-of-00003.safetensors" in msg


@pytest.mark.parametrize("edit, field", [
    (lambda c: c.pop("hidden_size"), "hidden_size"),
    (lambda c: c.update(hidden_size="256"), "hidden_size"),
    (lambda c: c.update(compress_ratios=[0, 4, 8]), "compress_ratios"),
    (lambda c: c.update(compress_ratios=[0, 4, 4, 4, 0], num_hash_layers=9), "num_hash_layers"),
    (lambda c: (c.pop("compress_ratios"), c.update(layer_types=["sliding_attention"] * 3)), "layer_types"),
])
def test_bad_config(ckpts, tmp_path, edit, field):
    bad = _rewrite(ckpts["f32"], str(tmp_path / "x"), lambda t: None, config_edit=edit)
    with pytest.raises(ConfigError, match=f"'{field}'"):
        load_config(bad)
    with pytest.raises(ConfigError, match=f"'{field}'"):
        list(iter_checkpoint(bad))


# ---- built-in model ------------------------------------------------------------------------------
def test_builtin_model(tmp_path, monkeypatch):
    monkeypatch.setenv("SGLANG_CACHE_DIR", str(tmp_path))
    assert is_builtin_model_name("tiny-deepseek-v4") and not is_builtin_model_name("deepseek-ai/DeepSeek-V4-Flash")
    path = builtin_model_path()
    assert path.startswith(str(tmp_path)) and builtin_model_path("tiny-deepseek-v4") == path
    assert sorted(os.listdir(os.path.dirname(path))) == [os.path.basename(path)]  # no temp dirs left
    cfg = load_config(path)
    assert cfg.vocab_size == 129280 and cfg.quantization_config is None
    head = load_checkpoint(path, cfg)["head.weight"]
    assert head.shape == (129280, 256)
    with safe_open(os.path.join(path, "model.safetensors"), "pt") as f:
        assert f.get_slice("embed.weight").get_dtype() == "BF16"


def test_builtin_model_loads_with_hf_auto_classes():
    """The built-in tiny model uses only DeepSeek-V4's real compression ratios, so clients that load its directory
    through HF transformers' AutoConfig / AutoTokenizer (upstream SGLang's tools do) work; a ratio outside 0/4/128
    is a KeyError there."""
    from transformers import AutoConfig, AutoTokenizer

    from sglang.srt.model_loader.tiny_checkpoint import BUILTIN_MODELS, builtin_model_path

    assert set(BUILTIN_MODELS["tiny-deepseek-v4"][0]["compress_ratios"]) <= {0, 4, 128}
    path = builtin_model_path("tiny-deepseek-v4")
    assert AutoConfig.from_pretrained(path).model_type == "deepseek_v4"
    assert AutoTokenizer.from_pretrained(path).encode("Hello") == [19923]
    assert DeepseekV4Config.from_pretrained(path).compress_ratio(2) == 128
