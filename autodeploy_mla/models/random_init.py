"""Seeded random weights of which any slice can be made alone (`model.init: hashed`).

transformers initialises a random-weight model from one RNG stream: the value of an element depends
on every tensor drawn before it, so a tensor-parallel rank that wants only its slices must still
build (and hold) the whole model. That is fine for the tiny test configs and impossible for the
published DeepSeek-V2 config (236 B parameters) on one GPU.

Here every element is a function of (seed, weight name, flat index in the full tensor): a 32-bit
integer hash, turned into a uniform value with the standard deviation of the HF init
(`initializer_range`). Norm weights are ones and biases zeros, as HF initialises them. So:

- a rank generates exactly its slices, on its device, in chunks (no full tensor exists anywhere);
- the slices of all ranks put together are the weights a single process generates, so a sharded
  model can be compared token for token with the unsharded one and with HF eager on the same
  weights (`materialize` fills a full model);
- CPU and CUDA generate the same bits (integer ops; the float comes from 24 exact bits).

The values are uniform, not normal: for benchmarks and tests only the scale matters.
"""

from __future__ import annotations

import math
import zlib
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from typing import Literal, Optional

import torch
from torch import nn

InitKind = Literal["random", "ones", "zeros"]
Range = tuple[int, int]
Selection = tuple[Optional[tuple[Range, ...]], ...]  # per dim: None (all) or index ranges, concatenated

_MASK32 = 0xFFFFFFFF
_MUL = 0x45D9F3B  # < 2**27: a 32-bit value times it stays below 2**63 (no int64 overflow)
_CHUNK = 1 << 25  # elements generated at once (int64 temporaries of 256 MiB)


def _mix32(x: torch.Tensor) -> torch.Tensor:
    """A 32-bit integer hash (two multiply-xorshift rounds) of int64 values in [0, 2**32)."""
    x = ((x >> 16) ^ x) * _MUL & _MASK32
    x = ((x >> 16) ^ x) * _MUL & _MASK32
    return (x >> 16) ^ x


def init_kind(module: nn.Module, attr: str) -> InitKind:
    """How HF initialises parameter `attr` of `module`: biases zeros, norm weights ones, else random."""
    if attr == "bias" or attr.endswith("_bias"):
        return "zeros"
    if "norm" in type(module).__name__.lower():
        return "ones"
    return "random"


@dataclass(frozen=True)
class HashedInit:
    """Per-element seeded weights (module doc). `kinds`: parameter name -> how it is initialised
    (names not listed are random)."""

    seed: int
    std: float
    kinds: Mapping[str, InitKind]

    @staticmethod
    def for_model(model: nn.Module, seed: int) -> "HashedInit":
        """The init of `model`'s parameters (their names and modules; the values are not read)."""
        std = float(getattr(getattr(model, "config", None), "initializer_range", None) or 0.02)
        kinds: dict[str, InitKind] = {}
        for mod_name, mod in model.named_modules():
            prefix = f"{mod_name}." if mod_name else ""
            for attr, p in mod._parameters.items():
                if p is not None:
                    kinds[prefix + attr] = init_kind(mod, attr)
        return HashedInit(seed, std, kinds)

    def tensor(self, name: str, shape: Sequence[int], dtype: torch.dtype, device: torch.device,
               sel: Optional[Selection] = None) -> torch.Tensor:
        """The part `sel` (per dim: None or index ranges, concatenated) of weight `name` of full `shape`."""
        shape = tuple(int(s) for s in shape)
        sel = sel if sel is not None else (None,) * len(shape)
        if len(sel) != len(shape):
            raise ValueError(f"{name}: selection over {len(sel)} dims for a {len(shape)}-d weight {list(shape)}")
        idx = []
        for d, (n, ranges) in enumerate(zip(shape, sel)):
            ranges = ranges if ranges is not None else ((0, n),)
            for a, b in ranges:
                if not 0 <= a <= b <= n:
                    raise ValueError(f"{name}: range [{a}, {b}) of dim {d} is outside its size {n}")
            idx.append(torch.cat([torch.arange(a, b, dtype=torch.int64, device=device) for a, b in ranges]))
        out_shape = tuple(len(i) for i in idx)
        kind = self.kinds.get(name, "random")
        if kind != "random":
            return (torch.ones if kind == "ones" else torch.zeros)(out_shape, dtype=dtype, device=device)
        out = torch.empty(out_shape, dtype=dtype, device=device)
        if out.numel() == 0:
            return out
        strides = [math.prod(shape[d + 1:]) for d in range(len(shape))]
        key = zlib.crc32(f"{self.seed}/{name}".encode())
        scale = math.sqrt(3.0) * self.std  # uniform on [-scale, scale] has standard deviation std
        if not shape:  # a scalar parameter
            return self._values(torch.zeros((), dtype=torch.int64, device=device), key, scale).to(dtype)
        rest = torch.zeros((), dtype=torch.int64, device=device)  # flat offsets of dims 1.. (broadcast)
        for d in range(1, len(shape)):
            view = [1] * (len(shape) - 1)
            view[d - 1] = -1
            rest = rest + (idx[d] * strides[d]).view(view)
        rest = rest.expand(out_shape[1:]) if len(shape) > 1 else rest
        rows = max(1, _CHUNK // max(1, math.prod(out_shape[1:])))
        for r0 in range(0, out_shape[0], rows):
            lead = idx[0][r0:r0 + rows] * strides[0]
            flat = lead.view(-1, *([1] * (len(shape) - 1))) + rest
            out[r0:r0 + rows] = self._values(flat, key, scale).to(dtype)
        return out

    @staticmethod
    def _values(flat: torch.Tensor, key: int, scale: float) -> torch.Tensor:
        h = _mix32(_mix32((flat & _MASK32) ^ key) ^ (flat >> 32))
        u = ((h >> 8).to(torch.float32) + 0.5) * (1.0 / (1 << 24))  # (0, 1), 24 exact bits
        return (u * 2.0 - 1.0) * scale
