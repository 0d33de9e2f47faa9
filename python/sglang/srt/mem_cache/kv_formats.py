"""Per-entry storage formats of the DeepSeek-V4 cache pools.

A pool buffer holds one row per cache entry (a `dim`-float vector: a window/compressed KV entry or an indexer key).
An `EntryFormat` names the row layout it stores (`kernel_format`, one of sgl_kernel.dsv4_formats_ref.ROW_FORMATS:
the layouts the Triton kernels read and write) and encodes through that module's torch functions, the one
definition of every byte layout: `quantize` maps values [..., dim] to rows, `dequantize` maps rows back to
float32, and `store` / `load` scatter / gather rows by slot. Formats (docs/dsv4-architecture.md 9.4,
upstream-sglang-dsv4-survey.md 2.1):

* `DenseFormat`        - the compute dtype as-is (bf16 entry = 1024 B for dim 512).
* `Fp8KVFormat`        - "MODEL1_FP8Sparse": e4m3 nope in blocks of 64 with ue8m0 scales, bf16 rope; 584 B for
                         dim 512 / rope 64. Bit-exact with the reference's QAT simulation (arch 5.2), so
                         `round_trip` is that simulation.
* `Fp8IndexKeyFormat`  - e4m3 with one fp32 scale per 128 values (132 B for dim 128).
* `Fp4IndexKeyFormat`  - e2m1 packed in nibbles with one ue8m0 scale per 32 (68 B).

Everything is vectorised torch with no host syncs, so it runs inside CUDA graphs.
"""

from __future__ import annotations

from abc import ABC, abstractmethod
from dataclasses import dataclass

import torch
from sgl_kernel.dsv4_formats_ref import (
    FLOAT_DTYPES, FP4_BLOCK, FP8_INDEX_BLOCK, FP8_KV_BLOCK, dequantize_ref, layout_error, quantize_ref, row_width)

from sglang.srt.server_args import KV_CACHE_DTYPES

# ----------------------------------------------------------------------------- base


class EntryFormat(ABC):
    """Encoding of one `dim`-float cache entry as one row of a pool buffer (subclasses are frozen dataclasses)."""

    dim: int

    @property
    @abstractmethod
    def name(self) -> str:
        """The format as the flags name it (logs, budgets)."""

    @property
    @abstractmethod
    def kernel_format(self) -> str:
        """The row layout, as the kernels and sgl_kernel.dsv4_formats_ref name it."""

    @property
    def fp8_rope_dim(self) -> int:
        """Trailing dims kept bf16 in an fp8_kv row (the kernels' `fp8_rope_dim`); 0 for every other layout."""
        return 0

    @property
    def storage_dtype(self) -> torch.dtype:
        return torch.uint8

    @property
    def row_width(self) -> int:
        """Last dim of the buffer (elements of `storage_dtype` per entry)."""
        return row_width(self.kernel_format, self.dim, self.fp8_rope_dim, self.storage_dtype)

    @property
    def bytes_per_entry(self) -> int:
        """Storage bytes of one entry (row width in bytes, padding included)."""
        return self.row_width * self.storage_dtype.itemsize

    def __post_init__(self) -> None:
        err = layout_error(self.kernel_format, self.dim, self.fp8_rope_dim)
        if err is not None:
            raise ValueError(f"{type(self).__name__}: {err}")

    def quantize(self, values: torch.Tensor) -> torch.Tensor:
        """[..., dim] floats -> [..., row_width] rows of `storage_dtype`."""
        return quantize_ref(values, self.kernel_format, self.fp8_rope_dim, self.storage_dtype)

    def dequantize(self, rows: torch.Tensor) -> torch.Tensor:
        """[..., row_width] rows -> [..., dim] float32."""
        return dequantize_ref(rows, self.kernel_format, self.dim, self.fp8_rope_dim)

    def allocate(self, num_entries: int, device: torch.device | str | None = None) -> torch.Tensor:
        return torch.zeros(num_entries, self.row_width, dtype=self.storage_dtype, device=device)

    def store(self, buf: torch.Tensor, slots: torch.Tensor, values: torch.Tensor) -> None:
        """Quantize `values` [N, dim] and write them to rows `slots` [N] of `buf`."""
        if values.shape[-1] != self.dim:
            raise ValueError(f"{self.name}: values last dim {values.shape[-1]} != dim {self.dim}")
        buf.index_copy_(0, slots.reshape(-1), self.quantize(values.reshape(-1, self.dim)))

    def load(self, buf: torch.Tensor, slots: torch.Tensor) -> torch.Tensor:
        """Gather rows `slots` (any shape, non-negative) -> [*slots.shape, dim] float32."""
        rows = buf.index_select(0, slots.reshape(-1))
        return self.dequantize(rows).reshape(*slots.shape, self.dim)

    def round_trip(self, values: torch.Tensor) -> torch.Tensor:
        """What a store + load returns (the QAT "simulate" step), as float32."""
        return self.dequantize(self.quantize(values))


