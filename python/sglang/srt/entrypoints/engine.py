"""sglang.Engine: the offline API with SGLang's shape, running the scheduler in-process (or, with
launch_subprocess=True, in the server's scheduler process).

    engine = sglang.Engine(model_path="tiny-deepseek-v4", device="cpu", dtype="float32")
    out = engine.generate(prompt="Hello", sampling_params={"temperature": 0, "max_new_tokens": 8},
                          return_logprob=True, logprob_start_len=0)
    out["text"], out["output_ids"], out["meta_info"]["output_token_logprobs"]
    engine.shutdown()

Both modes shape outputs with managers/output_shaping.py and validate requests in Scheduler.add_request (a refused
request raises ValueError naming the problem), so they return the same dicts.
"""

from __future__ import annotations

import itertools
import logging
import time
from typing import Optional, Union

from sglang.srt.arg_groups.deepseek_v4_hook import resolve_server_args
from sglang.srt.distributed.dp_attention import get_dp_attention
from sglang.srt.managers.output_shaping import OutputState, output_text
from sglang.srt.managers.schedule_batch import Req
from sglang.srt.managers.scheduler import Scheduler
from sglang.srt.model_executor.model_runner import ModelRunner
from sglang.srt.sampling.sampling_params import SamplingParamError, SamplingParams
from sglang.srt.server_args import LOG_LEVELS, ServerArgs
from sglang.srt.utils.common import configure_logging
from sglang.srt.utils.hf_transformers_utils import load_tokenizer

logger = logging.getLogger(__name__)


