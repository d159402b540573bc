"""MoE routing ops: router logits -> (top-k weights, top-k expert ids) in one op per MoE layer.

`torch.ops.autodeploy.torch_moe_route` (reference) and `triton_moe_route` (one kernel) compute what
the routers of transformers' MLA families compute after their gate GEMM — DeepSeek-V2's
`DeepseekV2TopkRouter` (softmax, greedy or group-limited by group max), DeepSeek-V3/V3.2,
GLM-4.7-Flash and GLM-5 (`*TopkRouter`: sigmoid + `e_score_correction_bias` for the choice,
groups scored by their top-2 sum, weights gathered from the unbiased scores, normalised), and
Mistral-Small-4 (softmax, top-2-sum groups, normalised):

    scores  = softmax(logits) | sigmoid(logits)                     (in the logits' dtype)
    choice  = scores (+ bias)
    groups  = top `topk_group` of `n_group` groups by max | top-2 sum of choice   (if topk_group < n_group)
    choice  = choice with experts outside those groups set to `fill`
    ids     = top-k of choice                                        (order unspecified, as sorted=False)
    weights = (choice if weights_from == "choice" else scores)[ids]
    weights = weights / (sum(weights) + 1e-20)                       (if renormalize)
    weights = weights * scale

HF runs this as 3-15 ATen ops per layer (three `topk`s for grouped routers); the fuse_routing pass
replaces them with one of these ops. `<backend>_moe_gate_route` also takes the hidden states and the
gate weight: the reference runs the routers' fp32 GEMM, the Triton op the same products on tensor
cores with fp32 sums (gate_logits_tensor_cores), then the routing kernel.

The reference is HF's own sequence of torch calls, so on CPU it is bitwise what the model computes.
The Triton kernel holds one block of token rows x all experts in registers (E <= 1024), picks the
groups and then the experts by repeated arg-max (ties: lowest index), and writes the weights
already normalised and scaled: no host sync, static grid (CUDA-graph safe).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Literal, Optional

import torch

from ..triton_helpers import pow2

try:
    from . import route_kernel as RK

    HAS_TRITON = True
except ImportError:  # pragma: no cover - exercised only without triton
    RK = None
    HAS_TRITON = False

ScoreFn = Literal["softmax", "sigmoid"]
GroupScore = Literal["max", "top2sum"]
WeightsFrom = Literal["scores", "choice"]
#: The kernel keeps [rows, experts] tiles in registers; beyond this the pass keeps the model's routing.
MAX_EXPERTS = 1024
NORM_EPS = 1e-20  # what HF's routers add to the sum before normalising


@dataclass(frozen=True)
class RoutingSpec:
    """How one router turns logits into (weights, ids); every field is the op's argument of that name."""

    top_k: int
    n_group: int = 1
    topk_group: int = 1
    score: ScoreFn = "softmax"
    group_score: GroupScore = "top2sum"
    fill: float = 0.0
    weights_from: WeightsFrom = "scores"
    renormalize: bool = False
    scale: float = 1.0

    def args(self) -> tuple:
        return (self.top_k, self.n_group, self.topk_group, self.score, self.group_score, self.fill,
                self.weights_from, self.renormalize, self.scale)

    @property
    def grouped(self) -> bool:
        return self.topk_group < self.n_group


def check_route_spec(name: str, e: int, bias: Optional[torch.Tensor], top_k: int, n_group: int, topk_group: int,
                     score: str, group_score: str, weights_from: str) -> None:
    """ValueError naming the offending value when the routing arguments do not fit E experts."""
    if bias is not None and tuple(bias.shape) != (e,):
        raise ValueError(f"{name}: bias must be [E={e}], got {tuple(bias.shape)}")
    if score not in ("softmax", "sigmoid"):
        raise ValueError(f"{name}: score {score!r} unsupported; expected 'softmax' or 'sigmoid'")
    if group_score not in ("max", "top2sum"):
        raise ValueError(f"{name}: group_score {group_score!r} unsupported; expected 'max' or 'top2sum'")
    if weights_from not in ("scores", "choice"):
        raise ValueError(f"{name}: weights_from {weights_from!r} unsupported; expected 'scores' or 'choice'")
    if n_group < 1 or e % n_group:
        raise ValueError(f"{name}: n_group={n_group} must be >= 1 and divide the {e} experts")
    if not 1 <= topk_group <= n_group:
        raise ValueError(f"{name}: topk_group={topk_group} must be in [1, n_group={n_group}]")
    if not 1 <= top_k <= e:
        raise ValueError(f"{name}: top_k={top_k} must be in [1, E={e}]")
    if topk_group < n_group and group_score == "top2sum" and e // n_group < 2:
        raise ValueError(f"{name}: top-2-sum group scores need >= 2 experts per group, got {e // n_group}")


