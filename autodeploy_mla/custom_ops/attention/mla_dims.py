"""MLA dimensions of one attention node, and the shape validation every MLA op shares."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Optional

import torch


@dataclass(frozen=True)
class MLADims:
    """Per-node MLA dims (DESIGN §3). Layers of one model may differ, so this is per node."""

    num_heads: int  # N
    qk_nope_head_dim: int  # Dn
    qk_rope_head_dim: int  # Dr (0 allowed: NoPE MLA)
    v_head_dim: int  # Dv
    kv_lora_rank: int  # R

    @property
    def latent_dim(self) -> int:
        """Width of one cached token: latent + rope key (R + Dr)."""
        return self.kv_lora_rank + self.qk_rope_head_dim

    def default_scale(self) -> float:
        return (self.qk_nope_head_dim + self.qk_rope_head_dim) ** -0.5

    def split_kv_b(self, kv_b_proj_weight: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """(W_kn [N, Dn, R], W_v [N, Dv, R]): views of kv_b_proj's per-head rows [Dn | Dv].

        The weight-absorption form of MLA: q_abs = q_nope · W_kn scores against the latent directly,
        and the latent output · W_vᵀ gives the values, so K and V are never materialised."""
        w = kv_b_proj_weight.view(self.num_heads, self.qk_nope_head_dim + self.v_head_dim, self.kv_lora_rank)
        return w[:, : self.qk_nope_head_dim], w[:, self.qk_nope_head_dim :]

    def short(self) -> str:
        return (
            f"N={self.num_heads} R={self.kv_lora_rank} Dr={self.qk_rope_head_dim} "
            f"Dn={self.qk_nope_head_dim} Dv={self.v_head_dim}"
        )


class MLAShapeError(ValueError):
    """Inputs of an MLA op disagree with each other."""


def _fail(op: str, what: str, expected: str, got: object) -> None:
    raise MLAShapeError(f"{op}: {what} — expected {expected}, got {got}.")


def infer_dims(
    op: str,
    q_nope: torch.Tensor,
    q_pe: torch.Tensor,
    compressed_kv: torch.Tensor,
    kpe: torch.Tensor,
    kv_b_proj_weight: torch.Tensor,
    layout: str = "bsnd",
) -> tuple[MLADims, int, int]:
    """Validate the five MLA inputs and return (dims, batch, seq).

    Runs on shapes only (no data access), so it is safe in fake/meta mode and costs no sync. Every
    cached op calls it on every call, so valid inputs take a fast path that builds nothing; only a
    failing check goes through `_explain` for the message.
    """
    if layout == "bsnd" and q_nope.dim() == 4 and q_pe.dim() == 4 and kpe.dim() == 4 \
            and compressed_kv.dim() == 3 and kv_b_proj_weight.dim() == 2:
        b, s, n, dn = q_nope.shape
        dr = q_pe.shape[-1]
        r = compressed_kv.shape[2]
        rows, wr = kv_b_proj_weight.shape
        dt = q_nope.dtype
        if (q_pe.shape[:3] == q_nope.shape[:3] and kpe.shape[0] == b and kpe.shape[1] == s and kpe.shape[2] == 1
                and kpe.shape[3] == dr and compressed_kv.shape[0] == b and compressed_kv.shape[1] == s and wr == r
                and n != 0 and rows % n == 0 and rows // n > dn and dt.is_floating_point
                and q_pe.dtype == dt and compressed_kv.dtype == dt and kpe.dtype == dt and kv_b_proj_weight.dtype == dt):
            return MLADims(n, dn, dr, rows // n - dn, r), b, s
    return _explain(op, q_nope, q_pe, compressed_kv, kpe, kv_b_proj_weight, layout)


def _explain(
    op: str,
    q_nope: torch.Tensor,
    q_pe: torch.Tensor,
    compressed_kv: torch.Tensor,
    kpe: torch.Tensor,
    kv_b_proj_weight: torch.Tensor,
    layout: str,
) -> tuple[MLADims, int, int]:
    """The full check, one rule at a time: raises MLAShapeError naming the first broken rule (or
    returns the dims, for layouts the fast path does not cover)."""
    if layout not in ("bsnd", "bnsd"):
        _fail(op, "layout", "'bsnd' or 'bnsd'", repr(layout))
    for name, t, nd in (
        ("q_nope", q_nope, 4),
        ("q_pe", q_pe, 4),
        ("compressed_kv", compressed_kv, 3),
        ("kpe", kpe, 4),
        ("kv_b_proj_weight", kv_b_proj_weight, 2),
    ):
        if t.dim() != nd:
            _fail(op, f"{name} rank", f"{nd} dims", f"shape {tuple(t.shape)}")
    if layout == "bsnd":
        b, s, n, dn = q_nope.shape
        exp_qpe = (b, s, n, q_pe.shape[-1])
        exp_kpe = (b, s, 1, q_pe.shape[-1])
    else:
        b, n, s, dn = q_nope.shape
        exp_qpe = (b, n, s, q_pe.shape[-1])
        exp_kpe = (b, 1, s, q_pe.shape[-1])
    dr = q_pe.shape[-1]
    if tuple(q_pe.shape) != exp_qpe:
        _fail(op, "q_pe shape", f"{exp_qpe} (same batch/seq/heads as q_nope, layout {layout})", tuple(q_pe.shape))
    if tuple(kpe.shape) != exp_kpe:
        _fail(op, "kpe shape", f"{exp_kpe} (one rope key shared by all heads)", tuple(kpe.shape))
    if compressed_kv.shape[0] != b or compressed_kv.shape[1] != s:
        _fail(op, "compressed_kv shape", f"[{b}, {s}, R]", tuple(compressed_kv.shape))
    r = compressed_kv.shape[2]
    rows, wr = kv_b_proj_weight.shape
    if wr != r:
        _fail(op, "kv_b_proj_weight columns", f"kv_lora_rank R={r}", wr)
    if n == 0 or rows % n != 0 or rows // n <= dn:
        _fail(op, "kv_b_proj_weight rows", f"N*(Dn+Dv) with N={n}, Dn={dn}, Dv>0", rows)
    dv = rows // n - dn
    dtypes = {t.dtype for t in (q_nope, q_pe, compressed_kv, kpe, kv_b_proj_weight)}
    if len(dtypes) != 1:
        _fail(op, "dtypes", "one floating dtype for all five inputs", sorted(str(d) for d in dtypes))
    dt = q_nope.dtype
    if not dt.is_floating_point:
        _fail(op, "dtype", "a floating dtype", dt)
    return MLADims(n, dn, dr, dv, r), b, s


def resolve_scale(dims: MLADims, scale: Optional[float]) -> float:
    return dims.default_scale() if scale is None else float(scale)
