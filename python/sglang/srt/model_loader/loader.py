"""Load a DeepSeek-V4 checkpoint directory as (native name, dequantized tensor) pairs.

`iter_checkpoint` first plans the whole load from the safetensors headers alone (names, shapes, dtypes):
every problem (missing, unexpected, mis-shaped, wrong dtype, FP8 weight without `.scale`, `.scale`
without weight) is reported at once, before any tensor data is read. It then reads tensors lazily.
Formats are auto-detected by dtype: F8_E4M3 + `.scale` (128x128 blocks), I8/U8 packed FP4 + `.scale`
(per 32 inputs, routed experts only), or plain floats. Names may be native, HF-saved or HF-module.
"""

from __future__ import annotations

import logging
import math
import threading
from dataclasses import dataclass
from typing import Callable, Iterator, Optional

import torch
from tqdm import tqdm

from sglang.srt.configs.deepseek_v4 import DeepseekV4Config
from sglang.srt.distributed.sharding import ParallelConfig, splits_whole_blocks
from sglang.srt.layers.quantization.fp8_format import Fp8Format, fp8_format, to_fp8_format
from sglang.srt.model_loader.checkpoint_spec import PARTS, TensorKind, TensorSpec, expected_tensors, part_of
from sglang.srt.model_loader.name_mapping import FusedExperts, to_native
from sglang.srt.model_loader.quant_formats import (
    FP4_BLOCK, FP8_BLOCK, dequantize_fp8_block, dequantize_mxfp4, e8m0_encode, scale_to_float)
from sglang.srt.model_loader.weight_utils import CheckpointError, TensorReader, TensorRecord, list_tensors

__all__ = ["CheckpointError", "TensorPlan", "load_config", "plan_checkpoint", "iter_checkpoint", "load_checkpoint"]

_FLOATS = (torch.float32, torch.bfloat16, torch.float16, torch.float64)
_SCALES = (torch.float8_e8m0fnu,) + _FLOATS  # HF's `weight_scale_inv` is a float multiplier
_MAX_LISTED = 20

logger = logging.getLogger(__name__)


def progress_bar(iterable=None, **kwargs) -> tqdm:
    """A tqdm bar shown when this module logs at INFO (a server's default; tests and --log-level warning stay
    quiet). tqdm's default lock includes a multiprocessing lock, a semaphore that a scheduler process leaks
    when it is killed (the resource tracker then warns at exit): one bar at a time needs a thread lock only."""
    tqdm.set_lock(threading.RLock())
    return tqdm(iterable, disable=not logger.isEnabledFor(logging.INFO), **kwargs)


def load_config(model_dir: str) -> DeepseekV4Config:
    """The checkpoint's config.json (native or HF form); a bad field raises ConfigError naming it."""
    return DeepseekV4Config.from_pretrained(model_dir)


@dataclass(frozen=True)
class StoredTensor:
    """Where one native tensor lives: a stored tensor, or a slice of an HF fused expert tensor."""

    record: TensorRecord
    index: Optional[tuple] = None

    @property
    def shape(self) -> tuple:
        if self.index is None:
            return self.record.shape
        shape = list(self.record.shape)
        head = []
        for dim, ix in enumerate(self.index):  # ints drop a dim, slices shrink it
            if isinstance(ix, slice):
                head.append(len(range(*ix.indices(shape[dim]))))
        return tuple(head) + tuple(shape[len(self.index):])

    @property
    def dtype(self) -> Optional[torch.dtype]:
        return self.record.dtype


@dataclass(frozen=True)
class TensorPlan:
    """How to produce one native tensor: its spec, detected format and stored sources."""

    name: str
    spec: TensorSpec
    fmt: str  # "plain" | "fp8" | "fp4" | "index"
    weight: StoredTensor
    scale: Optional[StoredTensor] = None


def _where(name: str, st: StoredTensor) -> str:
    src = "" if st.record.name == name else f" (stored as '{st.record.name}')"
    return f"tensor '{name}'{src}"


def _fp8_scale_shape(shape: tuple, block: tuple) -> tuple:
    return (math.ceil(shape[0] / block[0]), math.ceil(shape[1] / block[1]))


def _check_scale(name: str, scale: Optional[StoredTensor], want: tuple, what: str, shape: tuple) -> Optional[str]:
    """Problem with the `.scale` of weight `name` (logical `shape`), or None."""
    if scale is None:
        return f"tensor '{name}' is stored {what} but its '.scale' tensor is missing"
    where = _where(name[: -len("weight")] + "scale", scale)
    if scale.dtype not in _SCALES:
        return f"{where} has dtype {scale.record.dtype_name}, expected F8_E8M0 (or a float multiplier)"
    if scale.shape != want:
        return f"{where} has shape {list(scale.shape)}, expected {list(want)} for the {what} weight {list(shape)}"
    return None


