"""Test helper: record Python-level reads of tensors (.item(), .tolist(), bool(), int(), float(), index use), the
calls through which host code waits for the device, except inside an allowed read-back."""

from __future__ import annotations

import torch

HOST_READS = ("item", "tolist", "__bool__", "__int__", "__float__", "__index__")


class HostReadGuard:
    def __init__(self) -> None:
        self.reading = False
        self.reads = 0  # allowed read-backs
        self.violations: list = []  # names of the reads outside them
        self._real = {name: getattr(torch.Tensor, name) for name in HOST_READS}

    def install(self, m) -> None:
        """Guard every tensor read for the life of the monkeypatch (context) `m`."""
        for name in HOST_READS:
            m.setattr(torch.Tensor, name, self._guarded(name))

    def allowed(self, read):
        """`read` wrapped as the one allowed read-back: counted, and the tensor reads inside it are not violations."""
        def wrapper(*args, **kwargs):
            self.reads += 1
            self.reading = True
            try:
                return read(*args, **kwargs)
            finally:
                self.reading = False
        return wrapper

    def _guarded(self, name: str):
        real = self._real[name]

        def read(tensor, *args, **kwargs):
            if not self.reading:
                self.violations.append(name)
            return real(tensor, *args, **kwargs)
        return read