def check_route_inputs(name: str, logits: torch.Tensor, bias: Optional[torch.Tensor], top_k: int, n_group: int,
                       topk_group: int, score: str, group_score: str, weights_from: str) -> tuple[int, int]:
    """(T, E) of a valid call; ValueError naming the offending value otherwise."""
    if logits.dim() != 2:
        raise ValueError(f"{name}: logits must be [T, E], got shape {tuple(logits.shape)}")
    if not logits.is_floating_point():
        raise ValueError(f"{name}: logits must be floating point, got {logits.dtype}")
    t, e = logits.shape
    check_route_spec(name, e, bias, top_k, n_group, topk_group, score, group_score, weights_from)
    return t, e


# ----------------------------------------------------------------------------- reference
def route_reference(logits: torch.Tensor, bias: Optional[torch.Tensor], spec: RoutingSpec
                    ) -> tuple[torch.Tensor, torch.Tensor]:
    """HF's routing after the gate GEMM, call for call (so CPU results are bitwise the model's)."""
    e = logits.shape[-1]
    scores = logits.softmax(-1) if spec.score == "softmax" else logits.sigmoid()
    choice = scores + bias if bias is not None else scores
    if spec.grouped:
        per = e // spec.n_group
        grouped = choice.view(-1, spec.n_group, per)
        if spec.group_score == "max":
            group_scores = grouped.max(dim=-1).values
        else:
            group_scores = grouped.topk(2, dim=-1)[0].sum(dim=-1)
        group_idx = torch.topk(group_scores, k=spec.topk_group, dim=-1, sorted=False)[1]
        group_mask = torch.zeros_like(group_scores)
        group_mask.scatter_(1, group_idx, 1)
        score_mask = group_mask.unsqueeze(-1).expand(-1, spec.n_group, per).reshape(-1, e)
        choice = choice.masked_fill(~score_mask.bool(), spec.fill)
    values, ids = torch.topk(choice, k=spec.top_k, dim=-1, sorted=False)
    weights = values if spec.weights_from == "choice" else scores.gather(1, ids)
    if spec.renormalize:
        weights = weights / (weights.sum(dim=-1, keepdim=True) + NORM_EPS)
    return weights * spec.scale, ids


def _spec(top_k, n_group, topk_group, score, group_score, fill, weights_from, renormalize, scale) -> RoutingSpec:
    return RoutingSpec(top_k, n_group, topk_group, score, group_score, fill, weights_from, renormalize, scale)


@torch.library.custom_op("autodeploy::torch_moe_route", mutates_args=())
def torch_moe_route(logits: torch.Tensor, bias: Optional[torch.Tensor], top_k: int, n_group: int, topk_group: int,
                    score: str, group_score: str, fill: float, weights_from: str, renormalize: bool,
                    scale: float) -> tuple[torch.Tensor, torch.Tensor]:
    """Reference routing: (weights [T, k] in the logits' dtype, ids [T, k] int64)."""
    check_route_inputs("torch_moe_route", logits, bias, top_k, n_group, topk_group, score, group_score, weights_from)
    w, ids = route_reference(logits, bias, _spec(top_k, n_group, topk_group, score, group_score, fill,
                                                 weights_from, renormalize, scale))
    return w.contiguous(), ids.contiguous()


def _fake(name: str):
    def fake(logits, bias, top_k, n_group, topk_group, score, group_score, fill, weights_from, renormalize, scale):
        check_route_inputs(name, logits, bias, top_k, n_group, topk_group, score, group_score, weights_from)
        t = logits.shape[0]
        return logits.new_empty(t, top_k), logits.new_empty(t, top_k, dtype=torch.int64)
    return fake


torch_moe_route.register_fake(_fake("torch_moe_route"))


# ----------------------------------------------------------------------------- Triton
#: Up to this many tokens every row gets its own program (decode batches, small mixed steps).
ROW_PER_PROGRAM_MAX_T = 512


