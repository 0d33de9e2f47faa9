"""int64 CPU tensors from Python int lists, for the per-step index arrays the scheduler sends to the device.

`torch.tensor(list)` converts element by element through Python objects: 0.5 ms (1.1 without a dtype) for the 8,192
ints of one prefill chunk on the CI machine, while an extend step's first kernel waits for it. `array.array("q")`
converts in C and `torch.frombuffer` shares its memory: 0.13 ms.
"""

from __future__ import annotations

import array

import torch


def int64_tensor(values) -> torch.Tensor:
    """A CPU int64 tensor of `values` (Python ints; a list, range or tuple). Raises OverflowError past int64."""
    if not values:
        return torch.empty(0, dtype=torch.int64)
    return torch.frombuffer(array.array("q", values), dtype=torch.int64)
