"""Per-entry storage formats of the DeepSeek-V4 cache pools.

A pool buffer holds one row per cache entry (a `dim`-float vector: a window/compressed KV
entry or an indexer key). An `EntryFormat` says how that vector is encoded in the row:
`quantize` maps values [N, dim] to rows, `dequantize` maps rows back to float32, and
`store` / `load` scatter / gather rows by slot. Formats (docs/dsv4-architecture.md 9.4,
upstream-sglang-dsv4-survey.md 2.1):

* `DenseFormat`        - the compute dtype as-is (bf16 entry = 1024 B for dim 512).
* `Fp8KVFormat`        - "MODEL1_FP8Sparse": e4m3 nope in blocks of 64 with ue8m0 scales,
                         bf16 rope; 584 B for dim 512 / rope 64. Bit-exact with the
                         reference's QAT simulation (arch 5.2), so `round_trip` is that
                         simulation.
* `Fp8IndexKeyFormat`  - e4m3 with one fp32 scale per 128 values (132 B for dim 128).
* `Fp4IndexKeyFormat`  - e2m1 packed in nibbles with one ue8m0 scale per 32 (68 B).

Everything is vectorised torch with no host syncs, so it runs inside CUDA graphs; fused
kernels may replace it later but must keep these byte layouts.
"""

from __future__ import annotations

import math
from abc import ABC, abstractmethod
from dataclasses import dataclass

import torch

FP8_MAX = 448.0  # largest finite float8_e4m3fn
FP4_MAX = 6.0  # largest e2m1 magnitude
# e8m0 byte b encodes 2^(b - 127). Exponents are kept in [-126, 126] so that both 2^e and
# 2^-e are normal fp32 (exact via bit construction); byte 0 (an unwritten row) decodes to 0.
UE8M0_BIAS = 127
_E_MIN, _E_MAX = -126, 126


# ----------------------------------------------------------------------------- helpers


def _ue8m0_exponent(amax: torch.Tensor, qmax: float) -> torch.Tensor:
    """Exact ceil(log2(amax / qmax)) as int32: the smallest e with amax <= qmax * 2^e.

    Done on frexp mantissas instead of log2/division so CPU and CUDA agree bit for bit
    (CUDA divides by a scalar through its reciprocal and log2f is not exact).
    """
    mq, eq = math.frexp(qmax)  # qmax = mq * 2^eq, mq in [0.5, 1)
    m, e = torch.frexp(amax)
    e = e - eq + (m > mq).to(e.dtype)
    return e.clamp(_E_MIN, _E_MAX).to(torch.int32)


def _pow2(e: torch.Tensor) -> torch.Tensor:
    """2^e as fp32 for int e in [-126, 127], built from the exponent bits (exact everywhere)."""
    return ((e.to(torch.int32) + UE8M0_BIAS) << 23).view(torch.float32)


def _exp_to_byte(e: torch.Tensor) -> torch.Tensor:
    return (e + UE8M0_BIAS).to(torch.uint8)


def _byte_to_scale(b: torch.Tensor) -> torch.Tensor:
    return (b.to(torch.int32) << 23).view(torch.float32)


def _as_bytes(x: torch.Tensor) -> torch.Tensor:
    """Reinterpret the last dim of a contiguous tensor as uint8 (itemsize x wider)."""
    return x.contiguous().view(torch.uint8)


