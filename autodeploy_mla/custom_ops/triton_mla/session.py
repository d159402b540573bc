"""`TritonMLASession`: the Triton backend's state for one model (policy, loaded kernels, the step's
host shape and launch plans, its FA3 prefill), and the static-bounds decisions it answers for the
model runner."""

from __future__ import annotations

from typing import Any, Optional

from ..attention.mla_dims import MLADims
from ..attention.registry import BackendSession, SessionSpec, StepDescriptor, StepMetadata
from ..attention.router import NodePaths, Path, Route, RouteLog, triton_prefill_route
from ..attention.prefill_kernels import PrefillAttention, prefill_kernel
from . import tuning
from .call import OpCall
from .launch import LaunchCache
from .launchers import fa3_for_step
from .policy import DEFAULT_POLICY, TritonPolicy
from .step_shape import StepShape
from .tuning import (ABSORB_SLOWDOWN, MAX_EXPAND_HEAD_DIM, STATIC_MAX_EXTRA_FLOPS, choose_prefill_path,
                     expansion_supported, max_static_bounds_extra_flops, static_bounds_extra_flops)


class TritonMLASession(BackendSession):
    """The Triton backend's state for one model: its policy, the kernel variants already loaded, the
    compiled kernels it launches directly (`LaunchCache`), and the step plan `prepare` makes once per
    step for every layer: the step's host shape (`StepShape`) and, filled by the first layer of each
    kind of node, the launch plans the other layers of that kind reuse."""

    backend = "triton"

    def __init__(self, spec: SessionSpec, policy: TritonPolicy = DEFAULT_POLICY) -> None:
        super().__init__(spec)
        self.policy = policy
        #: (kernel config, dims, dtype, device, page size) whose SPLIT and non-SPLIT variants are loaded.
        self.warmed: set[tuple[Any, ...]] = set()
        self.launches = LaunchCache()
        #: this step's host shape (None before the first prepare: ops then read the host metadata)
        self.step: Optional[StepShape] = None
        #: this step's launch plans by node kind and role (cleared by prepare)
        self.plans: dict[tuple[Any, ...], Any] = {}
        #: steps whose static-bounds (mixed graph) run this session declined (static_bounds_ok)
        self.static_declined = 0
        #: what every op call of this model runs with (the dicts above and below are shared with it)
        #: FlashInfer's FA3 prefill for the expanded prefill's attention (None: our kernel), and why not
        self.fa3, self.fa3_reason = make_fa3(spec, policy)
        self.call = OpCall(policy, self.warmed, self.launches, self.plans, descriptors={}, views={},
                          memo_limit=2 * len(spec.dims) + 8, fa3=self.fa3)
        #: the attention router's record of this model's steps on Triton (counters per route, bounded trace)
        self.routes = RouteLog(policy.trace_steps)
        self._node_dims = tuple(sorted(set(spec.dims), key=str))

    def prepare(self, meta: StepMetadata, step: StepDescriptor) -> None:
        """Read the step's host metadata once for all layers (ops check the batch counts still match)."""
        self.step = StepShape.from_host(meta.get("batch_info_host"), meta.get("max_seq_info_host"),
                                        meta.get("cu_seqlen_host"), meta.get("input_pos_host"),
                                        static=step.static_bounds)
        self.plans.clear()
        self._record_routes(self.step)

    def _record_routes(self, shape: StepShape) -> None:
        """Record the step's route per node kind, as the op will take it (the same rules: the op still
        decides per call, from the same shape)."""
        if shape.num_tok == 0:
            return
        self.routes.next_step()
        if shape.n_pre == 0:
            self.routes.record("all", Route("decode", self.backend, "absorbed", f"{shape.n_dec} decode sequence(s)"))
            return
        if shape.static:
            self.routes.record("all", Route("prefill", self.backend, "absorb", "static bounds (mixed graph)"))
            return
        mode = self.policy.prefill_mode
        fa3 = fa3_for_step(self.call, shape, self.spec.device)  # the op's own rule, not a copy of it
        for d in self._node_dims:
            path = choose_prefill_path(d, shape.n_pre_tok, shape.prefix, shape.pairs) if mode == "auto" else mode
            self.routes.record(d.short(), triton_prefill_route(self.backend, path, fa3,
                                                               f"{mode}: {shape.n_pre_tok} new on {shape.prefix} cached"))

    def paths(self, dims: MLADims) -> NodePaths:
        """Decode: the absorbed kernels (Gluon where gluon_decode serves the dims, else tl); prefill: the
        cost rule's expand or absorb per step, the expanded attention on FA3 where it runs."""
        p = self.policy
        dec = Path(self.backend, f"absorbed decode (decode_kernel={p.decode_kernel}, decode_layout={p.decode_layout})")
        if p.prefill_mode != "auto":
            pre = f"prefill_mode={p.prefill_mode} on every step with prefill tokens"
        elif not expansion_supported(dims):
            pre = f"absorbed (Dn/Dv over {MAX_EXPAND_HEAD_DIM}: no expansion)"
        else:
            pre = ("per step by the cost rule: expand iff its FLOPs < "
                   f"{ABSORB_SLOWDOWN:g} x the absorbed FLOPs (tuning.choose_prefill_path)")
        fa3 = (f"; expanded attention on FlashInfer FA3 from {tuning.FA3_PREFILL_MIN_TOKENS} new tokens"
               if self.fa3 is not None else f"; expanded attention on the Triton kernel (FA3: {self.fa3_reason})")
        return NodePaths(dec, Path(self.backend, pre + fa3))

    def static_bounds_ok(self, meta: StepMetadata) -> bool:
        """Static bounds absorb the prefill part (no expansion in a graph): decline steps where that
        costs more than tuning.STATIC_MAX_EXTRA_FLOPS per layer over expanding (long-prefix chunks),
        unless the policy forces absorption."""
        shape = StepShape.from_host(meta.get("batch_info_host"), meta.get("max_seq_info_host"),
                                    meta.get("cu_seqlen_host"), meta.get("input_pos_host"))
        if shape.n_pre == 0 or self.policy.prefill_mode == "absorb":
            return True
        ok = self.policy.prefill_mode == "auto" and all(
            static_bounds_extra_flops(d, shape.n_pre_tok, shape.prefix, shape.pairs) <= STATIC_MAX_EXTRA_FLOPS
            for d in set(self.spec.dims))
        if not ok:
            self.static_declined += 1
        return ok

    def may_decline_static_bounds(self, num_tokens: int, max_seq_len: int) -> bool:
        """`static_bounds_ok` declines only steps with a prefill part: never under prefill_mode
        "absorb", always under "expand", and under "auto" where the largest extra cost any such step can
        reach (tuning.max_static_bounds_extra_flops) is over STATIC_MAX_EXTRA_FLOPS for some layer."""
        mode = self.policy.prefill_mode
        if mode == "absorb":
            return False
        if mode != "auto":
            return True
        return any(max_static_bounds_extra_flops(d, num_tokens, max_seq_len) > STATIC_MAX_EXTRA_FLOPS
                   for d in set(self.spec.dims))

    def stats(self) -> dict[str, Any]:
        fa3 = self.fa3.stats() if self.fa3 is not None else {"fa3_prefill": self.fa3_reason}
        return {"warmed_variants": len(self.warmed), "step_plans": len(self.plans),
                "static_bounds_declined": self.static_declined, "routes": self.routes.to_dict(),
                **self.launches.stats(), **fa3}


