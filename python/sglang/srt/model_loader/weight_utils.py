"""Reading (and writing) safetensors checkpoint directories.

A directory holds either `model.safetensors.index.json` (sharded: every listed shard must exist and
hold every tensor listed for it) or one or more `*.safetensors` files. Tensors are read lazily through
`safetensors.safe_open`; only headers are read until a tensor's data is asked for.
"""

from __future__ import annotations

import json
import os
from contextlib import ExitStack
from dataclasses import dataclass
from typing import Optional

import torch
from safetensors import safe_open
from safetensors.torch import save_file

INDEX_FILE = "model.safetensors.index.json"

# safetensors header dtype strings -> torch dtypes.
SAFETENSORS_DTYPES = {
    "F64": torch.float64, "F32": torch.float32, "F16": torch.float16, "BF16": torch.bfloat16,
    "F8_E4M3": torch.float8_e4m3fn, "F8_E5M2": torch.float8_e5m2, "F8_E8M0": torch.float8_e8m0fnu,
    "I64": torch.int64, "I32": torch.int32, "I16": torch.int16, "I8": torch.int8, "U8": torch.uint8,
    "BOOL": torch.bool,
}


class CheckpointError(ValueError):
    """A checkpoint directory or tensor is missing, misnamed, mis-shaped or of the wrong dtype.

    Defined here (the lowest layer) and re-exported by `loader`; the message names the tensor or file.
    """


@dataclass(frozen=True)
class TensorRecord:
    """Header facts of one stored tensor: enough to validate without reading its data."""

    name: str
    file: str  # absolute path of the .safetensors file
    shape: tuple
    dtype: Optional[torch.dtype]  # None when safetensors reports a dtype torch lacks here
    dtype_name: str  # as stored, e.g. "F8_E4M3"


def _shard_map(model_dir: str) -> dict:
    """name -> shard path, from the index or by scanning the directory."""
    if not os.path.isdir(model_dir):
        raise CheckpointError(f"checkpoint directory {model_dir} does not exist")
    index_path = os.path.join(model_dir, INDEX_FILE)
    if os.path.exists(index_path):
        try:
            with open(index_path) as f:
                weight_map = json.load(f)["weight_map"]
        except (json.JSONDecodeError, KeyError, TypeError) as e:
            raise CheckpointError(f"{index_path} is not a valid index (needs a 'weight_map'): {e}") from None
        missing = sorted({s for s in weight_map.values() if not os.path.exists(os.path.join(model_dir, s))})
        if missing:
            raise CheckpointError(f"shard(s) listed in {INDEX_FILE} are absent from {model_dir}: {missing}")
        return {name: os.path.join(model_dir, shard) for name, shard in weight_map.items()}
    files = sorted(f for f in os.listdir(model_dir) if f.endswith(".safetensors"))
    if not files:
        raise CheckpointError(f"no *.safetensors files (and no {INDEX_FILE}) in {model_dir}")
    out = {}
    for fname in files:
        path = os.path.join(model_dir, fname)
        with safe_open(path, framework="pt") as f:
            for name in f.keys():
                if name in out:
                    raise CheckpointError(f"tensor '{name}' is stored twice: in {os.path.basename(out[name])} "
                                          f"and {fname}")
                out[name] = path
    return out


def list_tensors(model_dir: str) -> list:
    """`TensorRecord`s of every tensor of the checkpoint (index order or sorted file order)."""
    shard_of = _shard_map(model_dir)
    by_file: dict = {}
    for name, path in shard_of.items():
        by_file.setdefault(path, []).append(name)
    records = {}
    for path, names in by_file.items():
        with safe_open(path, framework="pt") as f:
            present = set(f.keys())
            absent = [n for n in names if n not in present]
            if absent:
                raise CheckpointError(f"tensor(s) {absent[:5]} listed in {INDEX_FILE} for shard "
                                      f"{os.path.basename(path)} are not in that shard")
            for name in names:
                sl = f.get_slice(name)
                dname = sl.get_dtype()
                records[name] = TensorRecord(name, path, tuple(sl.get_shape()), SAFETENSORS_DTYPES.get(dname), dname)
    return [records[n] for n in shard_of]


