"""Census of the kernels one decode step launches, per decoder layer and outside, with each kernel's call site.

    python benchmark/kernels/decode_census.py                      # tiny-deepseek-v4, batch 1, a table per layer kind
    python benchmark/kernels/decode_census.py --json census.json   # the same, written as JSON
    python benchmark/kernels/decode_census.py --sites 0            # totals only
    python benchmark/kernels/decode_census.py --device cuda --model-path /tmp/w/f12 --input-len 1024   # a real GPU
    python benchmark/kernels/decode_census.py --prefill --input-len 512   # the prefill forward of one prompt instead

Runs on a CPU: the engine starts under platform.simulate_platform("cuda", capability=(9, 0)), so every layer takes
its GPU code path (platform.is_device_tensor says yes for CPU tensors; sgl_kernel's Triton kernels run in the
interpreter) and the Triton attention backend. Then one prompt is prefilled and ONE decode step runs through the
static decode path (what a CUDA graph captures and replays on a GPU); only that captured forward is counted: the
page-table writes, the attention metadata of every layer, the layers, the HC head, norm and LM head. `--prefill`
counts the eager forward that prefills the prompt instead (its metadata, layers, head): every one of its launches is
a host launch on a GPU, where a prefill is not a graph.

What counts as a kernel (the rule):
- a Triton launch: every JITFunction / interpreter `run` (one grid launch);
- an aten op that reaches the dispatcher (a TorchDispatchMode sees it), except ops that launch nothing on a GPU:
  views and metadata-only ops (NO_KERNEL: view, slice, select, expand, transpose, split, ...), allocations (empty,
  empty_like, empty_strided, new_empty) and tensor construction from host data (lift_fresh). Every other op counts
  as one launch: copies (`_to_copy`, `copy_`, `clone`), fills (`fill_`, `zeros`, `full`), index ops, elementwise
  ops, reductions, GEMMs (`mm`, `addmm`, `linear`: one cuBLAS launch each; a GEMM cuBLAS splits counts once).
- an out-of-place op whose output is its input's memory (`x.to(x.dtype)`, `.contiguous()` of a contiguous tensor, a
  reshape that is a view) copied nothing: not counted.
- `_local_scalar_dense` (`.item()`, `bool(tensor)`) is a host read, not a kernel: listed apart (a captured step
  must have none).
Each kernel's call site is the innermost frame in python/sglang or sgl_kernel (file:line); kernels between two
decoder layers' forwards belong to "outside".

Layer kinds: SWA (compress ratio 0, window only), CSA (ratio 4, with the indexer), HCA (any other ratio); a "hash"
suffix marks the hash-routed layers (the first num_hash_layers).

Where a layer checks `x.is_cuda` itself instead of platform.is_device_tensor, the census makes CPU tensors answer
True for the run (`device_tensor_checks`), so those layers also take their GPU path.
"""

from __future__ import annotations

import argparse
import collections
import contextlib
import json
import os
import sys
from dataclasses import asdict, dataclass, field
from typing import Callable, Optional

import torch

if not torch.cuda.is_available():  # read when sgl_kernel's kernels are defined: set before any import of them
    os.environ.setdefault("TRITON_INTERPRET", "1")

from torch.utils._python_dispatch import TorchDispatchMode, _disable_current_modes  # noqa: E402

# aten ops that launch nothing on a GPU: views, metadata, allocations, host-data construction
NO_KERNEL = frozenset({
    "view", "_unsafe_view", "_reshape_alias", "reshape", "as_strided", "slice", "select", "split", "split_with_sizes",
    "unbind", "chunk", "narrow", "unsqueeze", "squeeze", "expand", "expand_as", "t", "transpose", "permute", "alias",
    "detach", "view_as", "unflatten", "flatten", "movedim", "diagonal", "real", "imag", "view_as_real",
    "view_as_complex", "_conj", "conj", "lift_fresh", "empty", "empty_like", "empty_strided", "new_empty",
    "new_empty_strided", "set_", "resize_", "_nested_tensor_size", "sym_size", "sym_stride", "sym_numel",
    "sym_storage_offset", "is_same_size", "dim", "size", "stride", "numel",
})
HOST_READS = frozenset({"_local_scalar_dense"})
OUTSIDE = "outside"
_ROOTS = (os.sep + os.path.join("python", "sglang") + os.sep, os.sep + "sgl_kernel" + os.sep)


