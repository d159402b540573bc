"""Contracts every registered backend keeps (fails when a new backend forgets one)."""

import pytest

from autodeploy_mla.custom_ops import all_backends, cached_ops

SHARED_PREFIX = ["q_nope", "q_pe", "compressed_kv", "kpe", "kv_b_proj_weight"]


@pytest.mark.parametrize("name", sorted(all_backends()))
def test_cached_op_schema(name):
    be = all_backends()[name]
    schema = be.cached_op.default._schema
    args = [a.name for a in schema.arguments]
    assert args[:5] == SHARED_PREFIX, "cached ops share one positional signature (DESIGN §6)"
    # sparse-only backends' ops also take the layer's selection after the metadata
    meta = [*be.metadata, *(["topk_indices"] if be.sparse_only else [])]
    assert args[5 : 5 + len(meta)] == meta, "metadata in the declared order"
    assert args[5 + len(meta)] == "mla_cache"
    cache_arg = schema.arguments[5 + len(meta)]
    assert cache_arg.alias_info is not None and cache_arg.alias_info.is_write, "the cache write must be declared"
    assert args[6 + len(meta)] == "scale"
    written = [a.name for a in schema.arguments if a.alias_info is not None and a.alias_info.is_write]
    assert written == ["mla_cache"], f"undeclared or unexpected mutation: {written}"


@pytest.mark.parametrize("name", sorted(all_backends()))
def test_dynamic_ops_are_split_points(name):
    be = all_backends()[name]
    assert be.is_dynamic and be.cached_op.default in cached_ops()
    assert be.cached_op in be.split_ops()
    if be.sparse_ops is not None:  # declared sparse ops are split points too
        assert {be.sparse_ops.indexer, be.sparse_ops.attention} <= set(be.split_ops())


def test_sparse_ops_are_declared_and_resolved_through_the_registry():
    """Each backend serving sparse layers declares its ops; a backend reusing another's indexer names it
    (no import between backends), and the one lookup resolves both."""
    from autodeploy_mla.custom_ops.attention.registry import sparse_backends, sparse_ops_of

    assert sparse_backends() == ("torch", "triton")
    fi = sparse_ops_of("flashinfer_mla_sparse")
    assert fi.attention is all_backends()["flashinfer_mla_sparse"].cached_op
    assert fi.indexer is sparse_ops_of("triton").indexer
    assert all_backends()["flashinfer_mla"].sparse_sibling == "flashinfer_mla_sparse"
    with pytest.raises(KeyError, match="serves no sparse"):
        sparse_ops_of("flashinfer_trtllm_mla")
