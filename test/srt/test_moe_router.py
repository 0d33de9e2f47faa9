"""The router (layers/moe/router.py) and the MoE's routing: the torch path is sgl_kernel.dsv4_router_ref op for op
and breaks selection ties toward the lower expert; on a GPU (simulated here: CPU tensors stand for the device's, the
kernel runs in the Triton interpreter) Gate.route is one kernel launch and no torch compute, with the MoE's
expert-parallel remapping and fused shared-expert column inside it; the MoE layer gives the same output either way,
with the expert-distribution recorder on too."""

from __future__ import annotations

import pytest
import torch
from torch.utils._python_dispatch import TorchDispatchMode, _disable_current_modes

from oracle import TINY
from sgl_kernel.dsv4_router import dsv4_router_ref
from sglang.srt import platform as plat
from sglang.srt.eplb import expert_distribution as ed
from sglang.srt.layers.moe.router import Gate

ALLOCATIONS = frozenset(("empty", "empty_strided", "zeros", "new_empty", "new_empty_strided"))


class _Launches(TorchDispatchMode):
    """The torch ops run inside the block (by name), and the Triton kernels launched (interpreted or compiled)."""

    def __init__(self, monkeypatch) -> None:
        super().__init__()
        self.torch_ops: list = []
        self.triton: list = []
        from triton.runtime import interpreter, jit

        for cls in (interpreter.InterpretedFunction, jit.JITFunction):
            real = cls.run

            def run(fn, *args, _real=real, **kwargs):
                self.triton.append(getattr(fn, "__name__", None) or fn.fn.__name__)
                with _disable_current_modes():  # the interpreter's own copies of the arguments are no launches
                    return _real(fn, *args, **kwargs)

            monkeypatch.setattr(cls, "run", run)

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        self.torch_ops.append(func.overloadpacket.__name__)
        return func(*args, **(kwargs or {}))

    def compute_ops(self) -> list:
        return [op for op in self.torch_ops if op not in ALLOCATIONS]


def _gate(use_hash: bool, experts: int = 10, hidden: int = 48, top_k: int = 3, seed: int = 0) -> Gate:
    g = torch.Generator().manual_seed(seed)
    gate = Gate(hidden, experts, top_k, 97, 1.5, use_hash)
    with torch.no_grad():
        gate.weight.copy_(torch.randn(experts, hidden, generator=g) * hidden ** -0.5 * 2)
        if use_hash:
            gate.tid2eid.copy_(torch.stack([torch.randperm(experts, generator=g)[:top_k] for _ in range(97)]))
        else:
            gate.bias.copy_(torch.randn(experts, generator=g) * 0.1)
    return gate


def _inputs(tokens: int, hidden: int = 48, seed: int = 1) -> tuple:
    g = torch.Generator().manual_seed(seed)
    return torch.randn(tokens, hidden, generator=g), torch.randint(0, 97, (tokens,), generator=g)


@pytest.mark.parametrize("use_hash", [False, True], ids=["score", "hash"])
@pytest.mark.parametrize("local,shared", [(None, None), (range(3, 8), None), (None, 10), (range(3, 8), 5)])
def test_torch_path_is_the_reference(use_hash, local, shared):
    gate, (x, input_ids) = _gate(use_hash), _inputs(9)
    with torch.no_grad():
        got = gate.route(x, input_ids, local, shared)
    want = dsv4_router_ref(x, gate.weight, None if use_hash else gate.bias, gate.tid2eid if use_hash else None,
                           input_ids if use_hash else None, 3, 1.5, local_experts=local, shared_expert_id=shared)
    assert torch.equal(got[1], want[1]) and torch.equal(got[0], want[0])


def test_torch_path_breaks_ties_toward_the_lower_expert():
    """Every expert's biased score equal: experts 0..k-1 in order, on the CPU path as in the kernel (torch.topk on
    the CPU returns other members of the tie)."""
    gate = _gate(False, experts=256, top_k=6)
    with torch.no_grad():
        gate.weight.zero_()
        gate.bias.zero_()
        weights, ids = gate(*_inputs(3))
    assert torch.equal(ids, torch.arange(6).expand(3, 6))
    torch.testing.assert_close(weights, torch.full((3, 6), 1.5 / 6))


