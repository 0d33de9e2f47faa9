"""Find where two runs of one workload part: which scheduler step, which op, which pool rows (a debugging tool).

Two fresh engines of a test config (test/srt/oracle.py) run test_gpu_cuda_graph's workload, each side as
BACKEND:PATH with PATH one of
  replay   decode steps replay the captured CUDA graphs (recaptured with the recording below inside them);
  eager    the graphs are captured, then dropped: the same static decode path, run eagerly;
  general  --disable-cuda-graph: the general path (host-built metadata).
After every scheduler step both sides snapshot every pool tensor (window / compressed KV, index keys, compressor
staging rings) and the output of every decoder layer, attention, indexer, MoE and attention op of the step's
forwards (static decode forwards copy them into static buffers, so a replayed graph writes them too). The report
names the first differing step and what differs at it, in forward order, then the pools; for byte pools
(FP8 rows) how many bytes differ by one code step.

    python3 scripts/debug_replay_eager.py --config hca128 --kv-cache-dtype fp8_e4m3 \
        --sides triton:replay triton:eager [--radix] [--warm] [--dtype float32]
GPU: scripts/gpu_replay_bisect.sh. On CPU `replay` runs eagerly (no graphs); use torch sides there.
"""

from __future__ import annotations

import argparse
import dataclasses
import os
import sys
from collections import OrderedDict

import torch

sys.path.insert(0, os.path.join(os.path.dirname(__file__), "..", "test", "srt"))

WORKLOADS = {"tiny": ([5, 23, 40], [37, 9, 20, 3, 28]), "hca128": ([120, 250, 7], [20, 12, 30])}
MODULES = ("Attention", "Indexer", "MoE", "DeepseekV4DecoderLayer")  # whose outputs are recorded
OPS = ("sparse_attention", "index_logits", "topk_slots")  # attention ops whose results are recorded
PATHS = ("replay", "eager", "general")


class Recorder:
    """Tensors of the step's forwards, in call order. A static decode forward (the graph runner's `_run`, eager or
    captured) copies them into static buffers keyed by (batch size, call index, name); any other forward clones."""

    def __init__(self) -> None:
        self.bs = None  # batch size of the static forward being run or captured
        self.calls = 0
        self.buffers: dict = {}  # bs -> OrderedDict((index, name) -> buffer)
        self.cloned: OrderedDict = OrderedDict()  # this step's general forwards: (forward, index, name) -> tensor
        self.forwards = 0
        self.static_bs = None  # the padded batch size of this step's static forward, if one ran or replayed

    def start_static(self, bs: int) -> None:
        self.bs, self.calls = bs, 0

    def start_general(self) -> None:
        self.forwards += 1
        self.calls = 0

    def record(self, name: str, value) -> None:
        if isinstance(value, (tuple, list)):
            value = next((v for v in value if isinstance(v, torch.Tensor)), None)
        if not isinstance(value, torch.Tensor):
            return
        key = (self.calls, name)
        self.calls += 1
        if self.bs is None:
            self.cloned[(self.forwards,) + key] = value.clone()
            return
        table = self.buffers.setdefault(self.bs, OrderedDict())
        if key not in table or table[key].shape != value.shape or table[key].dtype != value.dtype:
            table[key] = torch.empty_like(value)
        table[key].copy_(value)

    def take_step(self) -> OrderedDict:
        """This step's recorded tensors (copies), in call order; resets the per-step state."""
        def key(f, i, name):  # the same names for a static and a general forward (compare the two paths)
            return f"{name} #{i}" + (f" (forward {f})" if f > 1 else "")
        out = OrderedDict((key(f, i, name), t) for (f, i, name), t in self.cloned.items())
        if self.static_bs is not None:
            f = self.forwards + 1
            out.update((key(f, i, name), t.clone()) for (i, name), t in self.buffers[self.static_bs].items())
        self.cloned, self.forwards, self.static_bs = OrderedDict(), 0, None
        return out


