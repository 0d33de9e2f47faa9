"""Speculative cycles on the static path (what EagleCudaGraphRunner captures; eager on CPU), fp32: outputs equal the
eager cycles (--disable-cuda-graph) token for token and logprob for logprob: padded batches (3 in a bucket of 4),
every bucket boundary, batches above the largest bucket (eager), requests joining and finishing between cycles,
staging rings and HCA windows completed inside verify rows; batches holding a sampled request run the eager cycle;
a static cycle reads the device once."""

from __future__ import annotations

import pytest

from oracle import engine
from test_static_decode import _assert_same, _run, _workload

WORKLOADS = {"tiny": ([5, 23, 40], [37, 9, 20, 3, 28]), "hca128": ([120, 250, 7], [20, 12, 30])}


def _spec_engine(name: str, **kwargs):
    return engine(name, speculative_algorithm="EAGLE", speculative_num_steps=3, max_running_requests=5, **kwargs)


def _record_sizes(eng) -> list:
    """Batch sizes of the cycles that ran on the static path."""
    runner, sizes = eng.model_runner.graph_runner, []
    real_forward = runner.forward
    runner.forward = lambda slots, last, *a: sizes.append(len(last)) or real_forward(slots, last, *a)
    return sizes


@pytest.mark.parametrize("name", list(WORKLOADS))
def test_static_cycles_equal_eager_cycles(name):
    from sglang.srt.speculative.eagle_cuda_graph_runner import EagleCudaGraphRunner

    ids, params = _workload(7, 5, *WORKLOADS[name], sampled=False)
    ref_eng = _spec_engine(name, disable_cuda_graph=True)
    assert ref_eng.model_runner.graph_runner is None
    ref = _run(ref_eng, ids, params)
    plain = _run(engine(name, max_running_requests=5), ids, params)
    assert [o["output_ids"] for o in ref] == [o["output_ids"] for o in plain]
    # buckets 1, 2, 4: five running requests exceed the largest (eager cycle), then 4, 3 (padded to 4), 2, 1
    eng = _spec_engine(name, cuda_graph_bs=[1, 2, 4])
    assert isinstance(eng.model_runner.graph_runner, EagleCudaGraphRunner)
    sizes = _record_sizes(eng)
    _assert_same(_run(eng, ids, params), ref)
    assert 3 in sizes and len(set(sizes)) >= 2 and max(sizes) <= 4  # a padded batch; a batch change
    assert eng.scheduler.mean_accept_length == ref_eng.scheduler.mean_accept_length
    eng.model_runner.token_allocator.check_all_free()


def test_sampled_requests_run_the_eager_cycle():
    ids, params = _workload(9, 4, [17, 33], [30, 12], sampled=True)  # odd requests sampled (seeded), shorter
    ref = _run(_spec_engine("tiny", disable_cuda_graph=True), ids, params)
    eng = _spec_engine("tiny", cuda_graph_bs=[1, 2, 4])
    sizes = _record_sizes(eng)
    _assert_same(_run(eng, ids, params), ref)
    assert sizes and max(sizes) <= 2  # only once the sampled requests finished: the two greedy ones
    eng.model_runner.token_allocator.check_all_free()
