"""read_back: the values of a device tensor on the host, as a list, without a stream-wide synchronisation.

A decode step reads the device once (the sampled tokens and their logprobs, packed into one tensor). On a GPU the
copy goes non_blocking into pinned memory and the host waits on an event recorded after it, so nothing else queued
on the device is waited for and `torch.cuda.set_sync_debug_mode("error")` stays quiet.
"""

from __future__ import annotations

import torch


def read_back(t: torch.Tensor) -> list:
    if t.device.type != "cuda":
        return t.tolist()
    host = torch.empty(t.shape, dtype=t.dtype, pin_memory=True)
    host.copy_(t, non_blocking=True)
    done = torch.cuda.Event()
    done.record()
    done.synchronize()
    return host.tolist()
