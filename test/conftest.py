"""Shared pytest setup: one intra-op thread on CPU (OpenMP fork-join costs more than it saves on small
shapes and small VMs: index_add_ went from 0.006 ms to 58 ms with 2 threads on the 2-core CI machine)."""

import torch

torch.set_num_threads(1)


def pytest_configure(config):
    config.addinivalue_line("markers", "gpu: needs a CUDA GPU (run through the device tool); skipped, never faked, "
                                       "on CPU machines")
