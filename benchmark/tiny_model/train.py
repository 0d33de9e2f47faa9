"""Train the tiny DeepSeek-V4 on the synthetic corpus and export it in the native hub format.

    python benchmark/tiny_model/train.py --device cuda --steps 4000 --batch-size 32 --out tiny-v4
    python benchmark/tiny_model/train.py --device cpu --steps 500 --batch-size 4 --seq-len 192 --max-minutes 13 --out t

The main model is HF transformers' DeepseekV4ForCausalLM in train mode, the MTP layer model.MTPLayer trained on
the next-next token (loss weight --mtp-weight, 0.3 as DeepSeek's), the CSA layers' indexers on the attention's
distribution over the compressed entries (--indexer-weight; dense CSA for the first --indexer-warmup steps);
AdamW, linear warmup then cosine decay. Rows are packed documents of --seq-len tokens. Every --eval-every steps it
prints greedy accuracy on held-out GSM8K-style and MMLU-style questions (data/, the prompts the benchmark scripts
send). Writes <out>/bf16 (bf16 weights) and <out>/fp8 (FP8 linears, MXFP4 experts), each with config.json and
the tokenizer. Deterministic per device and seed; --max-minutes bounds a run by the clock (the learning rate then
anneals by whichever of --steps and --max-minutes ends first; the run evaluates and exports at its end).
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import math
import os
import sys
import time
from typing import Optional

import torch
import torch.nn.functional as F

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))

import data  # noqa: E402
import model as tiny  # noqa: E402
from tokenizer import DEFAULT_VOCAB, train_tokenizer  # noqa: E402

from sglang.srt.configs.deepseek_v4 import DeepseekV4Config  # noqa: E402
from sglang.srt.entrypoints.openai.encoding_dsv4 import EOS  # noqa: E402

TOKENIZER_DOCS = 4000  # documents the tokenizer learns its merges from
PAD_ID = 2  # tokenizer.SPECIAL[2]: fills a row's end, never a target
DENSE_TOPK = 1 << 20  # an index_topk past every compressed entry: CSA attends all of them (the indexer warm-up)


def build_tokenizer(seed: int, vocab_size: int = DEFAULT_VOCAB):
    corpus = data.Corpus(seed + 1)  # its own stream, so the tokenizer does not depend on the training order
    return train_tokenizer([corpus.document() for _ in range(TOKENIZER_DOCS)], vocab_size)


def packed_batch(corpus: data.Corpus, tok, batch_size: int, seq_len: int) -> torch.Tensor:
    """[batch_size, seq_len] ids: whole documents back to back, then PAD_ID to the end of the row. A document that
    does not fit the rest of a row starts the next one (a cut tool-call chat would never show its call: the
    tools block alone is most of it); only a document longer than a whole row is cut."""
    rows, carry = [], None
    for _ in range(batch_size):
        ids: list = []
        while True:
            doc, carry = (carry if carry is not None else tok.encode(corpus.document()).ids), None
            if len(ids) + len(doc) <= seq_len:
                ids += doc
            elif not ids:
                ids = doc[:seq_len]
                break
            else:
                carry = doc
                break
        rows.append(ids + [PAD_ID] * (seq_len - len(ids)))
    return torch.tensor(rows, dtype=torch.long)


def csa_layers(model) -> list:
    return [layer for layer in model.model.layers if layer.self_attn.layer_type == "compressed_sparse_attention"]


def forward_with_mtp(model, mtp, ids: torch.Tensor, rows: int, labels: Optional[torch.Tensor] = None) -> tuple:
    """(HF output, MTP logits [B, rows, V], indexer loss): the main model over `ids` and the MTP layer over rows
    p = 0..rows-1, each carrying (Hs_p, x_{p+1}) at position p; the HF output holds the next-token loss of `labels`
    (-100: no target) when given."""
    seen, hooks = {"attn": [], "scores": []}, []
    hooks.append(model.model.hc_head.register_forward_pre_hook(lambda m, args: seen.update(streams=args[0])))
    hooks.append(model.model.layers[0].register_forward_pre_hook(lambda m, a, kw: seen.update(kw=kw), with_kwargs=True))
    for layer in csa_layers(model):
        attn = layer.self_attn
        hooks.append(attn.register_forward_hook(lambda m, args, out: seen["attn"].append(out[1])))
        hooks.append(attn.compressor.indexer.scorer.register_forward_hook(
            lambda m, args, out: seen["scores"].append(out)))
    try:
        out = model(input_ids=ids, labels=labels, use_cache=False)
    finally:
        for h in hooks:
            h.remove()
    kw = seen["kw"]
    mask = kw["attention_mask"]
    if not isinstance(mask, torch.Tensor):
        raise RuntimeError(f"expected a tensor attention mask from the eager model, got {type(mask).__name__}")
    # The MTP rows sit at the main rows' positions, so the main model's mask and rotary tables, cut, are theirs.
    layer_kwargs = {
        "position_embeddings": {k: (c[:, :rows], s[:, :rows]) for k, (c, s) in kw["position_embeddings"].items()},
        "position_ids": kw["position_ids"][:, :rows], "attention_mask": mask[..., :rows, :rows],
        "past_key_values": None,
    }
    nxt = ids[:, 1:rows + 1]
    logits = mtp(seen["streams"][:, :rows], model.model.embed_tokens(nxt), nxt, layer_kwargs, model.lm_head)
    return out, logits, indexer_loss(seen["attn"], seen["scores"])


def indexer_loss(attn_weights: list, index_scores: list) -> torch.Tensor:
    """KL(attention || indexer) over the compressed entries each query attended, summed over the CSA layers.

    The indexer only picks entries (top-k), so the language-model loss gives it no gradient; as in DeepSeek's
    sparse attention training, its scores learn the distribution the attention heads (summed, renormalised) put on
    the compressed entries. With top-k at least the visible entries (the dense warm-up) that is every visible entry,
    later the selected ones only, so a pick is never reinforced just for having been picked.
    """
    total = attn_weights[0].new_zeros(()) if attn_weights else torch.zeros(())
    for probs, scores in zip(attn_weights, index_scores):  # [B, H, S, S + T], [B, S, T]
        t = scores.shape[-1]
        p = probs[..., probs.shape[-1] - t:].detach().float().sum(1)  # [B, S, T]
        seen = p > 0
        rows = seen.any(-1)  # queries with at least one compressed entry attended
        if not rows.any():
            continue
        p = p / p.sum(-1, keepdim=True).clamp_min(1e-30)
        log_q = torch.log_softmax(scores.float().masked_fill(~seen, float("-inf")), dim=-1)
        kl = torch.where(seen, p * (torch.log(p.clamp_min(1e-30)) - log_q), torch.zeros_like(p)).sum(-1)
        total = total + kl[rows].mean()
    return total


def set_index_topk(model, topk: int) -> None:
    for layer in csa_layers(model):
        layer.self_attn.compressor.indexer.index_topk = topk


def losses(model, mtp, ids: torch.Tensor) -> tuple:
    """(main next-token loss, MTP next-next-token loss, indexer loss) of one batch."""
    t = ids.shape[1] - 2  # rows p = 0..S-3 have a next-next token x_{p+2}
    labels = ids.masked_fill(ids == PAD_ID, -100)  # padding is never a target (it only follows real tokens)
    out, logits, index = forward_with_mtp(model, mtp, ids, t, labels)
    return out.loss, F.cross_entropy(logits.float().flatten(0, 1), labels[:, 2:].flatten(), ignore_index=-100), index


# ---- held-out greedy eval ------------------------------------------------------------------------
@torch.no_grad()
def greedy(model, tok, prompt: str, max_new: int, stop: tuple = ()) -> str:
    """Greedy completion of `prompt` through HF's own cache, cut at the first of `stop`."""
    from transformers import DynamicCache

    device = next(model.parameters()).device
    cache = DynamicCache(config=model.config)
    step = torch.tensor([tok.encode(prompt).ids], device=device)
    new: list = []
    for _ in range(max_new):
        nxt = int(model(input_ids=step, past_key_values=cache, use_cache=True).logits[0, -1].argmax())
        if nxt == tok.token_to_id(EOS):
            break
        new.append(nxt)
        if any(s in tok.decode(new) for s in stop):
            break
        step = torch.tensor([[nxt]], device=device)
    text = tok.decode(new)
    for s in stop:
        text = text.split(s)[0]
    return text


