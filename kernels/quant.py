"""GGUF quantized weights kept as the file's blocks, and the products by them.

A ``QuantWeight`` holds one tensor of a GGUF file as it ships: ``data`` is
uint8 [out_features, row_bytes], each row the ggml blocks of one output
feature (blocks run along the input dimension, so a slice of rows is a slice
of output features: tensor parallelism splits them with ``split_rows``).

``dequantize`` is exact per ggml (the layouts of ggml-quants.c, as gguf-py's
``gguf.quants`` reads them; tests/test_quant_kernels.py holds it to gguf-py).
``quant_linear`` multiplies by the blocks: after ``prepare(w)`` (once, at
load) through the compiled int8 kernels (``quant_cpu.cpp``: activations
quantized per 32 to int8, VNNI dot products against the repacked blocks);
otherwise by dequantizing per call and a float matmul.

A type not listed in ``GGML_QUANT_TYPES`` raises ``UnsupportedQuantType``
naming it (the loader turns that into its one-line refusal).
"""
from __future__ import annotations

from dataclasses import dataclass, field

import torch

from pagedserve.kernels import quant_cpu

QK_K = 256


@dataclass(frozen=True)
class QuantType:
    name: str
    code: int  # ggml's GGMLQuantizationType value (also the compiled kernels' type code)
    block_size: int  # weights per block
    type_size: int  # bytes per block


# Block sizes and bytes as ggml defines them (gguf.constants.GGML_QUANT_SIZES).
GGML_QUANT_TYPES: dict[str, QuantType] = {t.name: t for t in (
    QuantType("Q4_0", 2, 32, 18),
    QuantType("Q4_1", 3, 32, 20),
    QuantType("Q5_0", 6, 32, 22),
    QuantType("Q5_1", 7, 32, 24),
    QuantType("Q8_0", 8, 32, 34),
    QuantType("Q4_K", 12, QK_K, 144),
    QuantType("Q6_K", 14, QK_K, 210),
)}


class UnsupportedQuantType(ValueError):
    """A GGUF tensor type these kernels do not implement."""


def quant_type(name: str) -> QuantType:
    """The type called ``name`` (ggml's spelling, e.g. "Q4_K"), or UnsupportedQuantType."""
    qt = GGML_QUANT_TYPES.get(str(name).upper())
    if qt is None:
        raise UnsupportedQuantType(
            f"GGUF tensor type {name} is not supported (supported: {', '.join(GGML_QUANT_TYPES)})")
    return qt