def call_site() -> str:
    """file:line of the innermost frame in python/sglang or sgl_kernel (paths from that package's root)."""
    frame = sys._getframe(2)
    while frame is not None:
        path = frame.f_code.co_filename
        for root in _ROOTS:
            i = path.rfind(root)
            if i >= 0:
                return f"{path[i + 1:]}:{frame.f_lineno}"
        frame = frame.f_back
    return "?"


@dataclass
class Scope:
    """Kernels of one decoder layer (or of everything outside the layers)."""

    name: str
    kind: str
    torch_ops: int = 0
    triton: int = 0
    host_reads: int = 0
    by_site: dict = field(default_factory=collections.Counter)  # "op @ file:line" -> launches

    @property
    def total(self) -> int:
        return self.torch_ops + self.triton


class Census:
    """Counts launches into the current scope; `layer_scope` switches it."""

    def __init__(self) -> None:
        self.scopes = {OUTSIDE: Scope(OUTSIDE, OUTSIDE)}
        self.current = self.scopes[OUTSIDE]
        self.active = False

    def record(self, what: str, triton: bool, host_read: bool = False) -> None:
        scope = self.current
        if host_read:
            scope.host_reads += 1
        elif triton:
            scope.triton += 1
        else:
            scope.torch_ops += 1
        scope.by_site[f"{what} @ {call_site()}"] += 1

    @contextlib.contextmanager
    def layer_scope(self, name: str, kind: str):
        saved = self.current
        self.current = self.scopes.setdefault(name, Scope(name, kind))
        try:
            yield
        finally:
            self.current = saved

    @property
    def total(self) -> int:
        return sum(s.total for s in self.scopes.values())


class _AtenCensus(TorchDispatchMode):
    def __init__(self, census: Census) -> None:
        super().__init__()
        self.census = census

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        out = func(*args, **(kwargs or {}))
        name = func.overloadpacket.__name__
        if self.census.active and name not in NO_KERNEL and not _returns_input(name, args, out):
            self.census.record(name, triton=False, host_read=name in HOST_READS)
        return out


def _returns_input(name: str, args: tuple, out) -> bool:
    """An out-of-place op that hands back (a view of) its input's memory copied nothing: `x.to(x.dtype)`,
    `x.contiguous()` of a contiguous x, a reshape that is a view. In-place ops (`add_`) return their input too, but
    wrote it."""
    if name.endswith("_") or not isinstance(out, torch.Tensor) or out.numel() == 0:
        return False
    ptr = out.data_ptr()
    return any(isinstance(a, torch.Tensor) and a.numel() and a.data_ptr() == ptr for a in args)


@contextlib.contextmanager
def counting(census: Census):
    """Every aten op and Triton launch inside, recorded while `census.active`."""
    import triton.runtime.interpreter as interp
    import triton.runtime.jit as jit

    patched = []
    for cls in (jit.JITFunction, getattr(interp, "InterpretedFunction", None)):
        if cls is None or "run" not in vars(cls):
            continue
        real = vars(cls)["run"]

        def run(self, *args, _real=real, **kwargs):
            if census.active:
                census.record(getattr(self, "__name__", None) or self.fn.__name__, triton=True)
            with _disable_current_modes():  # the interpreter's own tensor copies are not launches
                return _real(self, *args, **kwargs)
        setattr(cls, "run", run)
        patched.append((cls, real))
    try:
        with _AtenCensus(census):
            yield census
    finally:
        for cls, real in patched:
            setattr(cls, "run", real)


