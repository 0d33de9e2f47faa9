"""DeepseekV4MultiStepBackend: one attention backend per speculative draft step.

The draft steps of a decode cycle run back to back (under CUDA graphs, in one replay), so the metadata of every step
is prepared before the first one runs: step i's rows sit at positions c+i-2 of each request. Each step gets its own
backend instance (sharing the pools and the pooled indexer-logits block), so one step's metadata can never be
overwritten by the next.
"""

from __future__ import annotations


class DeepseekV4MultiStepBackend:
    def __init__(self, base_backend, num_steps: int) -> None:
        cls = type(base_backend)
        self.backends = [cls(base_backend.config, base_backend.pool, base_backend.allocator, base_backend.page_size,
                             base_backend.num_draft_tokens, logits_workspace=base_backend.logits_workspace)
                         for _ in range(num_steps)]

    def init_forward_metadata(self, step_batches: list, runner) -> None:
        """Attach pools and build the metadata of every step (all of them, the last included), each step with its
        own backend."""
        if len(step_batches) > len(self.backends):
            raise ValueError(f"{len(step_batches)} draft steps for {len(self.backends)} step backends")
        for backend, forward_batch in zip(self.backends, step_batches):
            runner.attach(forward_batch, backend)
