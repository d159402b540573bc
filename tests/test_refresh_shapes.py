"""Passes declared `refresh_shapes="missing"` (fuse_gemms, fuse_moe) keep every existing node's
shape and give the new nodes theirs: after the whole pipeline, each node's fake value equals what a
full re-propagation computes. (The full run costs seconds of symbolic-shape work on a 27-layer graph,
the missing-only one milliseconds: the start-up of every server pays for it.)"""

from __future__ import annotations

import pytest
import torch

from autodeploy_mla.api import build_config
from autodeploy_mla.custom_ops.attention.registry import Target
from autodeploy_mla.models.factory import build_model
from autodeploy_mla.transforms.context import BuildContext
from autodeploy_mla.transforms.fx_utils import refresh_shapes
from autodeploy_mla.transforms.pass_manager import run_pipeline
from autodeploy_mla.transforms.registry import registered_passes


def _vals(gm: torch.fx.GraphModule) -> dict[str, tuple]:
    out = {}
    for n in gm.graph.nodes:
        v = n.meta.get("val")
        if isinstance(v, torch.Tensor):
            out[n.name] = (tuple(str(s) for s in v.shape), v.dtype, tuple(str(s) for s in v.stride()))
        elif isinstance(v, (tuple, list)):
            out[n.name] = tuple((tuple(str(s) for s in t.shape), t.dtype) for t in v if isinstance(t, torch.Tensor))
    return out


def test_missing_only_is_declared_by_the_fusion_passes():
    passes = registered_passes()
    assert passes["fuse_gemms"].refresh_shapes == "missing" and passes["fuse_moe"].refresh_shapes == "missing"
    assert passes["shard"].refresh_shapes is True  # sharding changes shapes: the whole graph


@pytest.mark.parametrize("family", ["deepseek_v3", "deepseek_v2", "glm_4_7_flash"])
def test_missing_only_refresh_equals_a_full_one(family):
    """The graph right after the fusion passes (cache insertion changes the inputs' shapes on purpose)."""
    later = ["fuse_routing", "real_rope", "insert_cached_mla_attention", "gather_logits", "piecewise"]
    cfg, pipeline = build_config(family, None, ["model.device=cpu", "model.dtype=float32",
                                                "transforms.fuse_moe.backend=torch",
                                                *(f"transforms.{p}.enabled=false" for p in later)])
    device, dtype = torch.device("cpu"), torch.float32
    ctx = BuildContext(cfg, build_model(cfg.model, device, dtype), device, dtype,
                       Target.detect(device, cfg.runtime.page_size), None)
    run_pipeline(ctx, pipeline)
    gm = ctx.gm
    # the pipeline regenerates the module's code once, after the last pass: it runs the final graph
    assert gm.code == gm.graph.python_code("self").src
    before = _vals(gm)
    assert any(n.op == "get_attr" and "fused" in str(n.target) for n in gm.graph.nodes)  # fuse_gemms ran
    refresh_shapes(gm)
    after = _vals(gm)
    assert before == after
