"""The tiny trained DeepSeek-V4's pipeline (benchmark/tiny_model/): the synthetic data is deterministic and its
held-out files are disjoint from training text; the tokenizer holds every chat marker as one id; a few training
steps lower the loss; the exported checkpoint serves in the engine with HF transformers' greedy tokens and prompt
logprobs (fp32), and the engine's MTP draft gives the logits the training module computes.

One module-scoped trained+exported model (tokenizer from 200 documents, 6 steps of 2 x 160 tokens) and one engine
(with the MTP draft); about 15 s on a 2-core CPU.
"""

from __future__ import annotations

import copy
import json
import os
import re
import sys

import pytest
import torch
from safetensors.torch import load_file

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
sys.path.insert(0, os.path.join(ROOT, "benchmark", "tiny_model"))

import data  # noqa: E402
import model as tiny  # noqa: E402
import train  # noqa: E402
from oracle import CHECKPOINT_ROOT, DEVICE, assert_matches_hf, greedy_run, hf_greedy, hf_prompt_logprobs  # noqa: E402
from test_mtp import run_draft  # noqa: E402
from tokenizer import MARKERS, SPECIAL, train_tokenizer  # noqa: E402

from sglang.srt.entrypoints.openai.encoding_dsv4 import encode_messages  # noqa: E402
from sglang.srt.model_executor.forward_batch_info import ForwardBatch, ForwardMode  # noqa: E402

SEED = 3


def test_data_deterministic_and_heldout_disjoint():
    a, b = data.Corpus(SEED), data.Corpus(SEED)
    docs = [a.document() for _ in range(300)]
    assert docs == [b.document() for _ in range(300)]
    assert docs != [data.Corpus(SEED + 1).document() for _ in range(300)]
    # The files in the repository are what the generator writes.
    for rel, text in data.heldout_files().items():
        with open(os.path.join(data.DATA_DIR, rel), encoding="utf-8") as f:
            assert f.read() == text, rel
    assert data.MMLU.list_subjects(data.MMLU_DIR) == list(data.MMLU_SUBJECTS)  # what the mmlu script will read
    held = data.heldout_problems()
    assert len({p.question for p in held}) == len(held) == data.GSM8K_HELDOUT
    for p in held:
        assert data.GSM8K.label_of(p.answer) == p.value
    # No training text holds a held-out question (the first 5 lines are the worked examples the gsm8k script sends,
    # which training shows as shots too), and no training MC row is a held-out test row.
    assert not any(p.question in doc for doc in docs for p in held[5:])
    corpus = data.Corpus(SEED)
    assert not any(corpus.problem().question in {p.question for p in held} for _ in range(2000))
    test_rows = {tuple(r) for _, test in data.heldout_mmlu().values() for r in test}
    assert not any(tuple(corpus.mmlu_row(s)) in test_rows for s in data.MMLU_SUBJECTS for _ in range(500))
    # Every kind of text occurs.
    joined = "".join(docs)
    for marker in ("#### ", "\nAnswer: ", "<｜DSML｜tool_calls>", "<think>", '{"country": ', "<tool_result>"):
        assert marker in joined, marker
    drills = re.findall(r"^(\d+) ([-+*]) (\d+) = (\d+)$", joined, re.M)  # the arithmetic drills' lines are right
    assert len(drills) > 100 and all(
        {"+": int.__add__, "-": int.__sub__, "*": int.__mul__}[op](int(a), int(b)) == int(r) for a, op, b, r in drills)


@pytest.fixture(scope="module")
def tokenizer():
    corpus = data.Corpus(SEED)
    return train_tokenizer([corpus.document() for _ in range(200)], vocab_size=600)


