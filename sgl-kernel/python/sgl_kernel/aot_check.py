"""Compiles every Triton kernel the engine launches, at the launch configurations it uses, for GPUs this machine
does not have: `python -m sgl_kernel.aot_check --target gfx942 gfx950 sm90 sm100`.

The launches come from the engine's own wrappers (aot_plan calls them with DeepSeek-V4-Flash / -Pro shapes), run
with `JITFunction.run` replaced by a recorder: each launch gives the kernel, its Triton signature and
specialization attributes as the target's backend derives them from the arguments (pointer dtypes, ints equal to
1 or divisible by 16), its constexprs and its launch options, and launches nothing. The wrappers' questions about
the device (PDL, TMA, SM count, shared memory, the GEMV and planes paths) are answered for the target (`_probes`).
Identical launches compile once; each compiles in a worker process without TRITON_INTERPRET. One row per (kernel,
launch, target): compiled or the compiler's first error line, registers, spill / scratch bytes, shared memory (LDS)
against the target's limit. Exit status 1 on any failure or shared memory over the limit.

`--update-manifest` records every launch's row in aot_manifest.json (see aot_manifest); `--manifest` takes the rows
of launches the manifest holds from it, compiles the others and a rotating sample of the held ones (which must
reproduce their rows): CI's check of every launch within its budget.
"""

from __future__ import annotations

import argparse
import concurrent.futures
import contextlib
import importlib
import json
import multiprocessing
import os
import re
import subprocess
import sys
import tempfile
import time
from dataclasses import asdict, dataclass, field
from typing import Optional

import torch

from sgl_kernel.aot_manifest import (COMPARED_FIELDS, MANIFEST_PATH, RESULT_FIELDS, Manifest, ManifestError,
                                     launch_hash, rotating_sample)
from sgl_kernel.aot_targets import DEFAULT_TARGETS, TARGETS, AotTarget

# Constexprs the wrappers derive from `device.type != "cuda"` (the CPU interpreter's rounding): False on a GPU.
CPU_ONLY_CONSTEXPRS = {"ROUND_IN_FP32": False, "BF16_BITS": False}


@dataclass
class Launch:
    """One recorded kernel launch, as the target's backend specializes it."""
    module: str
    name: str
    signature: dict  # parameter -> Triton type ("*bf16", "i32", "constexpr", ...)
    constexprs: dict  # (index,) -> value
    attrs: dict  # (index,) -> [[attribute, value], ...] (divisibility, pointer range)
    options: dict  # num_warps, num_stages, launch_pdl, ...
    labels: list = field(default_factory=list)  # the plan's cases that launched it

    def key(self) -> str:
        return repr((self.module, self.name, sorted(self.signature.items()), sorted(self.constexprs.items()),
                     sorted((k, repr(v)) for k, v in self.attrs.items()), sorted(self.options.items())))

    def shape_key(self) -> str:
        """The launch without its specialization attributes and ints passed as 1: one compile per code shape."""
        names = list(self.signature)
        cx = sorted((names[k[0]], repr(v)) for k, v in self.constexprs.items()
                    if not (v == 1 and names[k[0]][:1].islower()))
        return repr((self.module, self.name, cx, sorted(self.options.items())))

    def path_key(self) -> str:
        """The kernel, its operands' dtypes and its constexprs other than ints (flags, formats): one compile per code
        path."""
        paths = sorted((k, repr(v)) for k, v in self.constexpr_names().items() if not _is_size(v))
        operands = [t for t in self.signature.values() if not t[0].isalpha() or t.startswith("tensordesc")]
        return repr((self.module, self.name, paths, operands))

    def size(self) -> int:
        """The product of the integer constexprs and the warps: the largest tiles of a path rank first."""
        total = self.options.get("num_warps", 4)
        for v in self.constexpr_names().values():
            total *= v if _is_size(v) and v > 0 else 1
        return total

    def constexpr_names(self) -> dict:
        names = list(self.signature)
        return {names[k[0]]: v for k, v in self.constexprs.items()}


def _is_size(v) -> bool:
    return isinstance(v, int) and not isinstance(v, bool)


DEDUPE = ("launch", "shape", "path")


