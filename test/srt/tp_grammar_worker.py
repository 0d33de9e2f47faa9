"""One rank of a multi-rank engine serving constrained requests, run by test_grammar_queue.py as a separate process:

    python tp_grammar_worker.py SPEC_JSON RANK

SPEC: {"init_method", "engine": Engine kwargs, "out"}. Every rank (every DP group) queues the same requests: a plain
one, a regex one, one whose regex does not compile and a slow one, and the ranks' compiles are made to disagree: rank
1 compiles the regex a second after the others, rank 0 holds the slow grammar's compile past its deadline (rank 1's
ends at once). Each rank writes, per request, its output, finish reason and the step at which it started running, to
OUT.RANK as JSON: every rank must have made the same decisions at the same steps.
"""

from __future__ import annotations

import json
import sys
import threading
import time

REGEX = r"(yes|no) [0-9]{2}!"
SLOW = r"slow[0-9]{3}"


def main() -> None:
    spec = json.load(open(sys.argv[1]))
    rank = int(sys.argv[2])
    import sglang
    from sglang.srt.distributed.dp_attention import get_dp_attention
    from sglang.srt.distributed.parallel_state import destroy_parallel_state, get_parallel_state
    from sglang.srt.managers.schedule_batch import Req
    from sglang.srt.managers.scheduler_process import join_ranks
    from sglang.srt.sampling.sampling_params import SamplingParams
    from sglang.srt.server_args import ServerArgs

    kwargs = spec["engine"]
    join_ranks(ServerArgs(**kwargs, dist_timeout=120), rank, spec["init_method"])
    eng = sglang.Engine(**kwargs)
    sched = eng.scheduler
    backend, real_compile, held = sched._grammar(), None, threading.Event()
    real_compile = backend.compile
    leader = get_parallel_state().attn_tp.rank_in_group == 0

    def compile_(kind, text):
        if text == REGEX and not leader:
            time.sleep(1.0)  # this rank's compile ends after the leader has admitted the request
        if text == SLOW and leader:
            held.wait()  # the leader's compile outlives the deadline
        return real_compile(kind, text)

    backend.compile = compile_
    greedy = {"temperature": 0, "max_new_tokens": 10}
    reqs = [Req(rid=rid, origin_input_ids=ids, sampling_params=SamplingParams.from_dict({**greedy, **extra}))
            for rid, ids, extra in [("plain", [5, 6, 7], {"ignore_eos": True}), ("regex", [8, 9], {"regex": REGEX}),
                                    ("bad", [10, 11], {"regex": "(ab"}), ("slow", [12, 13], {"regex": SLOW})]]
    for req in reqs:
        sched.add_request(req)
    for job in sched.grammar_queue.jobs:
        if job.req.rid == "slow":
            job.deadline = 0.0  # past at once: only the leader's clock counts
    dp, started, step = get_dp_attention(), {}, 0
    while dp.any_rank(sched.has_work()) if dp.active else sched.has_work():
        if sched.has_work():
            sched.step()
            step += 1
        eng.model_runner.finish_dp_round()
        for req in reqs:
            if req in sched.running and req.rid not in started:
                started[req.rid] = step
    held.set()
    out = {r.rid: {"output_ids": r.output_ids, "finish": r.finished_reason.to_json(), "started": started.get(r.rid)}
           for r in reqs}
    eng.model_runner.token_allocator.check_all_free()
    eng.shutdown()
    destroy_parallel_state()
    with open(f"{spec['out']}.{rank}", "w") as f:
        json.dump(out, f)


if __name__ == "__main__":
    main()
