"""bench_one_batch's own prefill: prompts longer than the chunk budget go in chunks, and nothing is taken from the
prefix cache (prompts of two lengths drawn from one seed share their first tokens), so what it decodes afterwards is
what the engine's own path gives for the same prompts."""

import torch

import sglang
from sglang.bench_one_batch import prefill


def _prompts(vocab: int, batch: int, input_len: int, seed: int) -> list:
    g = torch.Generator().manual_seed(seed)  # bench_one_batch.prefill's draw
    return [torch.randint(2, vocab, (input_len,), generator=g).tolist() for _ in range(batch)]


def test_long_prompts_in_chunks_and_no_prefix_reuse(monkeypatch):
    eng = sglang.Engine(model_path="tiny-deepseek-v4", device="cpu", log_level="warning", max_running_requests=4,
                        max_total_tokens=4096, chunked_prefill_size=128)
    try:
        sched = eng.scheduler
        vocab = eng.model_runner.model_config.vocab_size
        page = sched.allocator.page_size
        prefill(eng, 1, page + 40, 2, seed=0)  # its first page enters the prefix cache when it finishes
        while sched.running:
            sched.step()
        forwards = []
        run_batch = sched.run_batch
        monkeypatch.setattr(sched, "run_batch", lambda b: forwards.append(list(b.extend_lens)) or run_batch(b))
        n = 2 * page + 10  # the first page as above, then longer than the chunk budget
        prefill(eng, 2, n, 3, seed=0)
        monkeypatch.setattr(sched, "run_batch", run_batch)
        reqs = list(sched.running)
        assert [r.num_computed for r in reqs] == [n, n] and [r.cached_tokens for r in reqs] == [0, 0]
        assert max(max(lens) for lens in forwards) <= 128 and sum(map(sum, forwards)) == 2 * n
        while sched.running:
            sched.step()
        outs = eng.generate(input_ids=_prompts(vocab, 2, n, 0),
                            sampling_params={"temperature": 0, "max_new_tokens": 3, "ignore_eos": True})
        assert [r.output_ids for r in reqs] == [o["output_ids"] for o in outs]
    finally:
        eng.shutdown()
