"""Engine.update_weights_from_disk (the server's /update_weights_from_disk): another checkpoint of the served model
loaded in place (joined projections, the MTP draft and the prefix cache included) serves exactly what a fresh engine
on it serves; refusals and a load that fails midway leave the served weights as they were."""

from __future__ import annotations

import functools
import os

import pytest
import torch
from safetensors.torch import load, load_file, save

import sglang.srt.model_loader.model_builder as model_builder
from oracle import CHECKPOINT_ROOT, TINY, checkpoint, engine, greedy_run, max_abs_diff, random_ids
from sglang.srt.model_loader.tiny_checkpoint import TINY_CONFIG, make_tiny_checkpoint

PROMPTS = [random_ids(40, 11), random_ids(23, 12)]
# the MTP draft is reloaded too; the shared expert fused into the routed stack takes its slot there
SPEC = dict(speculative_algorithm="EAGLE", speculative_num_steps=2, enforce_shared_experts_fusion=True)


@functools.lru_cache(maxsize=None)
def other(name: str, quantize: bool = False, **changes) -> str:
    """A float32 checkpoint of TINY (seed 1: other weights; `quantize`: the hub's FP8 / MXFP4 formats, as
    oracle.checkpoint) or of a changed config."""
    path = os.path.join(CHECKPOINT_ROOT, f"update-{name}")
    config = {**TINY, **changes}
    if quantize:
        config.update(quantization_config=TINY_CONFIG["quantization_config"], expert_dtype="fp4")
    make_tiny_checkpoint(path, config, seed=1, quantize=quantize, dtype="float32")
    return path


def outputs(eng) -> list:
    runs = [greedy_run(eng, ids, 6) for ids in PROMPTS]
    return [(r["output_ids"], [lp for lp, _, _ in r["meta_info"]["output_token_logprobs"]]) for r in runs]


def same(a: list, b: list) -> bool:
    return all(x[0] == y[0] and max_abs_diff(x[1], y[1]) <= 1e-5 for x, y in zip(a, b))


@pytest.fixture(scope="module")
def served():
    eng = engine("tiny", **SPEC)
    yield eng, outputs(eng)
    eng.shutdown()


def test_updated_weights_serve_what_a_fresh_engine_serves(served):
    eng, before = served
    ok, message = eng.update_weights_from_disk(other("b"))
    assert ok, message
    fresh = engine("tiny", model_path=other("b"), **SPEC)
    try:
        want = outputs(fresh)
    finally:
        fresh.shutdown()
    got = outputs(eng)  # the prompts' pages were cached under the old weights: the update emptied the cache
    assert same(got, want) and not same(got, before)
    ok, message = eng.update_weights_from_disk(checkpoint("tiny"))
    assert ok, message
    assert same(outputs(eng), before)
    eng.model_runner.token_allocator.check_all_free()


def _stored(path: str, name: str):
    for f in os.listdir(path):
        if f.endswith(".safetensors"):
            tensors = load_file(os.path.join(path, f))
            if name in tensors:
                return tensors[name]
    raise KeyError(name)


# a plain weight, parts of joined projections (wq_a + wkv; wq_b + the indexer's), one expert's slice, the shared
# expert fused into the routed stack, and an MTP weight (the draft model)
READ_BACK = ["embed.weight", "layers.0.attn.wq_a.weight", "layers.1.attn.indexer.wq_b.weight",
             "layers.0.ffn.experts.3.w2.weight", "layers.2.ffn.shared_experts.w1.weight", "mtp.0.attn.wkv.weight"]


def test_get_weights_by_name_reads_what_each_checkpoint_stored(served):
    eng, _ = served
    for path in (other("b"), checkpoint("tiny")):  # after each update the served weights are that checkpoint's
        ok, message = eng.update_weights_from_disk(path)
        assert ok, message
        for name in READ_BACK:
            got = torch.tensor(eng.get_weights_by_name(name, truncate_size=3))
            want = _stored(path, name)[:3].float()
            assert got.shape == want.shape and torch.equal(got, want), name
    with pytest.raises(ValueError, match="no served weight"):
        eng.get_weights_by_name("layers.0.attn.no_such.weight")


def _all_tensors(path: str) -> dict:
    return {k: v for f in sorted(os.listdir(path)) if f.endswith(".safetensors")
            for k, v in load_file(os.path.join(path, f)).items()}


