"""One rank of a multi-rank engine (CPU over gloo; GPUs over NCCL, one per rank), run by test_tensor_parallel.py as a
separate process:

    python tp_worker.py SPEC_JSON RANK

SPEC: {"init_method", "engine": Engine kwargs, "prompts": [[ids]], "new_tokens", "out", optional "logprob_tail": n
(run the prompts one after another, logprobs of their last n tokens), optional "update_from": a checkpoint (then
the weights are updated from it and the prompts run again, "disk", then from the engine's own checkpoint's tensors,
"tensor")}; with the engine's expert_distribution_recorder_mode, the first requests' counts ("expert_counts"). Every
rank runs the same requests in one batch (the engine is deterministic, so every rank schedules alike) and writes its
outputs, weight bytes and DP static rounds to OUT.RANK as JSON. With DP attention "prompts" holds one list per DP
group: each group runs its own.
"""

from __future__ import annotations

import json
import sys


def main() -> None:
    spec = json.load(open(sys.argv[1]))
    rank = int(sys.argv[2])
    import sglang
    from sglang.srt.distributed.parallel_state import destroy_parallel_state, get_parallel_state
    from sglang.srt.managers.scheduler_process import join_ranks
    from sglang.srt.server_args import ServerArgs

    kwargs = spec["engine"]
    join_ranks(ServerArgs(**kwargs, dist_timeout=120), rank, spec["init_method"])  # gloo on CPU, NCCL on GPUs
    state = get_parallel_state()
    eng = sglang.Engine(**kwargs)
    sampling = {"temperature": 0, "max_new_tokens": spec["new_tokens"], "ignore_eos": True}
    prompts = spec["prompts"][state.dp_rank] if kwargs.get("enable_dp_attention") else spec["prompts"]
    recording = bool(kwargs.get("expert_distribution_recorder_mode"))
    if recording:  # the first requests' expert counts on this rank
        eng.start_expert_distribution_record()
    if spec.get("logprob_tail"):  # one request after another (the prefix cache's case), logprobs of the tail only
        outs = [eng.generate(input_ids=p, return_logprob=True, logprob_start_len=len(p) - spec["logprob_tail"],
                             sampling_params=sampling) for p in prompts]
    else:
        outs = eng.generate(input_ids=prompts, return_logprob=True, logprob_start_len=0, sampling_params=sampling)
    updated = {}
    if recording:
        from sglang.srt.eplb.expert_distribution import get_expert_distribution_recorder

        eng.stop_expert_distribution_record()
        updated["expert_counts"] = get_expert_distribution_recorder().frozen.tolist()
    if spec.get("update_from"):  # weight updates: another checkpoint from disk, then the first one's tensors
        import glob

        from safetensors.torch import load_file

        def run_again():
            return eng.generate(input_ids=prompts, return_logprob=True, logprob_start_len=0, sampling_params=sampling)

        assert eng.update_weights_from_disk(spec["update_from"])[0]
        updated["disk"] = run_again()
        tensors = [item for f in sorted(glob.glob(f"{kwargs['model_path']}/*.safetensors"))
                   for item in load_file(f).items()]
        assert eng.update_weights_from_tensor(tensors)[0]  # whole tensors: each rank takes its part
        updated["tensor"] = run_again()
    weight_bytes = eng.model_runner.weight_bytes
    from sglang.srt.distributed.dp_attention import get_dp_attention

    static_rounds = get_dp_attention().num_static_rounds
    eng.shutdown()
    destroy_parallel_state()
    with open(f"{spec['out']}.{rank}", "w") as f:
        json.dump({"outputs": outs, "weight_bytes": weight_bytes, "static_rounds": static_rounds, **updated}, f)


if __name__ == "__main__":
    main()