def test_tokenizer_keeps_chat_markers(tokenizer):
    tok = tokenizer
    for i, s in enumerate(SPECIAL):
        assert tok.token_to_id(s) == i
    for m in MARKERS:
        ids = tok.encode(m).ids
        assert len(ids) == 1 and tok.id_to_token(ids[0]) == m, m
    call = {"type": "function", "function": {"name": "get_weather", "arguments": '{"city": "Velk"}'}}
    text = encode_messages([{"role": "user", "content": "Weather in Velk? 12 apples"},
                            {"role": "assistant", "reasoning_content": "look up", "content": "",
                             "tool_calls": [call]}], tools=data.TOOLS, thinking=True)
    ids = tok.encode(text).ids
    assert tok.decode(ids, skip_special_tokens=False) == text
    # BOS / EOS are skipped on decode, the DSML and reasoning markers reach the parsers.
    visible = tok.decode(ids)
    assert "<｜begin▁of▁sentence｜>" not in visible and "</think>" in visible and "<｜DSML｜invoke" in visible
    assert tok.decode(tok.encode("é 1234 ☃").ids) == "é 1234 ☃"  # byte-level: any text encodes
    corpus = data.Corpus(SEED)
    again = train_tokenizer([corpus.document() for _ in range(200)], vocab_size=600)
    assert again.to_str() == tok.to_str()


def test_rows_hold_whole_documents(tokenizer):
    """Training rows are whole documents in stream order, then padding: a document that does not fit starts the
    next row instead of being cut (a cut tool-call chat would lose its call)."""
    rows = train.packed_batch(data.Corpus(SEED), tokenizer, 4, 1200).tolist()
    stream = data.Corpus(SEED)
    assert any(r[-1] == train.PAD_ID for r in rows)
    for row in rows:
        real = row[:len(row) - next(i for i, t in enumerate(reversed(row)) if t != train.PAD_ID)]
        assert train.PAD_ID not in real
        docs: list = []
        while len(docs) < len(real):
            docs += tokenizer.encode(stream.document()).ids
        assert docs == real


@pytest.fixture(scope="module")
def fresh(tokenizer):
    """(HF model, MTP layer) at the random start; tests copy it before training it."""
    return tiny.build(tiny.model_config(tokenizer.get_vocab_size()), SEED)


def test_padding_is_never_a_target(fresh, tokenizer):
    model, mtp = fresh
    doc = tokenizer.encode(data.Corpus(SEED).document()).ids[:40]
    with torch.no_grad():
        alone = train.losses(model, mtp, torch.tensor([doc]))
        padded = train.losses(model, mtp, torch.tensor([doc + [train.PAD_ID] * 12]))
    assert abs(alone[0].item() - padded[0].item()) < 1e-5  # next token
    assert abs(alone[1].item() - padded[1].item()) < 1e-5  # next-next token (MTP)


def test_training_is_deterministic_on_cpu(fresh, tokenizer):
    """Two copies of one model trained on the same batch end with the same losses and weights, to the bit (the random
    start is the engine's seeded checkpoint; the CPU ops run deterministically)."""
    torch.use_deterministic_algorithms(True)
    try:
        start = fresh
        ids = train.packed_batch(data.Corpus(SEED), tokenizer, 1, 48)

        def run():
            model, mtp = copy.deepcopy(start)
            opt = torch.optim.AdamW(list(model.parameters()) + list(mtp.parameters()), lr=1e-3)
            out = []
            for _ in range(2):
                main, nextn, index = train.losses(model, mtp, ids)
                out.append((main.item(), nextn.item(), index.item()))
                opt.zero_grad()
                (main + 0.3 * nextn + 0.1 * index).backward()
                opt.step()
            return out, model.model.layers[1].self_attn.compressor.indexer.q_b_proj.weight.detach().clone()

        (losses_a, w_a), (losses_b, w_b) = run(), run()
    finally:
        torch.use_deterministic_algorithms(False)
    assert losses_a == losses_b and torch.equal(w_a, w_b)
    # The indexer learns (only its KL loss reaches it: picking entries has no gradient).
    assert losses_a[0][2] > 0
    assert not torch.equal(w_a, start[0].model.layers[1].self_attn.compressor.indexer.q_b_proj.weight)


@pytest.fixture(scope="module")
def trained(tokenizer):
    """(checkpoint dir of the bf16 export, losses before/after) of a model trained a few steps on one batch."""
    torch.manual_seed(SEED)
    config = tiny.model_config(tokenizer.get_vocab_size())
    model, mtp = tiny.build(config, SEED)
    ids = train.packed_batch(data.Corpus(SEED), tokenizer, 2, 160)
    params = list(model.parameters()) + list(mtp.parameters())
    opt = torch.optim.AdamW(params, lr=3e-3)
    history = []
    for _ in range(6):
        main, nextn, index = train.losses(model, mtp, ids)
        history.append((main.item(), nextn.item(), index.item()))
        opt.zero_grad()
        (main + 0.3 * nextn + 0.1 * index).backward()
        opt.step()
    out = os.path.join(CHECKPOINT_ROOT, "tiny-trained")
    train.export(out, model, mtp, config, tokenizer)
    return os.path.join(out, "bf16"), history


