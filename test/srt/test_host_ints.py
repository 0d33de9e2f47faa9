"""utils/host_ints.int64_tensor: the tensor torch.tensor(values, dtype=torch.int64) gives, from a faster conversion."""

import pytest
import torch

from sglang.srt.utils.host_ints import int64_tensor


@pytest.mark.parametrize("values", [[], [7], [0, -1, 2**40, -(2**63), 2**63 - 1], list(range(5000, -3, -7)), range(9)])
def test_equals_torch_tensor(values):
    t = int64_tensor(values)
    assert t.dtype == torch.int64 and t.device.type == "cpu"
    assert torch.equal(t, torch.tensor(list(values), dtype=torch.int64))


def test_out_of_range_raises():
    with pytest.raises(OverflowError):
        int64_tensor([2**63])