def test_update_weights_from_tensor(served):
    """Upstream's in-memory update (RL loops): the whole checkpoint as tensors serves what a fresh engine on it
    serves; a subset updates just those weights; one bad pair refuses the whole call before anything is written."""
    eng, before = served
    b = _all_tensors(other("b"))
    ok, message = eng.update_weights_from_tensor(list(b.items()))
    assert ok and message == f"updated {len(b)} weight tensors", message
    fresh = engine("tiny", model_path=other("b"), **SPEC)
    try:
        assert same(outputs(eng), outputs(fresh))
    finally:
        fresh.shutdown()
    assert eng.update_weights_from_disk(checkpoint("tiny"))[0] and same(outputs(eng), before)
    a = _all_tensors(checkpoint("tiny"))
    name = "layers.1.attn.wq_b.weight"  # joined with the indexer's wq_b after loading
    for bad in ([(name, b[name]), ("no.such.weight", b[name])], [(name, b[name][:, :-1])],
                [("layers.0.ffn.gate.tid2eid", b["layers.0.ffn.gate.tid2eid"].float())], [(name, "not a tensor")]):
        ok, message = eng.update_weights_from_tensor(bad)
        assert not ok, bad
        assert torch.equal(torch.tensor(eng.get_weights_by_name(name, 10**5)), a[name].float())
    assert eng.update_weights_from_tensor([(name, b[name])]) == (True, "updated 1 weight tensors")
    assert torch.equal(torch.tensor(eng.get_weights_by_name(name, 10**5)), b[name].float())
    assert not same(outputs(eng), before)
    assert eng.update_weights_from_disk(checkpoint("tiny"))[0] and same(outputs(eng), before)
    assert eng.update_weights_from_tensor([(name, b[name])], flush_cache=False)[0] is False


def test_quantized_checkpoints_update_in_their_kept_formats():
    """FP8 linears and MXFP4 experts (kept quantized on an NVIDIA GPU, dequantized at load on the CPU) reload in
    place; a bf16-format checkpoint is refused where the served weights keep the quantized formats."""
    eng = engine("tiny", quantize=True)
    try:
        before = outputs(eng)
        ok, message = eng.update_weights_from_disk(other("bq", quantize=True))
        assert ok, message
        fresh = engine("tiny", quantize=True, model_path=other("bq", quantize=True))
        try:
            want = outputs(fresh)
        finally:
            fresh.shutdown()
        assert same(outputs(eng), want) and not same(want, before)
        ok, message = eng.update_weights_from_disk(other("b"))
        kept = any(eng.model_runner.kept_formats[0].values()) or eng.model_runner.kept_formats[1] is not None
        assert ok != kept, message  # refused only where the served weights stayed quantized
    finally:
        eng.shutdown()


def _altered_copy(name: str, change) -> str:
    """other("b") copied to CHECKPOINT_ROOT/name with change(filename, bytes) -> bytes applied to each weights file."""
    path = os.path.join(CHECKPOINT_ROOT, name)
    if not os.path.exists(path):
        os.makedirs(path)
        src = other("b")
        for f in os.listdir(src):
            with open(os.path.join(src, f), "rb") as r, open(os.path.join(path, f), "wb") as w:
                data = r.read()
                w.write(change(data) if f.endswith(".safetensors") else data)
    return path


def _without_one_tensor(data: bytes) -> bytes:
    tensors = load(data)
    tensors.pop(sorted(k for k in tensors if k.endswith("attn.wq_a.weight"))[0])
    return save(tensors)


def _truncated(data: bytes) -> bytes:
    """Cut short: the header no longer matches the file (unreadable before any write)."""
    return data[:len(data) // 2]


@pytest.mark.parametrize("case", ["architecture", "missing tensor", "unreadable file", "load format",
                                  "fails midway"])
def test_refused_or_failed_updates_leave_the_served_weights(served, case, monkeypatch):
    eng, before = served
    path, load_format, expect = other("b"), None, "loaded again"
    if case == "architecture":
        path, expect = other("wide", moe_intermediate_size=2 * TINY["moe_intermediate_size"]), "another architecture"
    elif case == "missing tensor":
        path, expect = _altered_copy("update-missing", _without_one_tensor), "wq_a"
    elif case == "unreadable file":  # a fuzz pass: a truncated file was a 500
        path, expect = _altered_copy("update-truncated", _truncated), "cannot be read"
    elif case == "load format":
        load_format, expect = "gguf", "load_format"
    else:  # the loader breaks after some tensors were written: the served checkpoint is loaded again
        real = model_builder.iter_checkpoint

        def breaking(model_dir, *args, **kwargs):
            for n, item in enumerate(real(model_dir, *args, **kwargs)):
                if model_dir == path and n == 10:
                    raise OSError("disk read failed")
                yield item
        monkeypatch.setattr(model_builder, "iter_checkpoint", breaking)
    ok, message = eng.update_weights_from_disk(path, load_format=load_format)
    assert not ok and expect in message, message
    assert same(outputs(eng), before)