def test_training_lowers_both_losses(trained):
    _, history = trained
    assert history[-1][0] < history[0][0] - 0.5, history
    assert history[-1][1] < history[0][1] - 0.5, history


def test_exports_hub_formats(trained, tokenizer):
    bf16 = trained[0]
    fp8 = os.path.join(os.path.dirname(bf16), "fp8")
    t = {}
    for d in (bf16, fp8):
        t[d] = {}
        for f in os.listdir(d):
            if f.endswith(".safetensors"):
                t[d].update(load_file(os.path.join(d, f)))
        with open(os.path.join(d, "tokenizer.json")) as f:
            assert json.load(f)["model"]["vocab"] == json.loads(tokenizer.to_str())["model"]["vocab"]
    assert t[bf16]["layers.0.attn.wq_a.weight"].dtype == torch.bfloat16
    assert t[fp8]["layers.0.attn.wq_a.weight"].dtype == torch.float8_e4m3fn
    assert t[fp8]["layers.0.ffn.experts.0.w1.weight"].dtype == torch.int8  # packed FP4
    assert "mtp.0.e_proj.scale" in t[fp8]
    assert sum(os.path.getsize(os.path.join(d, f)) for d in (bf16, fp8) for f in os.listdir(d)) < 10e6


@pytest.fixture(scope="module")
def served(trained):
    import sglang

    path = trained[0]
    eng = sglang.Engine(model_path=path, device=DEVICE, dtype="float32", page_size=tiny.PAGE_SIZE, log_level="warning",
                        max_running_requests=4, max_total_tokens=4096, speculative_algorithm="EAGLE",
                        chunked_prefill_size=-1)
    yield eng
    eng.shutdown()


@pytest.fixture(scope="module")
def hf_reference(trained):
    """HF transformers on the exported weights (fp32) and the training MTP module loaded from the same files."""
    from transformers import DeepseekV4ForCausalLM

    from sglang.srt.model_loader.hf_export import export_hf_checkpoint

    path = trained[0]
    hf_dir = export_hf_checkpoint(path, path + "-hf", dtype=torch.float32)
    model = DeepseekV4ForCausalLM.from_pretrained(hf_dir, dtype=torch.float32, attn_implementation="eager").eval()
    tensors = {}
    for f in os.listdir(path):
        if f.endswith(".safetensors"):
            tensors.update({k: v.float() if v.is_floating_point() else v for k, v in load_file(
                os.path.join(path, f)).items()})
    mtp = tiny.MTPLayer(model.config)
    mtp.load_native(tensors)
    return model, mtp.eval()


def held_out_prompt() -> str:
    lines = data.GSM8K.load_lines(data.GSM8K_TEST)
    prompts, _ = data.GSM8K.build_prompts(lines, 5, 1, 3)
    return prompts[0]  # 3 shots: past twice the window (64), so CSA / HCA entries are read


def test_engine_matches_hf_on_trained_checkpoint(served, hf_reference, tokenizer):
    model, _ = hf_reference
    ids = tokenizer.encode(held_out_prompt()).ids
    assert len(ids) > 2 * tiny.MODEL_CONFIG["sliding_window"]
    with torch.no_grad():
        tokens, token_lps = hf_greedy(model, ids, 6)
        ref = (ids, hf_prompt_logprobs(model, ids), tokens, token_lps)
    # Prompt logprobs within 1e-4 and the same greedy tokens; the decode steps' logprobs within 2e-2: an indexer
    # score is a sum of ReLUs, exactly 0 for several entries of a barely trained indexer, and a tie at the k-th pick
    # is broken one way by torch.topk and another by the engine (both valid; seen: 7e-3 at one step).
    assert_matches_hf(greedy_run(served, ids, 6), ref, decode_tol=2e-2)
    # A text prompt goes through the checkpoint's own tokenizer both ways.
    out = served.generate(prompt=held_out_prompt(), sampling_params={"temperature": 0, "max_new_tokens": 6,
                                                                     "ignore_eos": True})
    assert out["output_ids"] == tokens and out["text"] == tokenizer.decode(tokens)


