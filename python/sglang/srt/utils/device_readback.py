"""Reading a device tensor back to the host without a stream-wide synchronisation.

A decode step reads the device once (the sampled tokens and their logprobs, packed into one tensor). On a GPU the
copy goes non_blocking into pinned memory and the host waits on an event recorded after it, so nothing else queued
on the device is waited for and `torch.cuda.set_sync_debug_mode("error")` stays quiet. `ReadBack(t)` issues the copy
and returns at once (overlap scheduling waits a step later); `read_back` waits right away.
"""

from __future__ import annotations

import torch


class ReadBack:
    """A copy of a device tensor to the host, under way; `wait()` gives its values as a list."""

    def __init__(self, t: torch.Tensor) -> None:
        self.done = None
        if t.device.type != "cuda":
            self.host = t
            return
        self.host = torch.empty(t.shape, dtype=t.dtype, pin_memory=True)
        self.host.copy_(t, non_blocking=True)
        self.done = torch.cuda.Event()
        self.done.record()

    def wait(self) -> list:
        if self.done is not None:
            self.done.synchronize()
        return self.host.tolist()


def read_back(t: torch.Tensor) -> list:
    return ReadBack(t).wait()