@contextlib.contextmanager
def device_tensor_checks():
    """CPU tensors answer `is_cuda` True inside (simulation only): layers that test `x.is_cuda` directly, not
    through platform.is_device_tensor, take their GPU path like the others."""
    from sglang.srt import platform

    original = torch.Tensor.__dict__.get("is_cuda")
    base = torch._C.TensorBase.is_cuda
    torch.Tensor.is_cuda = property(lambda t: base.__get__(t) or platform.is_device_tensor(t))
    try:
        yield
    finally:
        if original is None:
            del torch.Tensor.is_cuda
        else:
            torch.Tensor.is_cuda = original


def layer_kind(config, layer_id: int) -> str:
    ratio = config.compress_ratio(layer_id)
    kind = "SWA" if ratio == 0 else "CSA" if ratio == 4 else "HCA"
    return kind + (" hash" if config.is_hash_layer(layer_id) else "")


def _hook_layers(model, census: Census) -> list:
    """Forward hooks that put each decoder layer's launches in its own scope."""
    handles, open_scopes = [], []
    for i, layer in enumerate(model.layers):
        def pre(_m, _a, _name=f"layer {i}", _kind=layer_kind(model.config, i)):
            open_scopes.append(census.layer_scope(_name, _kind))
            open_scopes[-1].__enter__()

        def post(_m, _a, _o):
            open_scopes.pop().__exit__(None, None, None)
        handles += [layer.register_forward_pre_hook(pre), layer.register_forward_hook(post)]
    return handles


@contextlib.contextmanager
def kept_quantized():
    """Simulation only: a quantized checkpoint's FP8 linears and MXFP4 experts kept as on a GPU (the CPU engine
    dequantizes them at load), their kernels interpreted: the launches a GPU's prefill of it makes."""
    import sglang.srt.model_loader.model_builder as model_builder

    saved = model_builder.fp8_linears_supported, model_builder.mxfp4_experts_supported
    model_builder.fp8_linears_supported = model_builder.mxfp4_experts_supported = lambda device: True
    try:
        yield
    finally:
        model_builder.fp8_linears_supported, model_builder.mxfp4_experts_supported = saved


def take_census(model_path: str = "tiny-deepseek-v4", input_len: int = 37, engine_kwargs: Optional[dict] = None,
                step: Optional[Callable] = None, device: str = "cpu", prefill_forward: bool = False,
                kept: bool = False) -> Census:
    """Start an engine on the simulated GPU (`device="cpu"`) or a real one (`"cuda"`: the checkpoint's kept formats
    and the GPU's own dispatch), prefill one prompt of `input_len` tokens, count one decode step (`prefill_forward`:
    count the prompt's prefill forward instead)."""
    import sglang
    from sglang.bench_one_batch import prefill
    from sglang.srt.platform import simulate_platform

    kwargs = dict(model_path=model_path, device=device, dtype="bfloat16", log_level="warning", max_running_requests=4,
                  max_total_tokens=4096, attention_backend="triton")
    kwargs.update(engine_kwargs or {})
    census = Census()
    simulated = device == "cpu"
    with (simulate_platform("cuda", capability=(9, 0)) if simulated else contextlib.nullcontext()), \
            (device_tensor_checks() if simulated else contextlib.nullcontext()), \
            (kept_quantized() if simulated and kept else contextlib.nullcontext()):
        engine = sglang.Engine(**kwargs)
        try:
            runner = engine.model_runner
            if prefill_forward:
                _count_prefill(engine, census, input_len)
                return census
            graphs = runner.graph_runner
            if graphs is None:
                raise RuntimeError("the census counts the static decode path: start the engine with CUDA graphs on")
            # two tokens: the prefill's and the counted step's (a longer request would take more decode forwards,
            # launched ahead under overlap scheduling, before the loop below has drained it)
            prefill(engine, 1, input_len, 2, seed=0)
            real_run = graphs._run_rows

            def counted_run(bs):
                census.active = True
                try:
                    return real_run(bs)
                finally:
                    census.active = False
            graphs._run_rows = counted_run
            # a captured graph would replay without passing through Python: run the same static path eagerly
            real_replay, graphs._replay = graphs._replay, counted_run
            handles = _hook_layers(runner.model, census)
            try:
                with counting(census):
                    (step or engine.scheduler.step)()
            finally:
                graphs._run_rows, graphs._replay = real_run, real_replay
                for h in handles:
                    h.remove()
            while engine.scheduler.running:
                engine.scheduler.step()
        finally:
            engine.shutdown()
    return census


