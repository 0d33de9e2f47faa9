"""Shared pytest setup: one intra-op thread on CPU (OpenMP fork-join costs more than it saves on small
shapes and small VMs: index_add_ went from 0.006 ms to 58 ms with 2 threads on the 2-core CI machine)."""

import ctypes
import gc
import os

import pytest
import torch

torch.set_num_threads(1)
# Triton kernels run under the interpreter on machines without a GPU (the flag is read when kernels are defined,
# so it must be set before any sgl_kernel module is imported).
if not torch.cuda.is_available():
    os.environ.setdefault("TRITON_INTERPRET", "1")
# Profiles (this process's engines and the servers and ranks it starts) leave out Python stacks unless a test asks:
# on CPU exporting them took 40 to 90 s a trace, and no test reads them (test_scheduler_profiler checks the default).
os.environ.setdefault("SGLANG_PROFILE_WITH_STACK", "0")


def pytest_configure(config):
    config.addinivalue_line("markers", "gpu: needs a CUDA GPU (run through the device tool); skipped, never faked, "
                                       "on CPU machines")


@pytest.fixture(autouse=True, scope="module")
def _release_memory_between_modules():
    """After each module, collect its cyclic garbage (engines, schedulers and their pools sit in reference cycles
    that gc reaches only by chance) and hand freed heap back to the OS. Without it a worker's RSS climbed to 7 GB
    by the end of the suite, and with both workers and the servers tests start, a 24 GB CI machine ran out of
    memory: a server refused to start on 0.0 GB available."""
    yield
    gc.collect()
    try:
        ctypes.CDLL("libc.so.6").malloc_trim(0)
    except (OSError, AttributeError):  # not glibc (macOS, musl): nothing to trim
        pass