class Engine:
    """`launch_subprocess=False` (default): the scheduler and model run in this process (what tests drive step by
    step). `launch_subprocess=True`: they run in a scheduler process, exactly as behind the HTTP server; that
    process is spawned and re-imports the calling script, so a script must create the Engine under
    `if __name__ == "__main__":`. Call `shutdown()` (or use `with`); at exit it runs by itself."""

    def __init__(self, launch_subprocess: bool = False, **kwargs) -> None:
        from sglang.srt.model_loader.model_path import resolve_model_path

        if kwargs.get("log_level", "info") in LOG_LEVELS:  # an invalid one is reported by resolve_server_args
            configure_logging(kwargs.get("log_level", "info"))  # first: resolving may generate the built-in model
        self.server_args = resolve_server_args(ServerArgs(**kwargs))
        logger.info("DeepSeek-V4 defaults applied: %s", ", ".join(self.server_args.applied_defaults) or "none")
        args = self.server_args
        self.tokenizer = load_tokenizer(args.tokenizer_path or resolve_model_path(args.model_path))
        self.model_runner = self.scheduler = self._remote = None
        if launch_subprocess:
            from sglang.srt.entrypoints.engine_subprocess import SubprocessScheduler

            self._remote = SubprocessScheduler(self.server_args, self.tokenizer)
        else:
            self.model_runner = ModelRunner(self.server_args)
            self.scheduler = Scheduler(self.model_runner, self.tokenizer)
        self._rid = itertools.count()

    # ---- generation ---------------------------------------------------------------------------------
    def generate(self, prompt: Union[str, list, None] = None, sampling_params: Union[dict, list, None] = None,
                 input_ids: Optional[list] = None, return_logprob: Union[bool, list] = False,
                 logprob_start_len: Union[int, list, None] = None,
                 top_logprobs_num: Union[int, list, None] = None) -> Union[dict, list]:
        """One request (prompt str or input_ids list of ints) or a batch (lists); returns dict(s) with
        `text`, `output_ids` and `meta_info` as SGLang does."""
        if (prompt is None) == (input_ids is None):
            raise ValueError("give exactly one of 'prompt' or 'input_ids'")
        single = isinstance(prompt, str) or (input_ids is not None and (not input_ids or isinstance(input_ids[0], int)))
        prompts = [prompt] if isinstance(prompt, str) else prompt
        ids_list = [input_ids] if single and input_ids is not None else input_ids
        n = len(prompts if prompts is not None else ids_list)

        def per_req(value, i):
            return value[i] if isinstance(value, list) else value

        reqs = []
        for i in range(n):
            ids = self._tokenize(prompts[i]) if prompts is not None else list(ids_list[i])
            start = per_req(logprob_start_len, i)
            reqs.append(Req(rid=str(next(self._rid)), origin_input_ids=ids,
                            sampling_params=SamplingParams.from_dict(per_req(sampling_params, i)),
                            return_logprob=bool(per_req(return_logprob, i)),
                            logprob_start_len=-1 if start is None else start,
                            top_logprobs_num=per_req(top_logprobs_num, i) or 0))
        outputs = self._run(reqs)
        return outputs[0] if single else outputs

    def _tokenize(self, text: str) -> list:
        if self.tokenizer is None:
            raise ValueError("this checkpoint has no tokenizer.json: pass input_ids instead of a prompt")
        return self.tokenizer.encode(text).ids

    def _run(self, reqs: list) -> list:
        if self._remote is not None:
            return self._remote.run(reqs)
        start = time.perf_counter()
        added = []
        dp = get_dp_attention()
        try:
            for req in reqs:
                self.scheduler.add_request(req)
                added.append(req)
            if dp.active:  # every rank steps, in rounds, until every DP group's requests are done
                while dp.any_rank(self.scheduler.has_work()):
                    if self.scheduler.has_work():
                        self.scheduler.step()
                    self.model_runner.finish_dp_round()
            while any(not r.finished for r in reqs):
                self.scheduler.step()
        except BaseException:
            for req in added:  # never leak pool slots or queued requests, whatever failed
                if not req.finished:
                    self.scheduler.abort_request(req.rid)
            raise
        refused = next((r.finished_reason for r in reqs if r.finished_reason.param), None)
        if refused is not None:  # refused once queued (a grammar that does not compile): as refused at admission
            raise SamplingParamError(refused.param, refused.message)
        latency = time.perf_counter() - start
        return [self._output(r, latency) for r in reqs]

    def _output(self, req: Req, latency: float) -> dict:
        return OutputState.of_req(req).to_dict(output_text(self.tokenizer, req), latency)

    def flush_cache(self) -> bool:
        """Empty the prefix cache; False when refused because requests are running."""
        if self._remote is not None:
            return self._remote.flush_cache()
        return self.scheduler.flush_cache()

    def update_weights_from_disk(self, model_path: str, load_format: Optional[str] = None) -> tuple:
        """Load another checkpoint of the served model in place, as the server's /update_weights_from_disk (between
        generate calls: nothing runs then); returns (success, message). A refusal leaves the weights unchanged."""
        if load_format not in (None, "auto", "safetensors"):
            return False, f"load_format {load_format!r} is not supported (auto or safetensors)"
        try:
            if self._remote is not None:
                return True, self._remote.update_weights(model_path)
            return True, self.scheduler.update_weights_from_disk(model_path)
        except ValueError as e:
            return False, str(e)

    def update_weights_from_tensor(self, named_tensors: list, load_format: Optional[str] = None,
                                   flush_cache: bool = True) -> tuple:
        """Copy (checkpoint name, tensor) pairs into the served weights in place, as upstream's Engine method (RL loops:
        any subset of the checkpoint's tensors, whole; each rank takes its part); returns (success, message). The
        prefix cache is always emptied (its KV came from the old weights): flush_cache=False is refused."""
        if load_format not in (None, "auto"):
            return False, f"load_format {load_format!r} is not supported (tensors are taken as they are)"
        if not flush_cache:
            return False, "flush_cache=False is not supported: cached prefixes hold the old weights' KV"
        try:
            if self._remote is not None:
                return True, self._remote.update_tensors([(n, t.detach().cpu()) for n, t in named_tensors])
            return True, self.scheduler.update_weights_from_tensor(named_tensors)
        except (ValueError, TypeError) as e:
            return False, str(e)

    def get_weights_by_name(self, name: str, truncate_size: int = 100) -> list:
        """The first `truncate_size` rows of the weight loaded from checkpoint tensor `name` (as the server's
        /get_weights_by_name); ValueError for a name that maps to none."""
        if self._remote is not None:
            return self._remote.get_weights(name, truncate_size)
        return self.model_runner.get_weights_by_name(name, truncate_size)

    def start_expert_distribution_record(self) -> str:
        """Count the routed experts each MoE layer picks from now on (--expert-distribution-recorder-mode stat)."""
        return self._expert_distribution("start")

    def stop_expert_distribution_record(self) -> str:
        return self._expert_distribution("stop")

    def dump_expert_distribution_record(self) -> str:
        """Write the counts (SGLANG_EXPERT_DISTRIBUTION_RECORDER_DIR); returns the message naming the file."""
        return self._expert_distribution("dump")

    def _expert_distribution(self, action: str) -> str:
        from sglang.srt.eplb.expert_distribution import expert_distribution_action

        if self._remote is not None:
            return self._remote.expert_distribution(action)
        return expert_distribution_action(action)

    def start_profile(self, output_dir: Optional[str] = None, activities: Optional[list] = None,
                      num_steps: Optional[int] = None, with_stack: Optional[bool] = None,
                      record_shapes: Optional[bool] = None, profile_prefix: Optional[str] = None) -> str:
        """torch.profiler around the scheduler's steps until stop_profile() (or for num_steps steps), as the server's
        /start_profile (managers/scheduler_profiler.py); returns its message, raises ValueError when refused."""
        from sglang.srt.managers.scheduler_profiler import ProfileConfig

        config = ProfileConfig.make(output_dir, activities, num_steps, with_stack, record_shapes, profile_prefix)
        if self._remote is not None:
            return self._remote.profile(True, config)
        return self.scheduler.profiler.start(config)

    def stop_profile(self) -> str:
        """Stop the profile and write the trace(s); returns the message naming them."""
        if self._remote is not None:
            return self._remote.profile(False)
        return self.scheduler.profiler.stop()

    def shutdown(self) -> None:
        """Release the model and pools (and stop the scheduler process, if any). The CUDA graphs go first and
        explicitly: a rank's destroy_parallel_state() afterwards hangs while a graph holding NCCL kernels lives."""
        if self._remote is not None:
            self._remote.shutdown()
            self._remote = None
        if self.model_runner is not None and self.model_runner.graph_runner is not None:
            self.model_runner.graph_runner.release()
        if self.model_runner is not None and self.model_runner.token_allocator is not None:
            self.model_runner.token_allocator.close()  # the file tier's queued writes land first
        self.scheduler = None
        self.model_runner = None

    def __enter__(self) -> "Engine":
        return self

    def __exit__(self, *exc) -> None:
        self.shutdown()