def route_block_t(t: int, e_pad: int) -> int:
    """Token rows per program. A row's routing is a chain of dependent reductions (one per pick), so
    one program's latency is the floor: up to ROW_PER_PROGRAM_MAX_T tokens each row gets its own program
    and they all run at once (H200: one row of 64-256 experts is 2.0-3.9 µs, docs/benchmarks/
    moe_routing.md, T=1; the same kernel with 8 rows in one program took 3.8-10.6 µs). Beyond that,
    blocks of rows that fill a warp group (16 rows at E <= 128: 4.1 µs at T=2048 on V2-Lite's router)."""
    if t <= ROW_PER_PROGRAM_MAX_T:
        return 1
    return max(1, min(16, 2048 // e_pad))


def kernel_constants(spec: RoutingSpec, e: int, has_bias: bool) -> dict:
    """The routing kernels' compile-time arguments for `spec` over `e` experts (route_kernel.py)."""
    if e > MAX_EXPERTS:
        raise ValueError(f"the routing kernels hold all experts in registers: {e} experts exceed their limit of "
                         f"{MAX_EXPERTS}; use the torch reference (transforms.fuse_routing.backend: torch)")
    groups = spec.n_group if spec.grouped else 1
    neg_inf = spec.fill == float("-inf")
    return dict(E=e, E_PAD=pow2(e, lo=2), K=spec.top_k, K_PAD=pow2(spec.top_k, lo=2), N_GROUP=groups,
                G_PAD=pow2(groups, lo=2), TOPK_GROUP=spec.topk_group, SIGMOID=spec.score == "sigmoid",
                HAS_BIAS=has_bias, GROUP_TOP2=spec.group_score == "top2sum", FILL_NEG_INF=neg_inf,
                FILL=0.0 if neg_inf else float(spec.fill), FROM_CHOICE=spec.weights_from == "choice",
                RENORM=spec.renormalize, EPS=NORM_EPS)


def triton_route(logits: torch.Tensor, bias: Optional[torch.Tensor], spec: RoutingSpec,
                 block_t: Optional[int] = None) -> tuple[torch.Tensor, torch.Tensor]:
    """The routing kernel (same contract as torch_moe_route); `block_t` overrides the rows per
    program (tests, benchmarks)."""
    if not HAS_TRITON:
        raise RuntimeError("triton_moe_route needs triton; pip install 'triton>=3.4'")
    t, e = check_route_inputs("triton_moe_route", logits, bias, spec.top_k, spec.n_group, spec.topk_group,
                              spec.score, spec.group_score, spec.weights_from)
    consts = kernel_constants(spec, e, bias is not None)
    k = spec.top_k
    weights = torch.empty(t, k, dtype=logits.dtype, device=logits.device)
    ids = torch.empty(t, k, dtype=torch.int64, device=logits.device)
    if t == 0:
        return weights, ids
    block_t = block_t or route_block_t(t, consts["E_PAD"])
    logits = logits if logits.stride(1) == 1 else logits.contiguous()
    RK.route_kernel[(-(-t // block_t),)](
        logits, bias if bias is not None else logits, weights, ids, t, logits.stride(0), float(spec.scale),
        **consts, BLOCK_T=block_t, num_warps=4 if consts["E_PAD"] * block_t >= 1024 else 1)
    return weights, ids


@torch.library.custom_op("autodeploy::triton_moe_route", mutates_args=())
def triton_moe_route(logits: torch.Tensor, bias: Optional[torch.Tensor], top_k: int, n_group: int, topk_group: int,
                     score: str, group_score: str, fill: float, weights_from: str, renormalize: bool,
                     scale: float) -> tuple[torch.Tensor, torch.Tensor]:
    """Routing in one Triton kernel: (weights [T, k] in the logits' dtype, ids [T, k] int64)."""
    return triton_route(logits, bias, _spec(top_k, n_group, topk_group, score, group_score, fill, weights_from,
                                            renormalize, scale))


triton_moe_route.register_fake(_fake("triton_moe_route"))


# ----------------------------------------------------------------------------- gate GEMM in the op
HALF_DTYPES = (torch.bfloat16, torch.float16)


def check_gate_inputs(name: str, x: torch.Tensor, gate_weight: torch.Tensor) -> None:
    if x.dim() != 2 or gate_weight.dim() != 2 or x.shape[1] != gate_weight.shape[1]:
        raise ValueError(f"{name}: x must be [T, H] and gate_weight [E, H] with the same H, got "
                         f"{tuple(x.shape)} and {tuple(gate_weight.shape)}")


def gate_logits(x: torch.Tensor, gate_weight: torch.Tensor) -> torch.Tensor:
    """The fp32 router GEMM as the routers write it: F.linear(x.float(), weight.float())."""
    return torch.nn.functional.linear(x.type(torch.float32), gate_weight.type(torch.float32))


def gate_logits_tensor_cores(x: torch.Tensor, gate_weight: torch.Tensor) -> torch.Tensor:
    """gate_logits from bf16 / fp16 operands on tensor cores, summed and returned in fp32.

    A product of two bf16 (fp16) numbers is exact in fp32 (8 + 8 (11 + 11) significand bits <= 24), so
    this differs from the upcast fp32 GEMM only in the order and rounding of its fp32 sums, as two fp32
    GEMMs of cuBLAS do (it splits K for some shapes). It reads the operands in their own dtype (no fp32
    copies written and read back) and runs a tensor-core GEMM instead of the SIMT sgemm, which took
    ~20-24 µs per layer of a 2048-token prefill step on the H200 (docs/benchmarks/moe_routing_gate.md).
    Other dtypes, or CPU: gate_logits."""
    if x.is_cuda and x.dtype in HALF_DTYPES and gate_weight.dtype == x.dtype:
        return torch.mm(x, gate_weight.t(), out_dtype=torch.float32)
    return gate_logits(x, gate_weight)


@torch.library.custom_op("autodeploy::torch_moe_gate_route", mutates_args=())
def torch_moe_gate_route(x: torch.Tensor, gate_weight: torch.Tensor, bias: Optional[torch.Tensor], top_k: int,
                         n_group: int, topk_group: int, score: str, group_score: str, fill: float,
                         weights_from: str, renormalize: bool, scale: float) -> tuple[torch.Tensor, torch.Tensor]:
    """Reference: the fp32 gate GEMM, then torch_moe_route's computation (fp32 weights, int64 ids)."""
    check_gate_inputs("torch_moe_gate_route", x, gate_weight)
    w, ids = route_reference(gate_logits(x, gate_weight), bias,
                             _spec(top_k, n_group, topk_group, score, group_score, fill, weights_from, renormalize,
                                   scale))
    return w.contiguous(), ids.contiguous()


def triton_gate_route(x: torch.Tensor, gate_weight: torch.Tensor, bias: Optional[torch.Tensor],
                      spec: RoutingSpec) -> tuple[torch.Tensor, torch.Tensor]:
    """The gate GEMM on tensor cores (gate_logits_tensor_cores), then the routing kernel."""
    check_gate_inputs("triton_moe_gate_route", x, gate_weight)
    return triton_route(gate_logits_tensor_cores(x, gate_weight), bias, spec)


@torch.library.custom_op("autodeploy::triton_moe_gate_route", mutates_args=())
def triton_moe_gate_route(x: torch.Tensor, gate_weight: torch.Tensor, bias: Optional[torch.Tensor], top_k: int,
                          n_group: int, topk_group: int, score: str, group_score: str, fill: float,
                          weights_from: str, renormalize: bool, scale: float) -> tuple[torch.Tensor, torch.Tensor]:
    """The gate GEMM on tensor cores and the routing kernel (same contract as torch_moe_gate_route)."""
    return triton_gate_route(x, gate_weight, bias, _spec(top_k, n_group, topk_group, score, group_score, fill,
                                                         weights_from, renormalize, scale))


def _fake_gate(name: str):
    def fake(x, gate_weight, bias, top_k, n_group, topk_group, score, group_score, fill, weights_from, renormalize,
             scale):
        check_gate_inputs(name, x, gate_weight)
        t = x.shape[0]
        return x.new_empty(t, top_k, dtype=torch.float32), x.new_empty(t, top_k, dtype=torch.int64)
    return fake


torch_moe_gate_route.register_fake(_fake_gate("torch_moe_gate_route"))
triton_moe_gate_route.register_fake(_fake_gate("triton_moe_gate_route"))

__all__ = ["HALF_DTYPES", "HAS_TRITON", "MAX_EXPERTS", "RoutingSpec", "check_route_inputs", "check_route_spec",
           "gate_logits", "gate_logits_tensor_cores", "kernel_constants",
           "route_reference", "torch_moe_gate_route", "torch_moe_route", "triton_gate_route", "triton_moe_gate_route",
           "triton_moe_route", "triton_route"]

