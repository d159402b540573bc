"""The Triton backend's per-model knobs (`TritonPolicy`): what tests and benchmarks may force, and
the defaults graphs run with. A frozen value, so the default can be a module constant."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Literal

from ..attention.router import DEFAULT_TRACE_STEPS

PREFILL_MODES = ("auto", "expand", "absorb")
DECODE_LAYOUTS = ("auto", "heads_on_m", "heads_on_n")
DECODE_KERNELS = ("auto", "triton", "gluon")
PREFILL_ATTENTION = ("auto", "triton", "flashinfer")


@dataclass(frozen=True)
class TritonPolicy:
    """Per-model knobs of the Triton backend (defaults: what graphs run).

    prefill_mode: "auto" (the cost rule), or force "expand" / "absorb" (benchmarks, tests).
    decode_splits: 0 = split-K from the policy in tuning.py; k >= 1 forces k chunks (also for
    absorbed prefill). poison_buffers: fill every intermediate/output buffer with NaN before the
    kernels run, so an element a kernel forgets to write shows up as NaN (tests). fp8_dot: with an
    FP8 cache, quantise the absorbed queries (per-call amax scale) and the probabilities to e4m3 and
    run both products as e4m3 MMAs on the tiles as loaded, instead of converting each cache tile to
    the query dtype (the default: exact queries). Off: on H200 it was no faster at N <= 32 and 2.5x
    slower at N = 128, with twice the error (docs/benchmarks/fp8_cache.md). decode_layout: "auto"
    (tuning.decode_config's measured choice), or force the decode kernel: "heads_on_m"
    (absorbed_attn_kernel) / "heads_on_n" (absorbed_attn_heads_on_n_kernel, where R >= 32).
    prefill_attention: the attention kernel of the expanded prefill: "auto" = FlashInfer's FA3 ragged
    prefill (fa3_prefill.py) where it is installed and serves the dims (SM90, qk/vo head dims it is
    built for) and the step's longest prefill has at least tuning.FA3_PREFILL_MIN_TOKENS new tokens,
    else `expanded_prefill_kernel`; "triton" / "flashinfer" force one ("flashinfer" where FA3 cannot
    run is refused when the session is made). decode_kernel: "auto" = the warp-specialised Gluon decode
    kernels wherever `gluon_decode.supports` accepts the dims and device (SM90, 16-bit cache, R 256/512
    with N <= 32 or R 512 with N > 32, Dr 64, pages of whole 64-token tiles) and, at N <= 32, decode
    runs heads-on-N (gluon_decode.py; N > 32: gluon_decode_wide.py), else the `tl` kernels;
    "triton" never uses them; "gluon" requires them (a decode they cannot serve raises, naming why)."""

    prefill_mode: Literal["auto", "expand", "absorb"] = "auto"
    decode_splits: int = 0
    poison_buffers: bool = False
    fp8_dot: bool = False
    decode_layout: Literal["auto", "heads_on_m", "heads_on_n"] = "auto"
    prefill_attention: Literal["auto", "triton", "flashinfer"] = "auto"
    decode_kernel: Literal["auto", "triton", "gluon"] = "auto"
    #: steps the session's route trace keeps (`stats()["routes"]`; counters keep every step)
    trace_steps: int = DEFAULT_TRACE_STEPS

    def __post_init__(self) -> None:
        if self.decode_kernel not in DECODE_KERNELS:
            raise ValueError(f"TritonPolicy.decode_kernel={self.decode_kernel!r}; expected one of "
                             f"{', '.join(DECODE_KERNELS)}.")
        if self.prefill_attention not in PREFILL_ATTENTION:
            raise ValueError(f"TritonPolicy.prefill_attention={self.prefill_attention!r}; expected one of "
                             f"{', '.join(PREFILL_ATTENTION)}.")
        if self.prefill_mode not in PREFILL_MODES:
            raise ValueError(f"TritonPolicy.prefill_mode={self.prefill_mode!r}; expected one of {', '.join(PREFILL_MODES)}.")
        if self.decode_layout not in DECODE_LAYOUTS:
            raise ValueError(f"TritonPolicy.decode_layout={self.decode_layout!r}; expected one of "
                             f"{', '.join(DECODE_LAYOUTS)}.")
        if self.decode_splits < 0:
            raise ValueError(f"TritonPolicy.decode_splits={self.decode_splits}: must be >= 0 (0 = automatic).")


DEFAULT_POLICY = TritonPolicy()