# ----------------------------------------------------------------------------- formats

_DENSE_NAMES = {dtype: str(dtype).removeprefix("torch.") for dtype in FLOAT_DTYPES}  # float32, bfloat16, float16


@dataclass(frozen=True)
class DenseFormat(EntryFormat):
    """Unquantized entries in `dtype` (the "auto"/bf16 cache and the exact indexer)."""

    dim: int
    dtype: torch.dtype = torch.bfloat16
    kernel_format = "dense"

    def __post_init__(self):
        if self.dtype not in _DENSE_NAMES:
            raise ValueError(f"DenseFormat: dtype {self.dtype} not in {list(_DENSE_NAMES)}")
        super().__post_init__()

    @property
    def name(self) -> str:
        return _DENSE_NAMES[self.dtype]

    @property
    def storage_dtype(self) -> torch.dtype:
        return self.dtype


@dataclass(frozen=True)
class Fp8KVFormat(EntryFormat):
    """Main KV "MODEL1_FP8Sparse": row = [nope e4m3 | rope bf16 | ue8m0 scale/64 | pad to 8].

    nope = dim - rope_dim values are scaled per 64-block by s = 2^ceil(log2(max(amax, 1e-4)/448)) (the
    reference's floor keeps all-zero blocks finite); rope stays bf16.
    """

    dim: int
    rope_dim: int
    name = "fp8_e4m3"
    kernel_format = "fp8_kv"
    block = FP8_KV_BLOCK

    @property
    def fp8_rope_dim(self) -> int:
        return self.rope_dim

    @property
    def nope_dim(self) -> int:
        return self.dim - self.rope_dim

    @property
    def num_blocks(self) -> int:
        return self.nope_dim // self.block

    @property
    def scale_offset(self) -> int:  # byte offset of the scales in a row (after e4m3 nope and bf16 rope)
        return self.nope_dim + 2 * self.rope_dim


@dataclass(frozen=True)
class Fp8IndexKeyFormat(EntryFormat):
    """Indexer keys as e4m3 with one fp32 scale (amax/448) per 128 values: [e4m3 | fp32 scales].

    A partial last block is zero-padded for the amax only; all-zero blocks store scale 1.
    """

    dim: int
    name = "fp8"
    kernel_format = "fp8_index"
    block = FP8_INDEX_BLOCK

    @property
    def num_blocks(self) -> int:
        return -(-self.dim // self.block)


@dataclass(frozen=True)
class Fp4IndexKeyFormat(EntryFormat):
    """Indexer keys as e2m1, two per byte (low nibble = even index), one ue8m0 scale per 32.

    Row = [dim/2 packed codes | dim/32 scale bytes]; s = 2^ceil(log2(amax/6)), values rounded to the nearest
    e2m1 code. The Hadamard rotation (arch 5.5) is the caller's job: rotate keys before `store` and queries
    before scoring.
    """

    dim: int
    name = "fp4"
    kernel_format = "fp4_index"
    block = FP4_BLOCK

    @property
    def num_blocks(self) -> int:
        return self.dim // self.block


# ----------------------------------------------------------------------------- factories

INDEX_KEY_KINDS = ("auto", "exact", "fp8", "fp4")


def make_kv_format(kv_cache_dtype: str, dim: int, rope_dim: int, compute_dtype: torch.dtype) -> EntryFormat:
    """Main KV format from `--kv-cache-dtype` (one of server_args.KV_CACHE_DTYPES; "auto" = the compute dtype)."""
    if kv_cache_dtype == "auto":
        return DenseFormat(dim, compute_dtype)
    if kv_cache_dtype == "bfloat16":
        return DenseFormat(dim, torch.bfloat16)
    if kv_cache_dtype == "float32":
        return DenseFormat(dim, torch.float32)
    if kv_cache_dtype == "fp8_e4m3":
        return Fp8KVFormat(dim, rope_dim)
    raise ValueError(f"unknown kv_cache_dtype {kv_cache_dtype!r}; allowed: {', '.join(KV_CACHE_DTYPES)}")


def index_key_kind(kv_cache_dtype: str, fp4_indexer: bool) -> str:
    """Index keys: FP4 with --enable-deepseek-v4-fp4-indexer, FP8 with an FP8 KV cache, else unquantized."""
    return "fp4" if fp4_indexer else "fp8" if kv_cache_dtype == "fp8_e4m3" else "auto"


def make_index_key_format(kind: str, dim: int, compute_dtype: torch.dtype) -> EntryFormat:
    """Indexer key format ("auto"/"exact" = unquantized in the compute dtype)."""
    if kind in ("auto", "exact"):
        return DenseFormat(dim, compute_dtype)
    quantized = {"fp8": Fp8IndexKeyFormat, "fp4": Fp4IndexKeyFormat}.get(kind)
    if quantized is None:
        raise ValueError(f"unknown index key format {kind!r}; allowed: {', '.join(INDEX_KEY_KINDS)}")
    return quantized(dim)