class Recorder:
    """Stands in for JITFunction.run while a target's plan runs: records, launches nothing."""

    def __init__(self, target: AotTarget):
        from triton.compiler import make_backend
        self.backend = make_backend(target.gpu_target())
        self.launches: dict = {}
        self.label = ""

    def run(self, fn, args, kwargs) -> None:
        from triton.runtime.jit import JITFunction, create_function_from_signature
        binder = create_function_from_signature(fn.signature, fn.params, self.backend)
        bound, specialization, _ = binder(*args, **kwargs)
        _, signature, constexprs, attrs = JITFunction._pack_args(fn, self.backend, kwargs, bound, specialization, {})
        names = list(signature)
        constexprs = {k: CPU_ONLY_CONSTEXPRS.get(names[k[0]], v) if len(k) == 1 else v for k, v in constexprs.items()}
        options = {k: v for k, v in kwargs.items() if k not in signature}
        launch = Launch(fn.fn.__module__, fn.fn.__name__, dict(signature), constexprs, attrs, options)
        launch = self.launches.setdefault(launch.key(), launch)
        if self.label not in launch.labels:
            launch.labels.append(self.label)


def _probes(target: AotTarget) -> dict:
    """The wrappers' device questions (module attribute -> answer for `target`), looked up in their modules'
    globals at call time, so replacing them in every sgl_kernel module that holds one answers every caller."""
    import triton
    return {
        "pdl_supported": lambda device: target.pdl,
        "_tma_supported": lambda device: target.tma,
        "tma_supported": lambda device: target.tma,
        "planes_supported": lambda device, dtype: target.nvidia and dtype == torch.bfloat16,
        "gemv_supported": lambda device, dtype: target.nvidia and dtype in (torch.bfloat16, torch.float16),
        "_num_sms": lambda device: target.num_sms,
        "_sm_count": lambda device: target.num_sms,
        "bf16_bits": lambda dtype, device: False,
        "hip_arch": lambda device: None if target.nvidia else target.arch,
        "shared_memory_limit": lambda device: target.shared_limit if target.nvidia else None,
        "nvidia_arch": lambda device: target.arch if target.nvidia else None,
        # On a GPU the MoE aligns small batches in one program (dsv4_moe_align's default asks topk_ids.is_cuda).
        "dsv4_moe_align": _gpu_align(sys.modules["sgl_kernel.dsv4_moe_align"], triton),
    }


def _gpu_align(module, triton):
    align = module.dsv4_moe_align

    def gpu_align(topk_ids, num_experts, block_m, one_program=None, pdl=False):
        if one_program is None:
            one_program = topk_ids.numel() <= module.ALIGN_ONE_PROGRAM_PAIRS
        return align(topk_ids, num_experts, block_m, one_program, pdl)
    return gpu_align


@contextlib.contextmanager
def recording(target: AotTarget):
    """JITFunction.run records into the yielded Recorder, and the sgl_kernel modules' device probes answer for
    `target`, inside the block."""
    from triton.runtime.jit import JITFunction

    import sgl_kernel.aot_plan  # noqa: F401  (every kernel module loaded, so every probe is replaced)
    recorder = Recorder(target)
    probes = _probes(target)
    saved = []
    for mod in [m for n, m in list(sys.modules.items()) if n.startswith("sgl_kernel.dsv4_")]:
        for attr, probe in probes.items():
            if callable(getattr(mod, attr, None)):
                saved.append((mod, attr, getattr(mod, attr)))
                setattr(mod, attr, probe)
    run = JITFunction.run
    JITFunction.run = lambda fn, *args, grid, warmup, **kwargs: recorder.run(fn, args, kwargs)
    try:
        yield recorder
    finally:
        JITFunction.run = run
        for mod, attr, value in saved:
            setattr(mod, attr, value)


def capture(target: AotTarget, kernel_filter: str = "", models: tuple = (), dedupe: str = "launch") -> list:
    """The unique launches of the plan on `target` (those whose kernel name contains `kernel_filter`, of `models`,
    all if empty). dedupe: "launch", every distinct compile; "shape", one per Launch.shape_key (the first seen);
    "path", one per Launch.path_key, its largest tiles (Launch.size)."""
    from sgl_kernel.aot_plan import plan_cases
    with recording(target) as rec:
        for label, case in plan_cases(target, models):
            rec.label = label
            case()
    launches = [launch for launch in rec.launches.values() if kernel_filter in launch.name]
    if dedupe == "launch":
        return launches
    if dedupe == "path":
        launches = sorted(launches, key=lambda launch: -launch.size())
    key = Launch.shape_key if dedupe == "shape" else Launch.path_key
    return list({key(launch): launch for launch in reversed(launches)}.values())[::-1]