def _plan_one(name: str, spec: TensorSpec, w: StoredTensor, s: Optional[StoredTensor], block: tuple) -> tuple:
    """(TensorPlan, None) or (None, problem message)."""
    where, dt, kind = _where(name, w), w.dtype, spec.kind
    expected = f"expected {spec.describe()}"

    def bad_dtype() -> tuple:
        allowed = {TensorKind.LINEAR: "F8_E4M3 (+ .scale) or BF16/F16/F32",
                   TensorKind.EXPERT: "I8/U8 packed FP4 (+ .scale), F8_E4M3 (+ .scale) or BF16/F16/F32",
                   TensorKind.FLOAT: "BF16/F16/F32", TensorKind.FP32: "F32 (or BF16/F16)",
                   TensorKind.INDEX: "I64 or I32"}[kind]
        return None, f"{where} has dtype {w.record.dtype_name}, expected {allowed} ({spec.describe()})"

    def bad_shape(want: tuple, what: str = "") -> tuple:
        return None, f"{where} has shape {list(w.shape)}, expected {list(want)}{what} ({spec.describe()})"

    if s is not None and not (kind.quantizable and dt not in _FLOATS):
        return None, f"{where} has a '.scale' tensor but is not stored quantized ({w.record.dtype_name}); {expected}"
    if kind == TensorKind.INDEX:
        if dt not in (torch.int64, torch.int32):
            return bad_dtype()
        return (TensorPlan(name, spec, "index", w), None) if w.shape == spec.shape else bad_shape(spec.shape)
    if dt in _FLOATS:
        return (TensorPlan(name, spec, "plain", w), None) if w.shape == spec.shape else bad_shape(spec.shape)
    if not kind.quantizable:
        return bad_dtype()
    if dt == torch.float8_e4m3fn:
        if w.shape != spec.shape:
            return bad_shape(spec.shape)
        err = _check_scale(name, s, _fp8_scale_shape(spec.shape, block), "FP8", spec.shape)
        return (None, err) if err else (TensorPlan(name, spec, "fp8", w, s), None)
    if dt in (torch.int8, torch.uint8) and kind == TensorKind.EXPERT:
        out_f, in_f = spec.shape
        if in_f % FP4_BLOCK:
            return None, f"{where} is packed FP4 but its input dim {in_f} is not a multiple of {FP4_BLOCK}"
        if w.shape != (out_f, in_f // 2):
            return bad_shape((out_f, in_f // 2), " (packed FP4: [out, in/2])")
        err = _check_scale(name, s, (out_f, in_f // FP4_BLOCK), "packed FP4", spec.shape)
        return (None, err) if err else (TensorPlan(name, spec, "fp4", w, s), None)
    return bad_dtype()


def _stored_by_native(model_dir: str, part: str, problems: list) -> dict:
    """Native name -> StoredTensor for every stored tensor of `part` (others ignored)."""
    out: dict = {}
    for rec in list_tensors(model_dir):
        native = to_native(rec.name)
        if isinstance(native, FusedExperts):
            if part_of(native.block) != part:
                continue
            if rec.dtype not in _FLOATS or len(rec.shape) != 3:
                problems.append(f"fused expert tensor '{rec.name}' must be a 3-D float tensor, got "
                                f"{rec.dtype_name} {list(rec.shape)}")
                continue
            items = [(n, StoredTensor(rec, idx)) for n, idx in native.parts(rec.shape)]
        elif part_of(native) != part:
            continue
        else:
            items = [(native, StoredTensor(rec))]
        for n, st in items:
            if n in out:
                problems.append(f"tensor '{n}' is stored twice: as '{out[n].record.name}' and '{rec.name}'")
            out[n] = st
    return out


def plan_checkpoint(model_dir: str, config: DeepseekV4Config, part: str = "main") -> list:
    """Validate the checkpoint's headers against the spec and return one `TensorPlan` per spec tensor.

    Raises CheckpointError listing every problem found (missing, unexpected, shape, dtype, scales).
    """
    if part not in PARTS:
        raise ValueError(f"part must be one of {PARTS}, got {part!r}")
    specs = expected_tensors(config, part)
    qc = config.quantization_config
    block = tuple(qc.weight_block_size) if qc is not None else FP8_BLOCK
    problems: list = []
    stored = _stored_by_native(model_dir, part, problems)
    for name, st in stored.items():
        if name.endswith(".scale"):
            if name[: -len("scale")] + "weight" not in stored:
                problems.append(f"{_where(name, st)} is a '.scale' with no matching '.weight' tensor")
        elif name not in specs:
            problems.append(f"unexpected {_where(name, st)} (shape {list(st.shape)}, {st.record.dtype_name}): "
                            f"not part of the '{part}' spec for this config")
    plans, missing = [], []
    for name, spec in specs.items():
        if name not in stored:
            missing.append(f"'{name}' ({spec.describe()})")
            continue
        scale = stored.get(name[: -len("weight")] + "scale") if name.endswith(".weight") else None
        plan, err = _plan_one(name, spec, stored[name], scale, block)
        if err:
            problems.append(err)
        else:
            plans.append(plan)
    if missing:
        count = f", ... ({len(missing)} in all)" if len(missing) > _MAX_LISTED else ""
        shown = ", ".join(missing[:_MAX_LISTED]) + count
        problems.append(f"missing {len(missing)} tensor(s): {shown}")
    if problems:
        listed = "\n  - ".join(problems[:_MAX_LISTED])
        more = f"\n  ... and {len(problems) - _MAX_LISTED} more" if len(problems) > _MAX_LISTED else ""
        raise CheckpointError(f"checkpoint {model_dir} ({part}) has {len(problems)} problem(s):\n  - {listed}{more}")
    return plans


def _materialize(plan: TensorPlan, reader: TensorReader, config: DeepseekV4Config, dtype: torch.dtype,
                 block: tuple) -> torch.Tensor:
    w = reader.read(plan.weight.record, plan.weight.index)
    if plan.fmt == "index":
        t = w.to(torch.int64)
        E = config.n_routed_experts
        bad = (t < 0) | (t >= E)
        if bool(bad.any()):
            row = int(bad.nonzero()[0, 0])
            raise CheckpointError(f"tensor '{plan.name}' holds expert ids outside [0, {E}) (first at row {row}: "
                                  f"{t[row].tolist()})")
        return t
    out_dtype = torch.float32 if plan.spec.kind == TensorKind.FP32 else dtype
    if plan.fmt == "fp8":
        return dequantize_fp8_block(w, reader.read(plan.scale.record, plan.scale.index), out_dtype, block)
    if plan.fmt == "fp4":
        return dequantize_mxfp4(w, reader.read(plan.scale.record, plan.scale.index), out_dtype)
    return w.to(out_dtype)


def iter_checkpoint(model_dir: str, config: Optional[DeepseekV4Config] = None, dtype: torch.dtype = torch.float32,
                    part: str = "main", device="cpu", keep_fp8: frozenset = frozenset(),
                    keep_fp4: bool = False, keep_fp8_experts: bool = False,
                    plans: Optional[list] = None, select: Optional[Callable[[str], bool]] = None,
                    fp8: Optional[Fp8Format] = None) -> Iterator[tuple]:
    """Yield (native name, tensor) once for every tensor of `expected_tensors(config, part)`.

    Tensors are dequantized to `dtype` in their logical shape; fp32-kept tensors stay float32 and
    `tid2eid` becomes int64. Tensors of the other part are ignored. Raises CheckpointError.
    Names in `keep_fp8` (FP8 linears, see `fp8_linear_names`) are yielded as stored, e4m3, followed by
    (`<module>.weight_scale_inv`, their fp32 128x128 block multipliers). With `keep_fp4`, routed experts stored
    MXFP4 are yielded packed (uint8 [out, in/2]), followed by (`<name>_scale`, uint8 exponent bytes [out, in/32]);
    with `keep_fp8_experts`, FP8-converted experts as stored, followed by (`<name>_scale`, fp32 block multipliers).
    Kept FP8 weights come in the encoding `fp8` (default: the platform's, fp8_format): on gfx942 e4m3fnuz, the same
    bytes with their block multipliers doubled (fp8_format.to_fp8_format).
    `plans`: this part's `plan_checkpoint`, when the caller already has it. `select(name)` False: the tensor is
    skipped unread (another rank's experts).
    """
    config = config if config is not None else load_config(model_dir)
    plans = plans if plans is not None else plan_checkpoint(model_dir, config, part)
    qc = config.quantization_config
    block = tuple(qc.weight_block_size) if qc is not None else FP8_BLOCK
    fp8 = fp8 if fp8 is not None else fp8_format()
    bar = progress_bar(total=len(plans), desc=f"Loading weights ({part})", unit="tensor")  # hub loads take minutes
    with TensorReader() as reader, bar:
        for plan in plans:
            if select is not None and not select(plan.name):
                bar.update(1)
                continue
            expert_fp8 = keep_fp8_experts and plan.fmt == "fp8" and plan.spec.kind == TensorKind.EXPERT
            if plan.name in keep_fp8 or expert_fp8:
                if plan.fmt != "fp8" or block != FP8_BLOCK:
                    raise CheckpointError(f"tensor '{plan.name}' is not stored as FP8 with 128x128 blocks")
                w, scale = to_fp8_format(reader.read(plan.weight.record, plan.weight.index),
                                         scale_to_float(reader.read(plan.scale.record, plan.scale.index)), fp8)
                yield plan.name, w.to(device)
                yield (plan.name + "_scale" if expert_fp8 else plan.name[:-len("weight")] + "weight_scale_inv"), \
                    scale.to(device)
            elif keep_fp4 and plan.fmt == "fp4":
                scale = reader.read(plan.scale.record, plan.scale.index)
                if scale.dtype != torch.float8_e8m0fnu:  # float multipliers: exact powers of two, or refused
                    try:
                        scale = e8m0_encode(scale)
                    except ValueError as err:
                        raise CheckpointError(f"tensor '{plan.name}': FP4 scales that are not powers of two") from err
                yield plan.name, reader.read(plan.weight.record, plan.weight.index).view(torch.uint8).to(device)
                yield plan.name + "_scale", scale.view(torch.uint8).to(device)
            else:
                yield plan.name, _materialize(plan, reader, config, dtype, block).to(device)
            bar.update(1)


_STORED_SIZE = {"F8_E4M3": 1, "F8_E8M0": 1, "F8_E5M2": 1, "I8": 1, "U8": 1, "BF16": 2, "F16": 2, "F32": 4, "I32": 4,
                "F64": 8, "I64": 8}


def checkpoint_bytes(plans: list) -> int:
    """Bytes the planned tensors take in the checkpoint (weights and scales, as stored; headers only)."""
    return sum(math.prod(st.shape) * _STORED_SIZE.get(st.record.dtype_name, 2)
               for plan in plans for st in (plan.weight, plan.scale) if st is not None)


@dataclass(frozen=True)
class CheckpointQuantization:
    """What a checkpoint stores quantized: `linears` "fp8" or None, `experts` "fp4", "fp8" or None."""

    linears: Optional[str]
    experts: Optional[str]

    def describe(self) -> str:
        if self.linears is None and self.experts is None:
            return "none (float weights)"
        parts = [f"linears {self.linears or 'float'}", f"routed experts {self.experts or 'float'}"]
        return ("fp8" if self.linears else "experts only") + f" ({', '.join(parts)})"


def detect_quantization(model_dir: str, config: DeepseekV4Config) -> CheckpointQuantization:
    """The stored formats of the main part's linears and routed experts (from the headers only)."""
    return quantization_of(plan_checkpoint(model_dir, config, "main"))


def quantization_of(plans: list) -> CheckpointQuantization:
    linears = {p.fmt for p in plans if p.spec.kind == TensorKind.LINEAR}
    experts = {p.fmt for p in plans if p.spec.kind == TensorKind.EXPERT}
    return CheckpointQuantization("fp8" if "fp8" in linears else None,
                                  next((f for f in ("fp4", "fp8") if f in experts), None))


def fp8_linear_names(plans: list, config: DeepseekV4Config, shared_experts: bool = False,
                     pc: Optional[ParallelConfig] = None) -> frozenset:
    """Native names of the planned linears stored FP8 with 128x128 blocks that stay FP8 on a GPU: every LINEAR, the
    shared experts' only with `shared_experts` (routed experts kept quantized beside them; with bf16 routed experts
    the shared expert stays bf16, to be fusable into their grouped GEMM); under tensor parallelism (`pc`) only those
    whose rank parts are whole blocks (the rest are dequantized at load)."""
    qc = config.quantization_config
    if qc is not None and tuple(qc.weight_block_size) != FP8_BLOCK:
        return frozenset()
    pc = pc or ParallelConfig()
    return frozenset(p.name for p in plans if p.spec.kind == TensorKind.LINEAR and p.fmt == "fp8"
                     and (shared_experts or ".shared_experts." not in p.name)
                     and splits_whole_blocks(p.name, p.weight.shape, pc, FP8_BLOCK[0]))


def load_checkpoint(model_dir: str, config: Optional[DeepseekV4Config] = None, dtype: torch.dtype = torch.float32,
                    part: str = "main", device="cpu") -> dict:
    """All of `iter_checkpoint` as a dict (small models and tests)."""
    return dict(iter_checkpoint(model_dir, config, dtype, part, device))