@dataclasses.dataclass
class EvalResult:
    gsm8k: float
    mmlu: float
    samples: list  # (prompt tail, completion) pairs


def evaluate(model, tok, n_gsm8k: int = 8, n_mmlu: int = 16, shots: int = 5) -> EvalResult:
    was_training = model.training
    model.eval()
    set_index_topk(model, model.config.index_topk)  # as served, also during the dense warm-up
    try:
        lines = data.GSM8K.load_lines(data.GSM8K_TEST)
        prompts, questions = data.GSM8K.build_prompts(lines, 5, n_gsm8k, shots)
        right, samples = 0, []
        for prompt, q in zip(prompts, questions):
            text = greedy(model, tok, prompt, 48, tuple(data.GSM8K.STOP))
            pred = data.GSM8K.extract_answer(text)
            right += data.GSM8K.same_number(pred, data.GSM8K.label_of(q["answer"]))
            samples.append((q["question"][-60:], text))
        gsm = right / max(n_gsm8k, 1)
        right = total = 0
        for subject in data.MMLU_SUBJECTS:
            dev = data.MMLU.read_csv(os.path.join(data.MMLU_DIR, "dev", f"{subject}_dev.csv"))
            test = data.MMLU.read_csv(os.path.join(data.MMLU_DIR, "test", f"{subject}_test.csv"))
            for row in test[: n_mmlu // len(data.MMLU_SUBJECTS)]:
                prompt = data.MMLU.subject_header(subject, dev, shots) + data.MMLU.format_example(row, False)
                right += data.MMLU.extract_choice(greedy(model, tok, prompt, 1)) == row[5]
                total += 1
        return EvalResult(gsm, right / max(total, 1), samples)
    finally:
        model.train(was_training)


# ---- training ------------------------------------------------------------------------------------
def lr_at(step: int, args, elapsed_s: float = 0.0) -> float:
    """Linear warm-up, then cosine decay to a tenth over what is left of the run: of --steps, or of --max-minutes
    where that ends first (a run bounded by time still anneals)."""
    if step < args.warmup:
        return args.lr * (step + 1) / args.warmup
    frac = (step - args.warmup) / max(args.steps - args.warmup, 1)
    if args.max_minutes:
        frac = max(frac, elapsed_s / (60 * args.max_minutes))
    return args.lr * (0.1 + 0.9 * 0.5 * (1 + math.cos(math.pi * min(frac, 1.0))))


def train(args) -> dict:
    """Train per `args`; returns {"loss": [(step, main, mtp, indexer)], "eval": [(step, gsm8k, mmlu)],
    "config": the native config}."""
    torch.manual_seed(args.seed)
    if args.device == "cpu":
        torch.use_deterministic_algorithms(True)
    tok = build_tokenizer(args.seed, args.vocab_size)
    config = tiny.model_config(tok.get_vocab_size())
    model, mtp = tiny.build(config, args.seed, args.device)
    params = list(model.parameters()) + list(mtp.parameters())
    opt = torch.optim.AdamW(params, lr=args.lr, betas=(0.9, 0.95), weight_decay=0.01)
    corpus = data.Corpus(args.seed)
    autocast = torch.autocast("cuda", dtype=torch.bfloat16, enabled=args.bf16 and args.device.startswith("cuda"))
    log = {"loss": [], "eval": [], "config": config}
    start = time.time()
    for step in range(args.steps):
        ids = packed_batch(corpus, tok, args.batch_size, args.seq_len).to(args.device)
        lr = lr_at(step, args, time.time() - start)
        for group in opt.param_groups:
            group["lr"] = lr
        set_index_topk(model, DENSE_TOPK if step < args.indexer_warmup else config["index_topk"])
        with autocast:
            main, nextn, index = losses(model, mtp, ids)
        loss = main + args.mtp_weight * nextn + args.indexer_weight * index
        opt.zero_grad(set_to_none=True)
        loss.backward()
        torch.nn.utils.clip_grad_norm_(params, 1.0)
        opt.step()
        log["loss"].append((step, main.item(), nextn.item(), index.item()))
        if step % args.log_every == 0 or step == args.steps - 1:
            print(f"step {step:5d}  loss {main.item():.4f}  mtp {nextn.item():.4f}  indexer {index.item():.4f}  "
                  f"lr {lr:.2e}  {time.time() - start:.0f}s", flush=True)
        out_of_time = args.max_minutes is not None and time.time() - start > 60 * args.max_minutes
        if out_of_time:
            print(f"stopping after step {step}: --max-minutes {args.max_minutes} reached", flush=True)
        if args.eval_every and (step + 1) % args.eval_every == 0 or step == args.steps - 1 or out_of_time:
            ev = evaluate(model, tok, args.eval_gsm8k, args.eval_mmlu)
            log["eval"].append((step, ev.gsm8k, ev.mmlu))
            print(f"  eval @ {step + 1}: gsm8k {ev.gsm8k:.3f}  mmlu {ev.mmlu:.3f}  e.g. "
                  f"{ev.samples[0][1] if ev.samples else None!r}",
                  flush=True)
        if out_of_time:
            break
    set_index_topk(model, config["index_topk"])
    if args.out:
        export(args.out, model, mtp, config, tok)
    return log


def export(out: str, model, mtp, config: dict, tok) -> None:
    state = tiny.native_state(model, mtp, DeepseekV4Config.from_dict(config))
    for name, quantize in (("bf16", False), ("fp8", True)):
        path = tiny.write_checkpoint(os.path.join(out, name), config, state, quantize, tok)
        size = sum(os.path.getsize(os.path.join(path, f)) for f in os.listdir(path))
        print(f"wrote {path} ({size / 1e6:.1f} MB)")


def parse_args(argv: Optional[list] = None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--device", default="cpu", help="cpu or cuda[:N]")
    p.add_argument("--steps", type=int, default=3000)
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--out", default=None, help="directory for bf16/ and fp8/ checkpoints (none: not exported)")
    p.add_argument("--batch-size", type=int, default=16)
    p.add_argument("--seq-len", type=int, default=512)
    p.add_argument("--lr", type=float, default=2e-3)
    p.add_argument("--warmup", type=int, default=100)
    p.add_argument("--mtp-weight", type=float, default=0.3)
    p.add_argument("--indexer-weight", type=float, default=0.1, help="weight of the indexer's KL loss")
    p.add_argument("--indexer-warmup", type=int, default=200,
                   help="first steps with dense CSA attention (every compressed entry), training the indexer on all")
    p.add_argument("--vocab-size", type=int, default=DEFAULT_VOCAB, help="BPE merges target (before the markers)")
    p.add_argument("--bf16", action="store_true", help="bf16 autocast on CUDA (weights and optimizer stay fp32)")
    p.add_argument("--log-every", type=int, default=10)
    p.add_argument("--eval-every", type=int, default=250, help="0: only at the end")
    p.add_argument("--eval-gsm8k", type=int, default=8, help="held-out GSM8K-style questions per eval")
    p.add_argument("--eval-mmlu", type=int, default=16, help="held-out MMLU-style questions per eval")
    p.add_argument("--max-minutes", type=float, default=None,
                   help="stop training after this long, then evaluate and export as after the last step")
    p.add_argument("--log-file", default=None, help="write the loss and eval history as JSON")
    args = p.parse_args(argv)
    if args.steps < 1 or args.batch_size < 1 or args.seq_len < 8:
        p.error("--steps and --batch-size must be >= 1 and --seq-len >= 8")
    return args


def main(argv: Optional[list] = None) -> None:
    args = parse_args(argv)
    log = train(args)
    if args.log_file:
        with open(args.log_file, "w") as f:
            json.dump(log, f)


if __name__ == "__main__":
    main()