@dataclass
class Row:
    target: str
    kernel: str
    config: str  # the first plan case that launched it (+ how many more)
    ok: bool = False
    error: str = ""
    regs: str = ""  # NVIDIA: registers; AMD: VGPR/SGPR/AGPR
    spill: int = 0  # NVIDIA: stack bytes; AMD: scratch (private segment) bytes
    shared: int = 0
    shared_limit: int = 0
    notes: str = ""
    signature: str = ""  # the runtime parameters' Triton types
    seconds: float = 0.0  # the compile's wall time (where the check's time goes)
    decode: bool = False  # launched by a decode or speculative-verify case (aot_plan.DECODE_ROWS / VERIFY_ROWS)
    source: str = "compiled"  # "compiled": now; "manifest": the manifest's row; "sample": held there, compiled again

    @property
    def over_shared(self) -> bool:
        return self.ok and self.shared > self.shared_limit


def _nvidia_usage(cubin: bytes, kernel: str) -> tuple:
    """(registers, stack bytes) of `kernel` from cuobjdump -res-usage (the binary Triton ships)."""
    import triton
    tool = os.path.join(os.path.dirname(triton.__file__), "backends", "nvidia", "bin", "cuobjdump")
    with tempfile.NamedTemporaryFile(suffix=".cubin") as f:
        f.write(cubin)
        f.flush()
        out = subprocess.run([tool, "-res-usage", f.name], capture_output=True, text=True, check=True).stdout
    return parse_res_usage(out, kernel)


def parse_res_usage(out: str, kernel: str) -> tuple:
    """(registers, stack bytes) of the function named `kernel` in cuobjdump -res-usage output. A cubin also lists the
    device functions the kernel calls (libdevice's slow paths: 32 registers and KBs of stack of their own), in any
    order: the first REG line is not always the kernel's."""
    usage, name = {}, None
    for line in out.splitlines():
        m = re.match(r"\s*Function\s+(\S+?):?\s*$", line)
        if m:
            name = m.group(1)
        elif "REG:" in line and name is not None:
            fields = dict(tok.split(":", 1) for tok in line.split() if ":" in tok)
            usage.setdefault(name, (int(fields["REG"]), int(fields["STACK"])))
    if kernel not in usage:
        raise ValueError(f"no resource usage of {kernel} in cuobjdump's output: {sorted(usage)}")
    return usage[kernel]


def _amd_field(amdgcn: str, name: str) -> int:
    m = re.search(rf"^\s*-?\s*\.{name}:\s*(\d+)", amdgcn, re.MULTILINE)
    return int(m.group(1)) if m else 0


def _first_error(e: Exception) -> str:
    """The compiler's message in one line. Triton's front end puts the source position first and the message last,
    and an error inside a called @triton.jit function comes as the cause of the caller's (whose own text ends at
    the marker): the outer position with the innermost message. The backends' errors name an error line."""
    lines = [ln.strip() for ln in str(e).splitlines() if ln.strip()] or [type(e).__name__]
    inner = e
    while inner.__cause__ is not None:
        inner = inner.__cause__
    tail = [ln.strip() for ln in str(inner).splitlines() if ln.strip() and ln.strip() != "^"]
    if lines[0].startswith("at ") and tail:
        return f"{lines[0]} {tail[-1]}"
    return next((ln for ln in lines if "error" in ln.lower()), lines[0])


