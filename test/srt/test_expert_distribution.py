"""--expert-distribution-recorder-mode stat (eplb/expert_distribution.py): the counts per MoE layer and expert are
exactly the router's choices for every forwarded token, on the static decode path (batches padded to a bucket: the
padded rows do not count) and the general path; hash-routed layers are checked expert by expert (their choices are a
table lookup of the token ids)."""

from __future__ import annotations

import os

import pytest
import torch

from oracle import engine, random_ids
from sglang.srt.environ import envs

PROMPTS = [random_ids(20, 31), random_ids(33, 32), random_ids(9, 33)]
NEW = 5


@pytest.mark.parametrize("static", [True, False])
def test_counts_are_the_routers_choices(tmp_path, monkeypatch, static):
    monkeypatch.setenv(envs.SGLANG_EXPERT_DISTRIBUTION_RECORDER_DIR.name, str(tmp_path))
    eng = engine("tiny", expert_distribution_recorder_mode="stat", disable_overlap_schedule=True,
                 disable_radix_cache=True, disable_cuda_graph=not static, cuda_graph_bs=[4])
    try:
        with pytest.raises(ValueError, match="nothing recorded"):
            eng.dump_expert_distribution_record()
        with pytest.raises(ValueError, match="no expert distribution record is running"):
            eng.stop_expert_distribution_record()
        eng.generate(input_ids=random_ids(12, 30), sampling_params={"max_new_tokens": 3})  # before start: not counted
        assert "successfully" in eng.start_expert_distribution_record()
        outs = eng.generate(input_ids=PROMPTS, sampling_params={"temperature": 0, "max_new_tokens": NEW,
                                                                "ignore_eos": True})
        assert "successfully" in eng.stop_expert_distribution_record()
        eng.generate(input_ids=random_ids(12, 30), sampling_params={"max_new_tokens": 3})  # after stop: not counted
        message = eng.dump_expert_distribution_record()
        path = message.rsplit(" ", 1)[1]
        assert os.path.dirname(path) == str(tmp_path)
        counts = torch.load(path)["logical_count"]
        config, model = eng.model_runner.model_config, eng.model_runner.model
        # every forwarded token: the prompts, then each output token but the last (never fed back)
        tokens = torch.tensor([t for p, o in zip(PROMPTS, outs) for t in p + o["output_ids"][:-1]])
        assert counts.shape == (config.num_hidden_layers + config.num_nextn_predict_layers, config.n_routed_experts)
        for layer in range(config.num_hidden_layers):
            assert int(counts[layer].sum()) == len(tokens) * config.num_experts_per_tok, layer
            if config.is_hash_layer(layer):
                table = model.layers[layer].ffn.gate.tid2eid.cpu()
                want = torch.bincount(table[tokens].reshape(-1), minlength=config.n_routed_experts)
                assert torch.equal(counts[layer], want), layer
        assert int(counts[config.num_hidden_layers:].sum()) == 0  # no MTP draft here
    finally:
        eng.shutdown()


def test_off_by_default():
    eng = engine("tiny")
    try:
        with pytest.raises(ValueError, match="--expert-distribution-recorder-mode"):
            eng.start_expert_distribution_record()
    finally:
        eng.shutdown()