@dataclass
class QuantWeight:
    """One quantized [out_features, in_features] weight, the file's blocks as they are.

    ``packed`` is the compiled kernels' layout, set by ``prepare`` (None: not prepared).
    ``prepare(w, keep_blocks=False)`` drops ``data`` (None after), so the weight is held
    once; ``blocks()`` then rebuilds the file's bytes from ``packed``, exactly."""
    data: torch.Tensor | None  # uint8 [out_features, row_bytes]
    qtype: str
    shape: tuple[int, int]  # (out_features, in_features)
    packed: torch.Tensor | None = field(default=None, repr=False)
    alone: quant_cpu.Parts | None = field(default=None, repr=False, compare=False)  # packed as one part, built once

    def __post_init__(self) -> None:
        qt = quant_type(self.qtype)
        self.qtype = qt.name
        out_f, in_f = (int(s) for s in self.shape)
        self.shape = (out_f, in_f)
        if in_f <= 0 or out_f <= 0 or in_f % qt.block_size:
            raise ValueError(f"{qt.name} weight {self.shape}: in_features must be a positive multiple of "
                             f"{qt.block_size}")
        want = (out_f, in_f // qt.block_size * qt.type_size)
        if self.data is None:
            if self.packed is None:
                raise ValueError(f"{qt.name} weight {self.shape}: neither blocks nor a packed form")
        elif self.data.dtype != torch.uint8 or tuple(self.data.shape) != want:
            raise ValueError(f"{qt.name} weight {self.shape}: data must be uint8 {want}, "
                             f"got {self.data.dtype} {tuple(self.data.shape)}")

    @classmethod
    def from_bytes(cls, raw: torch.Tensor, qtype: str, shape: tuple[int, int]) -> QuantWeight:
        """From a GGUF tensor's raw bytes (any shape of uint8 holding them in order)."""
        return cls(raw.reshape(int(shape[0]), -1), qtype, shape)

    @property
    def quant(self) -> QuantType:
        return GGML_QUANT_TYPES[self.qtype]

    @property
    def nbytes(self) -> int:
        """Bytes held: the blocks and/or their packed form."""
        return sum(t.numel() for t in (self.data, self.packed) if t is not None)

    @property
    def row_bytes(self) -> int:
        return self.shape[1] // self.quant.block_size * self.quant.type_size

    def blocks(self) -> torch.Tensor:
        """The file's blocks, uint8 [out_features, row_bytes] (rebuilt from ``packed`` if dropped)."""
        if self.data is not None:
            return self.data
        return quant_cpu.unpack(self.packed, self.quant.code, *self.shape, self.row_bytes)

    def split_rows(self, start: int, end: int) -> QuantWeight:
        """Output features [start, end) (a tensor-parallel shard), unprepared."""
        if not 0 <= start < end <= self.shape[0]:
            raise ValueError(f"split_rows({start}, {end}) of {self.shape[0]} rows")
        return QuantWeight(self.blocks()[start:end].contiguous(), self.qtype, (end - start, self.shape[1]))


def from_int8_per_channel(qweight: torch.Tensor, scale: torch.Tensor) -> QuantWeight:
    """An int8 weight with one scale per output row (weight-only int8 checkpoints, or the
    weights of compressed-tensors W8A8: W = qweight * scale[:, None]) as Q8_0 blocks, each
    block carrying its row's scale, so the same kernels serve it. Exact when every scale is an
    fp16 value (bf16 scales in fp16's normal range are); otherwise a ValueError."""
    n, k = qweight.shape
    if qweight.dtype != torch.int8 or k % 32:
        raise ValueError(f"int8 weight {tuple(qweight.shape)} {qweight.dtype}: want int8 with in_features % 32 == 0")
    s = scale.reshape(-1).float()
    if s.numel() != n:
        raise ValueError(f"int8 weight of {n} rows with {s.numel()} scales: want one per output row")
    s16 = s.to(torch.float16)
    if not torch.equal(s16.float(), s):
        raise ValueError("int8 weight scales are not exact in fp16: Q8_0 blocks cannot hold them")
    d = s16.view(torch.uint8).reshape(n, 1, 2).expand(n, k // 32, 2)
    q = qweight.contiguous().view(torch.uint8).reshape(n, k // 32, 32)
    return QuantWeight(torch.cat([d, q], dim=2).reshape(n, -1), "Q8_0", (n, k))


def _f16(b: torch.Tensor) -> torch.Tensor:
    """Little-endian fp16 in the last dim's byte pairs -> float32."""
    return b.contiguous().view(torch.float16).float()


def _nibbles(qs: torch.Tensor) -> torch.Tensor:
    """[..., 16*j bytes] -> [..., 2, 16*j]: the low nibbles, then the high ones."""
    return torch.stack([qs & 0x0F, qs >> 4], dim=-2)


def _k_scales(sc: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """Q4_K's 12 bytes of 6-bit scales and mins -> ([..., 8], [..., 8]) (ggml's get_scale_min_k4)."""
    d, m, md = sc[..., 0:4], sc[..., 4:8], sc[..., 8:12]
    scale = torch.cat([d & 0x3F, (md & 0x0F) | ((d >> 2) & 0x30)], dim=-1)
    mins = torch.cat([m & 0x3F, (md >> 4) | ((m >> 2) & 0x30)], dim=-1)
    return scale.float(), mins.float()


def dequantize(w: QuantWeight) -> torch.Tensor:
    """float32 [out_features, in_features], exactly as ggml dequantizes the blocks."""
    qt = w.quant
    n, k = w.shape
    b = w.blocks().reshape(n, k // qt.block_size, qt.type_size)
    if qt.name == "Q8_0":
        out = _f16(b[..., 0:2]) * b[..., 2:].contiguous().view(torch.int8).float()
    elif qt.name == "Q4_0":
        q = _nibbles(b[..., 2:]).reshape(*b.shape[:2], 32).float()
        out = _f16(b[..., 0:2]) * (q - 8.0)
    elif qt.name == "Q4_1":
        q = _nibbles(b[..., 4:]).reshape(*b.shape[:2], 32).float()
        out = _f16(b[..., 0:2]) * q + _f16(b[..., 2:4])
    elif qt.name in ("Q5_0", "Q5_1"):
        off = 4 if qt.name == "Q5_1" else 2
        qh = b[..., off:off + 4].contiguous().view(torch.int32)  # [n, nb, 1], bit j: weight j's fifth bit
        hi = (qh >> torch.arange(32, dtype=torch.int32)) & 1
        q = (_nibbles(b[..., off + 4:]).reshape(*b.shape[:2], 32).int() | (hi << 4)).float()
        out = _f16(b[..., 0:2]) * q + _f16(b[..., 2:4]) if qt.name == "Q5_1" else _f16(b[..., 0:2]) * (q - 16.0)
    elif qt.name == "Q4_K":
        sc, mn = _k_scales(b[..., 4:16])
        d, dmin = _f16(b[..., 0:2]), _f16(b[..., 2:4])  # [n, nb, 1]
        q = _nibbles(b[..., 16:].reshape(n, -1, 4, 32)).reshape(n, -1, 8, 32).float()
        out = (d * sc).unsqueeze(-1) * q - (dmin * mn).unsqueeze(-1)
    elif qt.name == "Q6_K":
        ql, qh = b[..., 0:128].reshape(n, -1, 2, 64), b[..., 128:192].reshape(n, -1, 2, 32)
        sc = b[..., 192:208].contiguous().view(torch.int8).float()  # [n, nb, 16]
        d = _f16(b[..., 208:210])
        lo = _nibbles(ql).reshape(n, -1, 2, 4, 32)  # per 128 half: groups 0-3 of 32
        hi = torch.stack([(qh >> s) & 3 for s in (0, 2, 4, 6)], dim=-2)  # [n, nb, 2, 4, 32]
        q = (lo | (hi << 4)).float() - 32.0
        out = (d * sc).reshape(n, -1, 16, 1) * q.reshape(n, -1, 16, 16)
    else:  # pragma: no cover - GGML_QUANT_TYPES and this list agree
        raise UnsupportedQuantType(f"GGUF tensor type {qt.name} has no dequantizer")
    return out.reshape(n, k)


def prepare(w: QuantWeight, keep_blocks: bool = True) -> QuantWeight:
    """Repacks ``w`` once for the compiled kernels (``w.packed``), where they are built;
    without them ``quant_linear`` dequantizes per call. ``keep_blocks=False`` then drops
    ``w.data`` (the packed form is the same bytes reordered; ``blocks()`` rebuilds them).
    Returns ``w``."""
    if w.packed is None:
        w.packed = quant_cpu.repack(w.blocks(), w.qtype, w.quant.code, *w.shape)
    if w.packed is not None and not keep_blocks:
        w.data = None
    return w


def quant_linear(x: torch.Tensor, w: QuantWeight, bias: torch.Tensor | None = None) -> torch.Tensor:
    """x [M, in_features] (float32 or bfloat16) @ W.T (+ bias): [M, out_features] in x's dtype."""
    if w.packed is not None:
        if w.alone is None:
            w.alone = packed_parts([w])
        y = quant_cpu.linear_parts(x, w.alone, bias)  # type: ignore[arg-type]
        if y is not None:
            return y
    if x.shape[-1] != w.shape[1]:
        raise ValueError(f"quant_linear: x has {x.shape[-1]} features, the weight {w.shape[1]}")
    wd = dequantize(w).to(device=x.device)
    y = x.float() @ wd.T
    if bias is not None:
        y = y + bias.float()
    return y.to(x.dtype)


def packed_parts(ws: list[QuantWeight]) -> quant_cpu.Parts | None:
    """The compiled kernels' view of weights side by side (all of one in_features), or None
    where one of them is not prepared."""
    if not ws or any(w.packed is None for w in ws) or len({w.shape[1] for w in ws}) != 1:
        return None
    return quant_cpu.Parts([w.packed for w in ws], [w.quant.code for w in ws],  # type: ignore[misc]
                           [w.shape[0] for w in ws], ws[0].shape[1])


def quant_linear_parts(x: torch.Tensor, ws: list[QuantWeight], bias: torch.Tensor | None,
                       parts: quant_cpu.Parts | None) -> torch.Tensor:
    """x @ [W_0; W_1; ...].T (+ bias): the outputs of weights side by side (q/k/v of different
    types, as Q4_K_M has them), by ``parts`` (``packed_parts(ws)``) where the kernels run,
    otherwise part by part, each with its slice of the bias."""
    if parts is not None:
        y = quant_cpu.linear_parts(x, parts, bias)
        if y is not None:
            return y
    if len(ws) == 1:
        return quant_linear(x, ws[0], bias)
    outs, off = [], 0
    for w in ws:
        outs.append(quant_linear(x, w, None if bias is None else bias[off : off + w.shape[0]]))
        off += w.shape[0]
    return torch.cat(outs, dim=-1)