def compile_launch(launch: Launch, target_name: str) -> Row:
    """Compiles one launch for one target (in a worker process: Triton's compile holds the GIL)."""
    import triton
    from triton.compiler import ASTSource, make_backend
    target = TARGETS[target_name]
    fn = getattr(importlib.import_module(launch.module), launch.name)
    row = _plan_row(launch, target_name)
    known = make_backend(target.gpu_target()).parse_options({}).__dict__
    options = {k: v for k, v in launch.options.items() if k in known}
    dropped = sorted(set(launch.options) - set(options))
    if dropped:
        row.notes = f"dropped {', '.join(dropped)} (no such option on {target.backend})"
    start = time.time()
    try:
        kernel = triton.compile(ASTSource(fn, launch.signature, launch.constexprs, launch.attrs),
                                target=target.gpu_target(), options=options)
    except Exception as e:  # the compiler's error is the finding
        row.error = _first_error(e)
        return row
    finally:
        row.seconds = round(time.time() - start, 2)
    row.ok = True
    row.shared = kernel.metadata.shared
    if target.nvidia:
        regs, row.spill = _nvidia_usage(kernel.asm["cubin"], kernel.metadata.name)
        row.regs = str(regs)
    else:
        gcn = kernel.asm["amdgcn"]
        row.regs = "/".join(str(_amd_field(gcn, f)) for f in ("vgpr_count", "sgpr_count", "agpr_count"))
        row.spill = _amd_field(gcn, "private_segment_fixed_size")
        row.shared = max(row.shared, _amd_field(gcn, "group_segment_fixed_size"))
    return row


def _plan_row(launch: Launch, target_name: str, **results) -> Row:
    """A row of `launch` on the target before its compile's findings (`results`, from a manifest)."""
    results.setdefault("shared_limit", TARGETS[target_name].shared_limit)
    return Row(target_name, launch.name, launch.labels[0] + (f" (+{len(launch.labels) - 1})"
                                                             if len(launch.labels) > 1 else ""),
               signature=",".join(t for t in launch.signature.values() if t != "constexpr"),
               decode=is_decode(launch), **results)


def is_decode(launch: Launch) -> bool:
    """Whether a decode-graph batch or a speculative verify launched it (a label's T=rows)."""
    from sgl_kernel.aot_plan import DECODE_ROWS, VERIFY_ROWS
    rows = {int(m.group(1)) for label in launch.labels for m in [re.search(r"\bT=(\d+)\b", label)] if m}
    return bool(rows & set(DECODE_ROWS + VERIFY_ROWS))


def check(targets: list, jobs: int, kernel_filter: str = "", models: tuple = (), dedupe: str = "launch") -> list:
    """Every row of every target, compiled over `jobs` processes spawned without TRITON_INTERPRET."""
    return compile_all([(launch, name) for name in targets
                        for launch in capture(TARGETS[name], kernel_filter, models, dedupe)], jobs)


def _use_cache_dir(path: str) -> None:
    import triton
    triton.knobs.cache.dir = path


def compile_all(work: list, jobs: int, cache_dir: Optional[str] = None) -> list:
    """The rows of (launch, target name) pairs, compiled over `jobs` worker processes (with `cache_dir` as Triton's
    kernel cache: an empty one makes every compile a real one, not a read of an earlier run's binary)."""
    saved = os.environ.pop("TRITON_INTERPRET", None)
    try:
        ctx = multiprocessing.get_context("spawn")
        with concurrent.futures.ProcessPoolExecutor(max_workers=max(1, jobs), mp_context=ctx,
                                                    initializer=_use_cache_dir if cache_dir else None,
                                                    initargs=(cache_dir,) if cache_dir else ()) as pool:
            rows = list(pool.map(compile_launch, *zip(*work))) if work else []
    finally:
        if saved is not None:
            os.environ["TRITON_INTERPRET"] = saved
    return rows


def planned(targets: list, kernel_filter: str = "", models: tuple = ()) -> list:
    """(launch, target name, manifest key) for every distinct launch of the plan on `targets`."""
    import triton
    out = []
    for name in targets:
        for launch in capture(TARGETS[name], kernel_filter, models):
            fn = getattr(importlib.import_module(launch.module), launch.name)
            out.append((launch, name, launch_hash(fn.cache_key, launch.key(), name, triton.__version__)))
    return out


def _held_row(stored: dict, launch: Launch, target_name: str) -> Row:
    return _plan_row(launch, target_name, source="manifest", **{f: stored[f] for f in RESULT_FIELDS})