def _count_prefill(engine, census: Census, input_len: int) -> None:
    """Count the eager forward (runner.forward) that prefills one prompt of `input_len` tokens."""
    from sglang.bench_one_batch import prefill

    runner = engine.model_runner
    real_forward = runner.forward

    def counted_forward(*args, **kwargs):
        census.active = True
        try:
            return real_forward(*args, **kwargs)
        finally:
            census.active = False
    runner.forward = counted_forward
    handles = _hook_layers(runner.model, census)
    try:
        with counting(census):
            prefill(engine, 1, input_len, 2, seed=0)
    finally:
        del runner.forward
        for h in handles:
            h.remove()
    while engine.scheduler.running:
        engine.scheduler.step()


def kinds(census: Census) -> dict:
    """kind -> the scopes of that kind, in layer order."""
    out = collections.defaultdict(list)
    for scope in census.scopes.values():
        out[scope.kind].append(scope)
    return dict(out)


def report(census: Census, sites: int = 40, what: str = "decode step, batch 1") -> list:
    """A row per scope, then per layer kind its kernels per layer and the call sites of its first layer."""
    lines = [f"{what}: {census.total} kernels ({sum(s.triton for s in census.scopes.values())} Triton)",
             f"{'scope':>10} | {'kind':>9} | kernels | torch | triton | host reads"]
    for s in census.scopes.values():
        lines.append(f"{s.name:>10} | {s.kind:>9} | {s.total:7d} | {s.torch_ops:5d} | {s.triton:6d} | {s.host_reads}")
    for kind, scopes in kinds(census).items():
        first = scopes[0]
        lines += ["", f"{kind}: {len(scopes)} scope(s), kernels {sorted({s.total for s in scopes})}; "
                      f"{first.name}: {first.total} ({first.torch_ops} torch, {first.triton} Triton)"]
        for site, n in sorted(first.by_site.items(), key=lambda kv: (-kv[1], kv[0]))[:sites]:
            lines.append(f"  {n:4d}  {site}")
    return lines


def to_json(census: Census) -> dict:
    return {"total": census.total,
            "scopes": [{**asdict(s), "total": s.total, "by_site": dict(s.by_site)} for s in census.scopes.values()]}


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--model-path", default="tiny-deepseek-v4")
    p.add_argument("--input-len", type=int, default=37, help="prompt tokens before the counted decode step")
    p.add_argument("--sites", type=int, default=40, help="call sites listed per layer kind")
    p.add_argument("--json", help="write the census here")
    p.add_argument("--device", default="cpu", choices=("cpu", "cuda"),
                   help="cpu: the GPU path simulated (interpreter); cuda: a real GPU, kept quantized formats")
    p.add_argument("--max-total-tokens", type=int, default=4096)
    p.add_argument("--prefill", action="store_true", help="count the prompt's prefill forward, not a decode step")
    p.add_argument("--kept", action="store_true",
                   help="cpu, a quantized checkpoint: keep its FP8 / MXFP4 weights as a GPU does (kernels interpreted)")
    args = p.parse_args()
    torch.set_num_threads(1)
    census = take_census(args.model_path, args.input_len, dict(max_total_tokens=args.max_total_tokens),
                         device=args.device, prefill_forward=args.prefill, kept=args.kept)
    what = f"prefill forward, {args.input_len} tokens" if args.prefill else "decode step, batch 1"
    print("\n".join(report(census, args.sites, what)))
    if args.json:
        with open(args.json, "w") as f:
            json.dump(to_json(census), f, indent=1)


if __name__ == "__main__":
    main()
