"""Cost of a mixed prefill + decode step against pure decode and pure prefill steps (scheduler steps, synchronous).

B requests decode (prompt P); then M new prompts of P tokens arrive, so each step carries the B decode rows plus a
prefill chunk (--chunked-prefill-size minus B tokens); then, with nothing decoding, the same prompts prefill alone.
Each step is timed with a device synchronisation; the mixed step is also profiled (top GPU kernels).

    python benchmark/bench_mixed_step.py --model-path /tmp/w/base --dtype bfloat16 --decode 256 --prompt 1024
"""

from __future__ import annotations

import argparse
import json
import time

import torch


def _reqs(tag: str, n: int, prompt: int, vocab: int):
    from sglang.srt.managers.schedule_batch import Req
    from sglang.srt.sampling.sampling_params import SamplingParams

    g = torch.Generator().manual_seed(len(tag) * 1000 + n)
    return [Req(rid=f"{tag}{i}", origin_input_ids=torch.randint(10, vocab - 10, (prompt,), generator=g).tolist(),
                sampling_params=SamplingParams(max_new_tokens=256, temperature=0, ignore_eos=True))
            for i in range(n)]


def _timed_steps(sched, device, until) -> list:
    """(ms, new tokens) of each step until `until()` holds."""
    out = []
    while not until():
        before = sched.num_generated_tokens
        torch.cuda.synchronize(device) if device.type == "cuda" else None
        start = time.perf_counter()
        sched.step()
        torch.cuda.synchronize(device) if device.type == "cuda" else None
        out.append(((time.perf_counter() - start) * 1000, sched.num_generated_tokens - before))
    return out


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--model-path", required=True)
    ap.add_argument("--dtype", default="auto")
    ap.add_argument("--decode", type=int, default=256, help="requests decoding")
    ap.add_argument("--prompt", type=int, default=1024)
    ap.add_argument("--arrivals", type=int, default=64, help="prompts arriving while they decode")
    ap.add_argument("--chunk", type=int, default=8192)
    ap.add_argument("--out", default=None)
    args = ap.parse_args()

    import sglang
    from sglang.srt.utils.step_profile import profile_steps

    eng = sglang.Engine(model_path=args.model_path, dtype=args.dtype, log_level="warning",
                        max_running_requests=args.decode + args.arrivals, chunked_prefill_size=args.chunk,
                        disable_overlap_schedule=True)
    sched, device = eng.scheduler, torch.device(eng.model_runner.device)
    vocab = eng.model_runner.model_config.vocab_size
    decoders = _reqs("d", args.decode, args.prompt, vocab)
    for req in decoders:
        sched.add_request(req)
    _timed_steps(sched, device, lambda: all(len(r.output_ids) >= 4 for r in decoders))  # prefilled, warm
    decode = _timed_steps(sched, device, lambda: min(len(r.output_ids) for r in decoders) >= 24)
    arrivals = _reqs("a", args.arrivals, args.prompt, vocab)
    for req in arrivals:
        sched.add_request(req)
    mixed_profile = profile_steps(sched.step, 1, device)  # two steps: the profiler's warm-up and one recorded
    mixed = _timed_steps(sched, device, lambda: all(r.prefill_done for r in arrivals))
    for req in decoders + arrivals:
        sched.abort_request(req.rid)
    while sched.has_work():
        sched.step()
    alone = _reqs("p", args.arrivals, args.prompt, vocab)
    for req in alone:
        sched.add_request(req)
    prefill = _timed_steps(sched, device, lambda: all(r.prefill_done for r in alone))

    def row(name: str, steps: list, prefill_tokens: int) -> dict:
        ms = sum(t for t, _ in steps) / len(steps)
        return {"step": name, "steps": len(steps), "ms_per_step": round(ms, 2),
                "prefill_tok_s": round(prefill_tokens / (sum(t for t, _ in steps) / 1000)) if prefill_tokens else 0,
                "decode_tok_s": round(sum(n for _, n in steps) / (sum(t for t, _ in steps) / 1000))}

    mixed_prompt = args.arrivals * args.prompt - 2 * (args.chunk - args.decode)  # the profiled steps took two chunks
    rows = [row(f"decode bs {args.decode}", decode, 0), row(f"mixed: {args.decode} decode rows + chunk", mixed,
                                                            max(0, mixed_prompt)),
            row(f"prefill alone, chunk {args.chunk}", prefill, args.arrivals * args.prompt)]
    rows.append({"step": "mixed (profiled)", "profile": mixed_profile.columns(),
                 "top_kernels": [(n[:60], round(ms, 2), runs) for n, ms, runs in mixed_profile.top_kernels[:8]]})
    for r in rows:
        print(json.dumps(r))
    if args.out:
        with open(args.out, "a") as f:
            for r in rows:
                f.write(json.dumps(r) + "\n")
    eng.shutdown()


if __name__ == "__main__":
    main()
