"""Every name the benchmarks take from `autodeploy_mla`, and the module that defines it.

This is the only file under `benchmarks/` that names a module of the package. When the package
moves a module (the kernel layer is being regrouped by library), the paths below are the one place
to follow it; the scripts keep importing the same names from `benchmarks.lib`.

Names are resolved on first use, not at import: a `--render` run on a laptop must not import
Triton kernels, a serving run must not import the MoE kernels, and `autodeploy_mla.testing` pulls
pytest. A name bound to a module path alone (no `:attr`) is that module.

`REACH_INS` lists the package's private names some benchmarks drive directly (launchers, planners,
Gluon building blocks): each gets a public name here so no script imports a `_name`. They are the
package's to make public or to replace with a policy knob; until then a rename there breaks one
line here, not a dozen scripts.
"""

from __future__ import annotations

import contextlib
import importlib
import random
from typing import Any

_OPS = "autodeploy_mla.custom_ops"
_TRITON = f"{_OPS}.triton_mla"

#: public name -> "module" (the module itself) or "module:attribute"
PUBLIC: dict[str, str] = {
    # api, serving, distributed
    "optimize": "autodeploy_mla.api:optimize",
    "serving_bench": "autodeploy_mla.serving.bench",
    "result_table": "autodeploy_mla.serving.bench:result_table",
    "ServerThread": "autodeploy_mla.serving.server:ServerThread",
    "spawn": "autodeploy_mla.distributed:spawn",
    "RankFailed": "autodeploy_mla.distributed:RankFailed",
    "env_info": "autodeploy_mla.distributed:env_info",
    # runtime
    "PageAllocator": "autodeploy_mla.runtime:PageAllocator",
    "SequenceInfo": "autodeploy_mla.runtime:SequenceInfo",
    "StepSequence": "autodeploy_mla.runtime:StepSequence",
    "SamplingParams": "autodeploy_mla.runtime.sampling:SamplingParams",
    "step_descriptor": "autodeploy_mla.runtime.model_runner:step_descriptor",
    "track_graph": "autodeploy_mla.runtime.cuda_graphs:track_graph",
    # the backend contract and registry
    "backend_registry": f"{_OPS}.attention.registry",
    "BackendSession": f"{_OPS}:BackendSession",
    "MLADims": f"{_OPS}:MLADims",
    "SessionSpec": f"{_OPS}:SessionSpec",
    "Target": f"{_OPS}:Target",
    "all_backends": f"{_OPS}:all_backends",
    "get_backend": f"{_OPS}:get_backend",
    "library_versions": f"{_OPS}:library_versions",
    "using_sessions": f"{_OPS}.attention.step_context:using_sessions",
    "active_session": f"{_OPS}.attention.step_context:active_session",
    "resolve_scale": f"{_OPS}.attention.mla_dims:resolve_scale",
    "FP8_DTYPE": f"{_OPS}.attention.cache_format:FP8_DTYPE",
    # FlashInfer backend
    "FlashInferPolicy": f"{_OPS}.flashinfer.mla:FlashInferPolicy",
    "mla_csr": f"{_OPS}.flashinfer.metadata:mla_csr",
    # Triton MLA backend
    "TritonPolicy": f"{_TRITON}:TritonPolicy",
    "triton_op": f"{_TRITON}.op",
    "triton_launchers": f"{_TRITON}.launchers",
    "triton_tuning": f"{_TRITON}.tuning",
    "triton_kernels": f"{_TRITON}.kernels",
    "gluon_decode": f"{_TRITON}.gluon_decode",
    "gluon_common": f"{_TRITON}.gluon_common",
    "BoundKernel": f"{_TRITON}.launch:BoundKernel",
    "TritonCall": f"{_TRITON}.call:OpCall",
    "launch_append": f"{_TRITON}.launchers:launch_append",
    "launch_absorbed": f"{_TRITON}.launchers:launch_absorbed",
    "gluon_decode_choice": f"{_TRITON}.launchers:gluon_decode_choice",
    "launch_gluon_decode": f"{_TRITON}.launchers:launch_gluon_decode",
    "num_sms": f"{_TRITON}.tuning:num_sms",
    "LOG2E": f"{_TRITON}.launchers:LOG2E",
    "quantize_queries": f"{_TRITON}.launchers:quantize_queries",
    # sparse MLA
    "INDEXER_METADATA": f"{_OPS}.attention.sparse_mla:INDEXER_METADATA",
    "IndexScoresConfig": f"{_TRITON}.tuning:IndexScoresConfig",
    "index_scores_config": f"{_TRITON}.tuning:index_scores_config",
    "launch_index_scores": f"{_TRITON}.sparse:launch_index_scores",
    "triton_sparse": f"{_TRITON}.sparse",
    # MoE
    "MoEConfig": f"{_OPS}.moe:MoEConfig",
    "fused_moe": f"{_OPS}.moe:fused_moe",
    "moe_config": f"{_OPS}.moe.tuning:moe_config",
    "moe_fp8_config": f"{_OPS}.moe.tuning:moe_fp8_config",
    "moe_kernels": f"{_OPS}.moe.kernels",
    "expert_layout": f"{_OPS}.moe.ops:expert_layout",
    "RoutingSpec": f"{_OPS}.moe.routing:RoutingSpec",
    "gate_logits": f"{_OPS}.moe.routing:gate_logits",
    "route_reference": f"{_OPS}.moe.routing:route_reference",
    # block-FP8 linears and experts
    "FP8_LINEAR_BACKENDS": f"{_OPS}.fp8.backends:FP8_LINEAR_BACKENDS",
    "FP8LinearNode": f"{_OPS}.fp8.backends:FP8LinearNode",
    "fp8_linear_backend": f"{_OPS}.fp8.backends:fp8_linear_backend",
    "fp8_linear_op": f"{_OPS}.fp8.backends:fp8_linear_op",
    "GemmConfig": f"{_OPS}.fp8.gemm_triton:GemmConfig",
    "gemm_config": f"{_OPS}.fp8.gemm_triton:gemm_config",
    "triton_block_linear": f"{_OPS}.fp8.gemm_triton:triton_block_linear",
    "w8a8_block_linear_emulated": f"{_OPS}.fp8.emulation:w8a8_block_linear_emulated",
    "fused_moe_fp8": f"{_OPS}.moe.fp8:fused_moe_fp8",
    "moe_experts_fp8_emulated": f"{_OPS}.moe.fp8:moe_experts_fp8_emulated",
    "random_block_weight": "autodeploy_mla.testing.fp8_kernels:random_block_weight",
    # the package itself (where it was imported from), and test support
    "package": "autodeploy_mla",
    "scenarios_step_descriptor": "autodeploy_mla.testing.scenarios:step_descriptor",
    "install_fake_flashinfer": "autodeploy_mla.testing.fake_flashinfer:install_fake_flashinfer",
}