def update_manifest(path: str, targets: list, jobs: int, kernel_filter: str = "", models: tuple = ()) -> list:
    """Writes the manifest at `path` for the plan on `targets`: rows it holds for launches still planned are kept,
    the other launches compiled; rows of other targets kept, of launches no longer planned dropped (a filtered plan,
    `kernel_filter` / `models`, gives a manifest of that part: tests). Returns every planned launch's row."""
    import triton
    try:
        old = Manifest.load(path, triton.__version__).rows
    except ManifestError:  # none yet, or another Triton's: everything compiles
        old = {}
    plan = planned(targets, kernel_filter, models)
    fresh = iter(compile_all([(launch, name) for launch, name, key in plan if key not in old], jobs))
    manifest = Manifest(triton.__version__, {k: v for k, v in old.items() if v["target"] not in targets})
    rows = []
    for launch, name, key in plan:
        row = _held_row(old[key], launch, name) if key in old else next(fresh)
        manifest.rows[key] = {"target": name, "kernel": launch.name, "config": row.config,
                              **{f: getattr(row, f) for f in RESULT_FIELDS}}
        rows.append(row)
    manifest.save(path)
    return rows


def manifest_check(path: str, targets: list, jobs: int, sample: int, day: int, kernel_filter: str = "",
                   models: tuple = ()) -> tuple:
    """(rows, mismatches) of the plan on `targets` against the manifest at `path`: a launch it holds takes its row,
    except a rotating `sample` of them (`day` picks it: aot_manifest.rotating_sample) compiled again, whose findings
    must equal the held row's (mismatches: each difference); a launch it lacks is compiled. ManifestError if the
    manifest is missing or of another Triton."""
    import triton
    held = Manifest.load(path, triton.__version__).rows
    plan = planned(targets, kernel_filter, models)
    sampled = set(rotating_sample([key for _, _, key in plan if key in held], sample, day))
    with tempfile.TemporaryDirectory() as cache:  # Triton's cache would answer a sample from the refresh's compile
        fresh = iter(compile_all([(launch, name) for launch, name, key in plan if key not in held or key in sampled],
                                 jobs, cache))
    rows, mismatches = [], []
    for launch, name, key in plan:
        if key in held and key not in sampled:
            rows.append(_held_row(held[key], launch, name))
            continue
        row = next(fresh)
        if key in sampled:
            row.source = "sample"
            diff = [f"{f} {held[key][f]!r} -> {getattr(row, f)!r}" for f in COMPARED_FIELDS
                    if held[key][f] != getattr(row, f)]
            if diff:
                mismatches.append(f"{name} {launch.name} [{row.config}]: {', '.join(diff)}")
        rows.append(row)
    return rows, mismatches


def decode_spills(rows: list, target: str = "gfx950") -> list:
    """Rows of decode-path launches on `target` that spill (scratch / stack bytes)."""
    return [r for r in rows if r.target == target and r.decode and r.ok and r.spill > 0]


def manifest_summary(rows: list, mismatches: list) -> str:
    compiled = [r for r in rows if r.source != "manifest"]
    return (f"{len(rows)} launches: {len(rows) - len(compiled)} verified from the manifest, {len(compiled)} compiled "
            f"now ({sum(r.source == 'compiled' for r in rows)} not in the manifest, "
            f"{sum(r.source == 'sample' for r in rows)} sampled from it); {sum(not r.ok for r in rows)} failed, "
            f"{sum(r.over_shared for r in rows)} over shared memory, {len(decode_spills(rows))} gfx950 decode-path "
            f"launches with scratch, {len(mismatches)} sampled rows that differ from the manifest")


def format_table(rows: list) -> str:
    head = ("target", "kernel", "config", "status", "regs", "spill", "shared/limit")
    body = [(r.target, r.kernel, r.config, "ok" if r.ok else "FAIL: " + r.error[:120], r.regs, str(r.spill),
             f"{r.shared}/{r.shared_limit}" + (" OVER" if r.over_shared else "") + (f"  {r.notes}" if r.notes else ""))
            for r in rows]
    widths = [max(len(x[i]) for x in [head] + body) for i in range(len(head) - 1)]
    lines = ["  ".join(c.ljust(w) for c, w in zip(x[:-1], widths)) + "  " + x[-1] for x in [head] + body]
    return "\n".join(lines)


def summary(rows: list) -> str:
    parts = []
    for name in dict.fromkeys(r.target for r in rows):
        mine = [r for r in rows if r.target == name]
        parts.append(f"{name}: {len(mine)} configs, {sum(r.ok for r in mine)} compiled, "
                     f"{sum(not r.ok for r in mine)} failed, {sum(r.ok and r.spill > 0 for r in mine)} with spills, "
                     f"{sum(r.over_shared for r in mine)} over shared memory, "
                     f"{sum(r.seconds for r in mine):.0f} s compiling")
    return "; ".join(parts) or "no configs"