#: the prefill-kernel registry's name of FlashInfer's FA3 ragged prefill (flashinfer/fa3_prefill.py)
FA3_PREFILL = "flashinfer_fa3"


def make_fa3(spec: SessionSpec, policy: TritonPolicy) -> tuple[Optional[PrefillAttention], str]:
    """The session's FA3 prefill (policy "auto"/"flashinfer", every layer's dims served), or why none.
    Found by name in the prefill-kernel registry: this backend does not import FlashInfer's."""
    if policy.prefill_attention == "triton":
        return None, "off (prefill_attention='triton')"
    if policy.prefill_attention == "auto" and spec.max_num_tokens < tuning.FA3_PREFILL_MIN_TOKENS:
        # steps never hold that many tokens: no workspace for a path "auto" cannot take
        return None, (f"max_num_tokens {spec.max_num_tokens} < FA3_PREFILL_MIN_TOKENS "
                      f"{tuning.FA3_PREFILL_MIN_TOKENS}: no step is long enough for FA3")
    kernel = prefill_kernel(FA3_PREFILL)
    if kernel is None:
        why = f"no prefill kernel {FA3_PREFILL!r} is registered (custom_ops.flashinfer was not imported)"
    else:
        why = next((w for w in (kernel.unavailable(d, spec.dtype, spec.device)
                                for d in sorted(set(spec.dims), key=str)) if w), "")
    if why:
        if policy.prefill_attention == "flashinfer":
            raise ValueError(f"TritonPolicy.prefill_attention='flashinfer': {why}. Use 'auto' or 'triton'.")
        return None, why
    assert kernel is not None
    return kernel.make(spec.device, frozenset((d.qk_nope_head_dim + d.qk_rope_head_dim, d.v_head_dim)
                                              for d in spec.dims)), ""