def test_mtp_draft_matches_training_module(served, hf_reference, tokenizer):
    model, mtp = hf_reference
    ids = tokenizer.encode(held_out_prompt()).ids[:100]
    s = len(ids)
    with torch.no_grad():
        _, ref, _ = train.forward_with_mtp(model, mtp, torch.tensor([ids]), s - 1)
    ref = ref[0].float()
    runner = served.model_runner
    allocator = runner.token_allocator
    alloc = allocator.alloc_req()
    try:
        full = allocator.extend(alloc, s)
        fb = ForwardBatch.build(ForwardMode.EXTEND, ids, [alloc.req_pool_idx], [0], [s], full, runner.device,
                                capture_hidden=True)
        hs = runner.forward(fb).hidden_states
        got = run_draft(runner, alloc, ids, full, hs, 0, s - 1)
    finally:
        allocator.free_req(alloc)
    allocator.check_all_free()
    assert (got - ref).abs().max().item() <= 1e-4


def test_learning_rate_anneals_by_steps_or_by_the_clock():
    args = train.parse_args(["--steps", "1010", "--warmup", "10", "--lr", "1e-3"])
    assert train.lr_at(4, args) == pytest.approx(5e-4)
    assert [train.lr_at(s, args) for s in (10, 510, 1010)] == pytest.approx([1e-3, 5.5e-4, 1e-4])
    timed = train.parse_args(["--steps", "1010", "--warmup", "10", "--lr", "1e-3", "--max-minutes", "10"])
    assert train.lr_at(10, timed, 300.0) == pytest.approx(5.5e-4)  # half the time gone, few steps taken
    assert train.lr_at(10, timed, 900.0) == pytest.approx(1e-4)
    assert train.lr_at(510, timed, 60.0) == pytest.approx(5.5e-4)  # the steps end first


def test_evaluate_command_refuses_bad_arguments_naming_them(tmp_path, capsys):
    import evaluate

    (tmp_path / "bf16").mkdir()
    (tmp_path / "bf16" / "config.json").write_text("{}")
    ok = evaluate.parse_args(["--checkpoint", str(tmp_path), "--formats", "bf16", "--speculative", "3-1-4"])
    assert ok.speculative == ["3-1-4"] and ok.num_questions == 200
    for argv, field in ((["--formats", "fp8"], "holds no checkpoint"), (["--speculative", "3-1"], "--speculative"),
                        (["--speculative", "0-1-2"], "--speculative"), (["--num-questions", "201"], "--num-questions")):
        with pytest.raises(SystemExit):
            evaluate.parse_args(["--checkpoint", str(tmp_path), "--formats", "bf16", *argv])
        assert field in capsys.readouterr().err
    # The tool-call and JSON requests are fixed (the same questions every run) and ask what the tools answer.
    assert evaluate.tool_requests(6) == evaluate.tool_requests(6)
    assert evaluate.json_requests(4) == evaluate.json_requests(4)
    assert {name for _, name, _ in evaluate.tool_requests(30)} == {t["function"]["name"] for t in data.TOOLS}


def test_train_command_stops_at_time_limit_then_evaluates_and_exports(tmp_path):
    """The command line end to end: --max-minutes 0 stops after the first step, which is still evaluated on held-out
    questions and exported in both formats, and the history is written."""
    log_file = tmp_path / "log.json"
    train.main(["--steps", "50", "--batch-size", "1", "--seq-len", "32", "--vocab-size", "400", "--max-minutes", "0",
                "--eval-gsm8k", "1", "--eval-mmlu", "2", "--out", str(tmp_path / "out"), "--log-file", str(log_file)])
    log = json.loads(log_file.read_text())
    assert len(log["loss"]) == 1 and [e[0] for e in log["eval"]] == [0]
    for name in ("bf16", "fp8"):
        files = os.listdir(tmp_path / "out" / name)
        assert {"config.json", "tokenizer.json", "tokenizer_config.json"} <= set(files)