#: public name here -> a private name of the package (see the module docstring)
REACH_INS: dict[str, str] = {
    "reduce_meta": f"{_TRITON}.launchers:_reduce_meta",
    "GLUON_ERROR": f"{_TRITON}.gluon_common:_GLUON_ERROR",
    "gluon_alloc_ring": f"{_TRITON}.gluon_common:_alloc_ring",
    "gluon_loader": f"{_TRITON}.gluon_common:_loader",
    "gluon_work_item": f"{_TRITON}.gluon_common:_work_item",
    "moe_tile_of": f"{_OPS}.moe.kernels:_tile_of",
    "persistent_programs": f"{_OPS}.moe.ops:_persistent_programs",
    "free_port": "autodeploy_mla.serving.server:_free_port",
}

WHERE: dict[str, str] = {**PUBLIC, **REACH_INS}
__all__ = sorted([*WHERE, "shuffle_free_pages", "triton_launch_config", "index_scores_launch_config"])


def shuffle_free_pages(allocator: Any, seed: int) -> None:
    """Put a PageAllocator's free pages in a random order (seeded), so a benchmark's sequences get
    scattered pages as a long-running server's do, not consecutive ones. The allocator has no
    public way to do this: a reach-in into its free list, kept here with the others."""
    random.Random(seed).shuffle(allocator._free)


def resolve(name: str) -> Any:
    """The object `name` stands for, importing its module now."""
    module, _, attr = WHERE[name].partition(":")
    obj = importlib.import_module(module)
    return getattr(obj, attr) if attr else obj


def __getattr__(name: str) -> Any:
    if name not in WHERE:
        raise AttributeError(f"benchmarks.lib.product has no {name!r}; add it to PUBLIC (or REACH_INS)")
    value = resolve(name)
    globals()[name] = value
    return value


@contextlib.contextmanager
def triton_launch_config(name: str, cfg: Any):
    """Make the Triton op launch its prefill kernels with `cfg` while the block runs: `name` is the
    config function the op calls (`expand_config` / `absorb_prefill_config`), swapped where the op
    module looks it up. TritonPolicy has no launch-config knob yet, so the `--tune` sweep of the
    kernel benchmark needs this one patch; it lives here because it depends on which module does
    the lookup."""
    op = resolve("triton_launchers")
    orig = getattr(op, name)
    setattr(op, name, lambda *a, **k: cfg)
    try:
        yield
    finally:
        setattr(op, name, orig)


@contextlib.contextmanager
def index_scores_launch_config(cfg: Any):
    """Make the Triton DSA indexer op launch its score kernel with `cfg` while the block runs (the
    op's module looks the config function up by name), so a benchmark can try the best config of
    `benchmarks/kernels/sweep_index_scores.py` in the same device call before it is committed."""
    op = resolve("triton_sparse")
    orig = op.index_scores_config
    op.index_scores_config = lambda *a, **k: cfg
    try:
        yield
    finally:
        op.index_scores_config = orig