def main(argv: Optional[list] = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m sgl_kernel.aot_check", description=__doc__.splitlines()[0])
    parser.add_argument("--target", nargs="+", default=list(DEFAULT_TARGETS), choices=sorted(TARGETS))
    parser.add_argument("--jobs", type=int, default=os.cpu_count() or 1)
    parser.add_argument("--kernel", default="", help="only kernels whose name contains this")
    parser.add_argument("--json", default=None, help="also write the rows here")
    parser.add_argument("--model", nargs="+", default=[], help="only these models' shapes (flash, pro)")
    parser.add_argument("--dedupe", choices=DEDUPE, default="launch",
                        help="launch: every distinct compile (default); shape: one per kernel, constexprs and options "
                             "(not per specialization of ints and pointer alignments); path: one per kernel and "
                             "non-integer constexprs, its largest tiles (the CI's quick pass)")
    parser.add_argument("--list", action="store_true", help="print the plan's launches (target, kernel, config, "
                                                               "constexprs) without compiling")
    parser.add_argument("--update-manifest", nargs="?", const=MANIFEST_PATH, default=None, metavar="PATH",
                        help="compile the plan's launches the manifest (default: sgl_kernel/aot_manifest.json) "
                             "lacks and write it, with the rows it holds of launches still planned")
    parser.add_argument("--manifest", nargs="?", const=MANIFEST_PATH, default=None, metavar="PATH",
                        help="take the rows of launches the manifest holds from it; compile the others and --sample "
                             "of the held ones (CI)")
    parser.add_argument("--sample", type=int, default=24, help="with --manifest: held launches compiled again, a "
                                                                "slice that moves each day (default 24)")
    args = parser.parse_args(argv)
    if args.update_manifest and (args.kernel or args.model or args.dedupe != "launch"):
        parser.error("--update-manifest records the whole plan: no --kernel, --model or --dedupe")
    if os.environ.get("TRITON_INTERPRET") == "1":  # the plan must see GPU kernels, not the interpreter's
        env = {k: v for k, v in os.environ.items() if k != "TRITON_INTERPRET"}
        return subprocess.run([sys.executable, "-m", "sgl_kernel.aot_check", *(argv or sys.argv[1:])],
                              env=env).returncode
    if args.list:
        for name in args.target:
            for launch in capture(TARGETS[name], args.kernel, tuple(args.model), args.dedupe):
                print(f"{name}\t{launch.name}\t{launch.labels[0]}\t{launch.constexpr_names()}")
        return 0
    start, mismatches = time.time(), []
    if args.manifest:
        try:
            rows, mismatches = manifest_check(args.manifest, args.target, args.jobs, args.sample,
                                              int(time.time() // 86400), args.kernel, tuple(args.model))
        except ManifestError as e:
            print(f"error: {e}", file=sys.stderr)
            return 2
        print(format_table([r for r in rows if r.source != "manifest" or not r.ok or r.over_shared]))
        print("\n".join(f"differs from the manifest: {m}" for m in mismatches))
        print(f"manifest: {manifest_summary(rows, mismatches)}")
    elif args.update_manifest:
        rows = update_manifest(args.update_manifest, args.target, args.jobs)
        print(format_table([r for r in rows if r.source != "manifest"]))
        print(f"manifest {args.update_manifest}: {sum(r.source == 'manifest' for r in rows)} rows kept, "
              f"{sum(r.source != 'manifest' for r in rows)} compiled")
    else:
        rows = check(args.target, args.jobs, args.kernel, tuple(args.model), args.dedupe)
        print(format_table(rows))
    print(f"summary: {summary(rows)}; {time.time() - start:.0f} s")
    if args.json:
        with open(args.json, "w", encoding="utf-8") as f:
            json.dump([asdict(r) for r in rows], f, indent=1)
    bad = not rows or mismatches or not all(r.ok and not r.over_shared for r in rows)
    return 1 if bad or (args.manifest and decode_spills(rows)) else 0


if __name__ == "__main__":
    sys.exit(main())