def _from_bytes(rows: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    """Reinterpret a byte slice (last dim) as `dtype`; the copy makes it aligned."""
    return rows.contiguous().view(dtype)


def _to_e4m3(x: torch.Tensor) -> torch.Tensor:
    # torch's cast does not saturate (out-of-range -> NaN), so clamp first.
    return x.clamp(-FP8_MAX, FP8_MAX).to(torch.float8_e4m3fn)


def _e2m1_encode(v: torch.Tensor) -> torch.Tensor:
    """Round scaled values to the nearest e2m1 code (ties to even code); uint8 in 0..15."""
    mag = v.abs().clamp(max=FP4_MAX)
    # Grid spacing: 0.5 on [0, 2) (subnormals + first binade), 1 on [2, 4), 2 on [4, 6].
    step = torch.where(mag < 2, 0.5, torch.where(mag < 4, 1.0, 2.0))
    q = torch.round(mag / step) * step  # round() is half-to-even == even code on ties
    code = torch.where(q < 2, q * 2, torch.where(q < 4, q + 2, q / 2 + 4))
    sign = (v < 0).to(torch.uint8) << 3
    return code.to(torch.uint8) | sign


def _e2m1_decode(code: torch.Tensor) -> torch.Tensor:
    m = (code & 7).to(torch.int32)
    e, mant = m >> 1, (m & 1).to(torch.float32)
    mag = torch.where(e == 0, 0.5 * mant, (1 << (e - 1).clamp_min(0)).to(torch.float32) * (1 + 0.5 * mant))
    return torch.where((code & 8) != 0, -mag, mag)


# ----------------------------------------------------------------------------- base


class EntryFormat(ABC):
    """Encoding of one `dim`-float cache entry as one row of a pool buffer."""

    dim: int

    @property
    @abstractmethod
    def name(self) -> str: ...

    @property
    @abstractmethod
    def bytes_per_entry(self) -> int:
        """Storage bytes of one entry (row width in bytes, padding included)."""

    @property
    def storage_dtype(self) -> torch.dtype:
        return torch.uint8

    @property
    def row_width(self) -> int:
        """Last dim of the buffer (elements of `storage_dtype` per entry)."""
        return self.bytes_per_entry // torch.empty((), dtype=self.storage_dtype).element_size()

    @abstractmethod
    def quantize(self, values: torch.Tensor) -> torch.Tensor:
        """[..., dim] floats -> [..., row_width] rows of `storage_dtype`."""

    @abstractmethod
    def dequantize(self, rows: torch.Tensor) -> torch.Tensor:
        """[..., row_width] rows -> [..., dim] float32."""

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

_DENSE_DTYPES = {torch.float32: "float32", torch.bfloat16: "bfloat16", torch.float16: "float16"}


@dataclass(frozen=True)
class DenseFormat(EntryFormat):
    """Unquantized entries in `dtype` (the "auto"/bf16 cache and the exact indexer)."""

    dim: int
    dtype: torch.dtype = torch.bfloat16

    def __post_init__(self):
        if self.dtype not in _DENSE_DTYPES:
            raise ValueError(f"DenseFormat: dtype {self.dtype} not in {list(_DENSE_DTYPES)}")

    @property
    def name(self) -> str:
        return _DENSE_DTYPES[self.dtype]

    @property
    def storage_dtype(self) -> torch.dtype:
        return self.dtype

    @property
    def bytes_per_entry(self) -> int:
        return self.dim * torch.empty((), dtype=self.dtype).element_size()

    def quantize(self, values: torch.Tensor) -> torch.Tensor:
        return values.to(self.dtype)

    def dequantize(self, rows: torch.Tensor) -> torch.Tensor:
        return rows.to(torch.float32)


@dataclass(frozen=True)
class Fp8KVFormat(EntryFormat):
    """Main KV "MODEL1_FP8Sparse": row = [nope e4m3 | rope bf16 | ue8m0 scale/64 | pad to 8].

    nope = dim - rope_dim values are scaled per 64-block by s = 2^ceil(log2(max(amax,
    1e-4)/448)) (the reference's floor keeps all-zero blocks finite); rope stays bf16.
    """

    dim: int
    rope_dim: int
    block: int = 64
    amax_floor: float = 1e-4

    def __post_init__(self):
        if self.rope_dim < 0 or self.nope_dim <= 0 or self.nope_dim % self.block:
            raise ValueError(
                f"Fp8KVFormat: nope dim (dim - rope_dim = {self.dim} - {self.rope_dim} = "
                f"{self.nope_dim}) must be a positive multiple of {self.block}"
            )

    @property
    def name(self) -> str:
        return "fp8_e4m3"

    @property
    def nope_dim(self) -> int:
        return self.dim - self.rope_dim

    @property
    def num_blocks(self) -> int:
        return self.nope_dim // self.block

    # Byte offsets inside a row (exposed for kernels that read the buffer directly).
    @property
    def rope_offset(self) -> int:
        return self.nope_dim

    @property
    def scale_offset(self) -> int:
        return self.nope_dim + 2 * self.rope_dim

    @property
    def bytes_per_entry(self) -> int:
        return -(-(self.scale_offset + self.num_blocks) // 8) * 8

    def quantize(self, values: torch.Tensor) -> torch.Tensor:
        x = values.to(torch.float32)
        lead = x.shape[:-1]
        nope = x[..., : self.nope_dim].reshape(*lead, self.num_blocks, self.block)
        amax = nope.abs().amax(-1, keepdim=True).clamp_min(self.amax_floor)
        e = _ue8m0_exponent(amax, FP8_MAX)
        q = _to_e4m3(nope * _pow2(-e))
        pad = self.bytes_per_entry - self.scale_offset - self.num_blocks
        parts = [
            _as_bytes(q).reshape(*lead, self.nope_dim),
            _as_bytes(x[..., self.nope_dim :].to(torch.bfloat16)),
            _exp_to_byte(e).reshape(*lead, self.num_blocks),
            torch.zeros(*lead, pad, dtype=torch.uint8, device=x.device),
        ]
        return torch.cat(parts, dim=-1)

    def dequantize(self, rows: torch.Tensor) -> torch.Tensor:
        lead = rows.shape[:-1]
        q = _from_bytes(rows[..., : self.nope_dim], torch.float8_e4m3fn).to(torch.float32)
        s = _byte_to_scale(rows[..., self.scale_offset : self.scale_offset + self.num_blocks])
        nope = (q.view(*lead, self.num_blocks, self.block) * s.unsqueeze(-1)).view(*lead, self.nope_dim)
        rope = _from_bytes(rows[..., self.rope_offset : self.scale_offset], torch.bfloat16)
        return torch.cat([nope, rope.to(torch.float32)], dim=-1)


@dataclass(frozen=True)
class Fp8IndexKeyFormat(EntryFormat):
    """Indexer keys as e4m3 with one fp32 scale (amax/448) per 128 values: [e4m3 | fp32 scales].

    A partial last block is zero-padded for the amax only; all-zero blocks store scale 1.
    """

    dim: int
    block: int = 128

    def __post_init__(self):
        if self.dim <= 0:
            raise ValueError(f"Fp8IndexKeyFormat: dim must be positive, got {self.dim}")

    @property
    def name(self) -> str:
        return "fp8"

    @property
    def num_blocks(self) -> int:
        return -(-self.dim // self.block)

    @property
    def bytes_per_entry(self) -> int:
        return self.dim + 4 * self.num_blocks

    def _blocks(self, x: torch.Tensor) -> torch.Tensor:
        pad = self.num_blocks * self.block - self.dim
        if pad:
            x = torch.nn.functional.pad(x, (0, pad))
        return x.reshape(*x.shape[:-1], self.num_blocks, self.block)

    def quantize(self, values: torch.Tensor) -> torch.Tensor:
        x = values.to(torch.float32)
        lead = x.shape[:-1]
        blocks = self._blocks(x)
        amax = blocks.abs().amax(-1, keepdim=True)
        # tensor / tensor: correctly rounded on CPU and CUDA alike (a scalar divisor is not on CUDA)
        scale = amax / torch.full_like(amax, FP8_MAX)
        scale = torch.where(scale > 0, scale, torch.ones_like(scale))
        q = _to_e4m3(blocks / scale).reshape(*lead, -1)[..., : self.dim]
        return torch.cat([_as_bytes(q), _as_bytes(scale.squeeze(-1))], dim=-1)

    def dequantize(self, rows: torch.Tensor) -> torch.Tensor:
        q = _from_bytes(rows[..., : self.dim], torch.float8_e4m3fn).to(torch.float32)
        scale = _from_bytes(rows[..., self.dim : self.bytes_per_entry], torch.float32)
        blocks = self._blocks(q) * scale.unsqueeze(-1)
        return blocks.reshape(*rows.shape[:-1], self.num_blocks * self.block)[..., : self.dim]


@dataclass(frozen=True)
class Fp4IndexKeyFormat(EntryFormat):
    """Indexer keys as e2m1, two per byte (low nibble = even index), one ue8m0 scale per 32.

    Row = [dim/2 packed codes | dim/32 scale bytes]; s = 2^ceil(log2(amax/6)), values
    rounded to the nearest e2m1 code. The Hadamard rotation (arch 5.5) is the caller's job:
    rotate keys before `store` and queries before scoring.
    """

    dim: int
    block: int = 32

    def __post_init__(self):
        if self.dim <= 0 or self.dim % self.block:
            raise ValueError(f"Fp4IndexKeyFormat: dim {self.dim} must be a positive multiple of {self.block}")

    @property
    def name(self) -> str:
        return "fp4"

    @property
    def num_blocks(self) -> int:
        return self.dim // self.block

    @property
    def bytes_per_entry(self) -> int:
        return self.dim // 2 + self.num_blocks

    def quantize(self, values: torch.Tensor) -> torch.Tensor:
        x = values.to(torch.float32)
        lead = x.shape[:-1]
        blocks = x.reshape(*lead, self.num_blocks, self.block)
        # tiny floor: an all-zero block gets the smallest scale and all-zero codes.
        amax = blocks.abs().amax(-1, keepdim=True).clamp_min(torch.finfo(torch.float32).tiny)
        e = _ue8m0_exponent(amax, FP4_MAX)
        codes = _e2m1_encode(blocks * _pow2(-e)).reshape(*lead, self.dim // 2, 2)
        packed = codes[..., 0] | (codes[..., 1] << 4)
        return torch.cat([packed, _exp_to_byte(e).reshape(*lead, self.num_blocks)], dim=-1)

    def dequantize(self, rows: torch.Tensor) -> torch.Tensor:
        lead = rows.shape[:-1]
        packed = rows[..., : self.dim // 2]
        codes = torch.stack([packed & 15, packed >> 4], dim=-1)
        vals = _e2m1_decode(codes).view(*lead, self.num_blocks, self.block)
        s = _byte_to_scale(rows[..., self.dim // 2 :])
        return (vals * s.unsqueeze(-1)).view(*lead, self.dim)


# ----------------------------------------------------------------------------- factories

KV_CACHE_DTYPES = ("auto", "bfloat16", "float32", "fp8_e4m3")
INDEX_KEY_KINDS = ("auto", "exact", "fp8", "fp4")


def make_kv_format(kv_cache_dtype: str, dim: int, rope_dim: int, compute_dtype: torch.dtype) -> EntryFormat:
    """Main KV format from `--kv-cache-dtype` ("auto" = the model's compute dtype)."""
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
    if kind == "fp8":
        return Fp8IndexKeyFormat(dim)
    if kind == "fp4":
        return Fp4IndexKeyFormat(dim)
    raise ValueError(f"unknown index key format {kind!r}; allowed: {', '.join(INDEX_KEY_KINDS)}")