@pytest.mark.parametrize("use_hash", [False, True], ids=["score", "hash"])
def test_gpu_path_is_one_launch(use_hash, monkeypatch):
    """Simulated GPU: the gate, the remapping and the shared column are one Triton launch and no torch op beyond
    allocating the outputs (the torch path: ~20 ops, at decode each a kernel); the same routes as the CPU path."""
    gate, (x, input_ids) = _gate(use_hash), _inputs(5)
    with torch.no_grad():
        want = gate.route(x, input_ids, range(3, 8), 5)
        with plat.simulate_platform("cuda"):
            gate.route(x, input_ids, range(3, 8), 5)  # the counters allocated once
            with _Launches(monkeypatch) as launches:
                got = gate.route(x, input_ids, range(3, 8), 5)
    assert launches.triton == ["_router_kernel"] and launches.compute_ops() == [], launches.torch_ops
    assert torch.equal(got[1], want[1])
    torch.testing.assert_close(got[0], want[0], rtol=2e-6, atol=2e-6)
    with torch.no_grad(), _Launches(monkeypatch) as torch_path:
        gate.route(x, input_ids, range(3, 8), 5)
    assert torch_path.triton == [] and len(torch_path.compute_ops()) >= 15


def test_gpu_path_above_the_fused_rows_is_torch(monkeypatch):
    """Past FUSED_MAX_ROWS rows (prefill, large decode batches) the GPU takes the torch path, where a GEMM is
    faster than the one-launch kernel; the same routes."""
    from sglang.srt.layers.moe.router import FUSED_MAX_ROWS

    gate, (x, input_ids) = _gate(False), _inputs(FUSED_MAX_ROWS + 1)
    with torch.no_grad():
        want = gate.route(x, input_ids, range(3, 8), 5)
        with plat.simulate_platform("cuda"), _Launches(monkeypatch) as launches:
            got = gate.route(x, input_ids, range(3, 8), 5)
    assert launches.triton == [] and len(launches.compute_ops()) >= 15
    assert torch.equal(got[1], want[1]) and torch.equal(got[0], want[0])


def _tiny_moe(layer_id: int):
    from sglang.srt.configs.deepseek_v4 import DeepseekV4Config
    from sglang.srt.models.deepseek_v4 import MoE

    config = DeepseekV4Config.from_dict(TINY)
    torch.manual_seed(layer_id)
    moe = MoE(config, layer_id)
    with torch.no_grad():
        for p in moe.parameters():
            p.normal_(0, 0.2)
        if moe.gate.use_hash:
            moe.gate.tid2eid.copy_(torch.randint(0, config.n_routed_experts, moe.gate.tid2eid.shape))
    return moe, config


@pytest.mark.parametrize("layer_id", [0, 2], ids=["hash", "score"])
@pytest.mark.parametrize("fused", [False, True], ids=["shared-beside", "shared-fused"])
def test_moe_routes_alike_on_both_paths(layer_id, fused, monkeypatch):
    """The MoE layer on the simulated GPU (the gate's one launch, with the shared expert's column when fused) equals
    it on the CPU's torch path; with the expert-distribution recorder on, the same output and the global choices
    counted. Without the recorder the shared expert's column comes from the kernel (one launch for the routing)."""
    from sglang.srt.layers.moe import router

    moe, config = _tiny_moe(layer_id)
    if fused:
        moe.fuse_shared_experts()
    x, ids = torch.randn(5, config.hidden_size) * 2, torch.randint(0, config.vocab_size, (5,))
    kernel, calls = router._fused_kernel(), []
    monkeypatch.setattr(router, "_fused_kernel", lambda: lambda *a, **k: calls.append(k) or kernel(*a, **k))
    with torch.no_grad():
        want = moe(x, ids)
        with plat.simulate_platform("cuda"):
            got = moe(x, ids)
            recorder = ed.ExpertDistributionRecorder(config.num_hidden_layers, config.n_routed_experts, "cpu")
            monkeypatch.setattr(ed, "_RECORDER", recorder)
            recorded = moe(x, ids)
    for out in (got, recorded):  # the simulated GPU's experts run another path (its sums in another order)
        assert ((out - want).norm() / want.norm()).item() < 1e-5
    assert recorder.counts[layer_id].sum() == 5 * config.num_experts_per_tok
    shared = config.n_routed_experts if fused else None
    assert [c["shared_expert_id"] for c in calls] == [shared, None]  # the recorder's path appends it in torch