def instrument(eng, rec: Recorder) -> None:
    """Module forward hooks, wrapped attention ops, the model's forward, the graph runner's _run and forward."""
    runner = eng.model_runner
    for name, module in runner.model.named_modules():
        if type(module).__name__ in MODULES:
            module.register_forward_hook(lambda m, i, o, name=name: rec.record(name, o))
    real_model_forward = runner.model.forward

    def model_forward(*args, **kwargs):
        if rec.bs is None:
            rec.start_general()
        return real_model_forward(*args, **kwargs)
    runner.model.forward = model_forward

    def wrap(op, real):
        def wrapped(*args, **kwargs):
            result = real(*args, **kwargs)
            seen = result
            if op == "index_logits":  # it writes its last argument, past a row's visible entries (args[6]) not at all
                logits, visible = args[-1], args[6]
                seen = logits.masked_fill(
                    torch.arange(logits.shape[1], device=logits.device)[None, :] >= visible[:, None], float("-inf"))
            rec.record(op, seen)
            return result
        return wrapped
    ops = runner.attn_backend.ops
    runner.attn_backend.ops = dataclasses.replace(ops, **{op: wrap(op, getattr(ops, op)) for op in OPS})
    graphs = runner.graph_runner
    if graphs is None:
        return
    real_run, real_forward = graphs._run, graphs.forward

    def run(bs):
        rec.start_static(bs)
        try:
            return real_run(bs)
        finally:
            rec.bs = None

    def forward(input_ids, slots, *args, **kwargs):
        rec.static_bs = graphs.padded_size(slots.shape[1])
        return real_forward(input_ids, slots, *args, **kwargs)
    graphs._run, graphs.forward = run, forward


def pool_tensors(eng) -> OrderedDict:
    pool = eng.model_runner.token_to_kv_pool
    out = OrderedDict((f"window_kv[{i}]", t) for i, t in enumerate(pool.window_kv))
    out.update((f"compressed_kv[{i}]", t) for i, t in pool.compressed_kv.items())
    out.update((f"index_k[{i}]", t) for i, t in pool.index_k.items())
    for kind, states in (("attn_state", pool.attn_state), ("index_state", pool.index_state)):
        for i, s in states.items():
            out[f"{kind}[{i}].ring"] = s.buf
            if s.boundary is not None:
                out[f"{kind}[{i}].boundary"] = s.boundary
    return out


def run_side(args, side: str, setup=None) -> tuple:
    """(per-step snapshots, output logprobs per request) of one side, 'BACKEND:PATH'. `setup(engine)` runs before
    the recording is installed (tests perturb one side with it)."""
    from oracle import engine
    from test_static_decode import _workload

    backend, path = side.split(":")
    graph_args = dict(disable_cuda_graph=True) if path == "general" else dict(cuda_graph_bs=[1, 2, 3, 4, 8])
    eng = engine(args.config, device=args.device, dtype=args.dtype, attention_backend=backend,
                 max_running_requests=8, kv_cache_dtype=args.kv_cache_dtype, disable_radix_cache=not args.radix,
                 **graph_args)
    graphs = eng.model_runner.graph_runner
    if path != "general" and graphs is None:
        raise SystemExit(f"{side}: this engine has no static decode path")
    if setup is not None:
        setup(eng)
    rec = Recorder()
    instrument(eng, rec)
    if graphs is not None and graphs.graphs:  # capture again, the recording inside the graphs
        graphs.release()
        graphs.capture()
    ids, params = _workload(3, 6, *WORKLOADS[args.config], sampled=True)
    if args.warm:  # the test's order: one run first (with --radix, the measured run then hits its prefixes)
        eng.generate(input_ids=ids, sampling_params=params, return_logprob=True)
    rec.take_step()
    if path == "eager":
        graphs.graphs.clear()
    steps = []
    sched = eng.scheduler
    real_step = sched.step

    def step():
        real_step()
        if torch.cuda.is_available():
            torch.cuda.synchronize()
        snap = rec.take_step()  # the forwards' outputs in call order, then the pools after the step
        snap.update((k, v.clone()) for k, v in pool_tensors(eng).items())
        steps.append(snap)
    sched.step = step
    outs = eng.generate(input_ids=ids, sampling_params=params, return_logprob=True)
    return steps, [[lp for lp, _, _ in o["meta_info"]["output_token_logprobs"]] for o in outs]


def common(x: torch.Tensor, y: torch.Tensor) -> tuple:
    """x and y cut to their common leading part (a static forward's padded rows, its capacity-wide index logits);
    None when their ranks or dtypes differ."""
    if x.dim() != y.dim() or x.dtype != y.dtype:
        return None
    part = tuple(slice(0, min(a, b)) for a, b in zip(x.shape, y.shape))
    return x[part].contiguous(), y[part].contiguous()


