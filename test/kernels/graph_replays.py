"""A CUDA-graph check shared by the GPU tests of chained (PDL) launches: the captured op, replayed with new inputs
copied into its live tensors before each replay, equals the same op launched plainly, bit for bit."""

from __future__ import annotations

import torch


def assert_replays_equal(run, plain, live: tuple, inputs, seeds) -> None:
    """run() captured once; per seed, inputs(seed) (tensors shaped as `live`) copied into `live`, the graph replayed
    and its output compared with plain() (eager, the same inputs)."""
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        out = run()
    for seed in seeds:
        for dst, src in zip(live, inputs(seed)):
            dst.copy_(src)
        graph.replay()
        assert torch.equal(out, plain()), seed