class TensorReader:
    """Keeps shard files open while tensors (or slices of them) are read by name."""

    def __init__(self) -> None:
        self._stack = ExitStack()
        self._open: dict = {}

    def __enter__(self) -> "TensorReader":
        return self

    def __exit__(self, *exc) -> None:
        self._stack.close()

    def read(self, record: TensorRecord, index: Optional[tuple] = None) -> torch.Tensor:
        f = self._open.get(record.file)
        if f is None:
            f = self._open[record.file] = self._stack.enter_context(safe_open(record.file, framework="pt"))
        if index is None:
            return f.get_tensor(record.name)
        return f.get_slice(record.name)[index]


def save_streaming(out_dir: str, tensors, shard_bytes: int, metadata: Optional[dict] = None) -> list:
    """Write (name, tensor) pairs as they come, a shard each time `shard_bytes` have gathered (host memory holds one
    shard, not the checkpoint), then the index; one file when it all fits one shard. Returns the file names."""
    os.makedirs(out_dir, exist_ok=True)
    meta = {"format": "pt", **(metadata or {})}
    parts, shard, size, total, weight_map = [], {}, 0, 0, {}

    def flush() -> None:
        nonlocal shard, size
        part = os.path.join(out_dir, f".part-{len(parts):05d}.safetensors")
        save_file(shard, part, metadata=meta)
        parts.append((part, list(shard)))
        shard, size = {}, 0

    for name, t in tensors:
        shard[name] = t.contiguous()
        size += t.numel() * t.element_size()
        total += t.numel() * t.element_size()
        if size >= shard_bytes:
            flush()
    if shard or not parts:
        flush()
    if len(parts) == 1:
        os.replace(parts[0][0], os.path.join(out_dir, "model.safetensors"))
        return ["model.safetensors"]
    files = []
    for k, (part, names) in enumerate(parts):
        fname = f"model-{k + 1:05d}-of-{len(parts):05d}.safetensors"
        os.replace(part, os.path.join(out_dir, fname))
        files.append(fname)
        weight_map.update({n: fname for n in names})
    with open(os.path.join(out_dir, INDEX_FILE), "w") as f:
        json.dump({"metadata": {"total_size": total}, "weight_map": weight_map}, f, indent=2)
        f.write("\n")
    return files


def save_sharded(out_dir: str, tensors: dict, num_shards: int = 1, metadata: Optional[dict] = None) -> list:
    """Write `tensors` (name -> tensor, in the given order) as one file or `num_shards` shards + index.

    Shards are contiguous runs of (nearly) equal tensor count. Returns the file names written.
    """
    os.makedirs(out_dir, exist_ok=True)
    meta = {"format": "pt", **(metadata or {})}
    tensors = {k: v.contiguous() for k, v in tensors.items()}
    if num_shards <= 1:
        save_file(tensors, os.path.join(out_dir, "model.safetensors"), metadata=meta)
        return ["model.safetensors"]
    names = list(tensors)
    if num_shards > len(names):
        raise ValueError(f"num_shards={num_shards} exceeds the number of tensors ({len(names)})")
    bounds = [len(names) * k // num_shards for k in range(num_shards + 1)]
    groups = [names[bounds[k]: bounds[k + 1]] for k in range(num_shards)]
    total = sum(t.numel() * t.element_size() for t in tensors.values())
    files, weight_map = [], {}
    for k, grp in enumerate(groups):
        fname = f"model-{k + 1:05d}-of-{num_shards:05d}.safetensors"
        save_file({n: tensors[n] for n in grp}, os.path.join(out_dir, fname), metadata=meta)
        files.append(fname)
        weight_map.update({n: fname for n in grp})
    index = {"metadata": {"total_size": total}, "weight_map": weight_map}
    with open(os.path.join(out_dir, INDEX_FILE), "w") as f:
        json.dump(index, f, indent=2)
        f.write("\n")
    return files