def same_bits(x: torch.Tensor, y: torch.Tensor) -> bool:
    """Bit-equal on the common part (NaNs at the same places with the same payload count as equal)."""
    pair = common(x, y)
    return pair is not None and pair[0].reshape(-1).view(torch.uint8).equal(pair[1].reshape(-1).view(torch.uint8))


def describe(x: torch.Tensor, y: torch.Tensor) -> str:
    pair = common(x, y)
    if pair is None:
        return f"ranks / dtypes {tuple(x.shape)} {x.dtype} vs {tuple(y.shape)} {y.dtype}"
    note = f" (the common part of {list(x.shape)} and {list(y.shape)})" if x.shape != y.shape else ""
    x, y = pair
    ne = x != y
    rows = ne.reshape(x.shape[0], -1).any(1).nonzero().flatten().tolist() if x.dim() else []
    gap = (x[ne].double() - y[ne].double()).abs() if ne.any() else torch.zeros(1)  # empty: NaN payloads only
    text = (f"{tuple(x.shape)}{note} {x.dtype}: rows {rows[:8]}{'...' if len(rows) > 8 else ''}, "
            f"{int(ne.sum())} elements, max |diff| {gap.max().item():.3g}")
    if x.dtype == torch.uint8:  # FP8 rows: e4m3 codes (and ue8m0 scale bytes) one step apart differ by 1
        text += f", {int((gap == 1).sum())} bytes by one step"
    return text


def first_difference(a: list, b: list):
    """(step, [(tensor name, description)] in recording order) of the first step whose snapshots differ, else None.
    Top-k picks compare as sets (the torch reference lists them in another order)."""
    for n, (sa, sb) in enumerate(zip(a, b)):
        for side in (sa, sb):
            for k in side:
                if k.startswith(("topk_slots", "layers.")) and side[k].dtype == torch.int64 and side[k].dim() == 2:
                    side[k] = side[k].sort(dim=1).values
        diff = [(k, describe(sa[k], sb[k]) if k in sb else "on one side only")
                for k in sa if k not in sb or not same_bits(sa[k], sb[k])]
        if diff:
            return n, diff
    return None


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--config", default="hca128", choices=list(WORKLOADS))
    p.add_argument("--kv-cache-dtype", default="fp8_e4m3")
    p.add_argument("--dtype", default="bfloat16")
    p.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    p.add_argument("--sides", nargs=2, default=["triton:replay", "triton:eager"], metavar="BACKEND:PATH",
                   help=f"PATH one of {', '.join(PATHS)}")
    p.add_argument("--radix", action="store_true", help="keep the prefix cache on (default off)")
    p.add_argument("--warm", action="store_true", help="each side runs the workload once before the measured run")
    p.add_argument("--show", type=int, default=12, help="differing tensors listed at the first differing step")
    args = p.parse_args()
    for side in args.sides:
        if side.count(":") != 1 or side.split(":")[1] not in PATHS:
            p.error(f"--sides: {side!r} is not BACKEND:PATH with PATH one of {PATHS}")
    (a, lps_a), (b, lps_b) = (run_side(args, s) for s in args.sides)
    print(f"{args.config} kv={args.kv_cache_dtype} dtype={args.dtype} {args.sides[0]} vs {args.sides[1]} "
          f"radix={args.radix} warm={args.warm}: {len(a)} / {len(b)} scheduler steps, output logprobs "
          f"{'bit-equal' if lps_a == lps_b else 'DIFFER'}")
    for i, (x, y) in enumerate(zip(lps_a, lps_b)):
        j = next((j for j, (u, v) in enumerate(zip(x, y)) if u != v), None)
        if j is not None:
            print(f"  request {i}: first differing output token {j}: {x[j]:.6f} vs {y[j]:.6f}, "
                  f"max |diff| {max(abs(u - v) for u, v in zip(x, y)):.3g}")
    found = first_difference(a, b)
    if found is None:
        print("every step: every pool tensor and recorded output bit-equal")
        return
    step, diffs = found
    print(f"first differing step: {step} ({len(diffs)} of {len(a[step])} tensors):")
    for name, text in diffs[:args.show]:
        print(f"  {name} {text}")


if __name__ == "__main__":
    main()
