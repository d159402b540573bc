"""DeepSeek Sparse Attention (DeepSeek-V3.2, GLM-5): detected and refused with a clear error until the
compiler captures it (issue 16, docs/sparse_mla.md).

The tiny configs keep index_topk (6) below the 16-token prompt, so the sparse model's logits differ
from dense attention on the same weights: the test shows what a silent dense compile would change.
"""

from __future__ import annotations

import pytest
import torch

from autodeploy_mla.api import optimize
from autodeploy_mla.models.sparse_attention import find_sparse_attention
from autodeploy_mla.testing.tiny_configs import build_tiny_model
from autodeploy_mla.transforms.export import SparseAttentionNotCaptured

_COMMON = dict(vocab_size=256, hidden_size=64, intermediate_size=96, moe_intermediate_size=32,
               num_attention_heads=4, num_key_value_heads=4, q_lora_rank=48, kv_lora_rank=40,
               qk_nope_head_dim=24, qk_rope_head_dim=16, n_routed_experts=8, num_experts_per_tok=2,
               n_shared_experts=1, first_k_dense_replace=1, index_head_dim=32, index_topk=6,
               max_position_embeddings=256, tie_word_embeddings=False)
# 12-16 index heads: an index score is exactly 0 (every head's relu 0) with probability 2^-H, and
# ties at the top-k boundary would make the selection implementation-defined.
TINY_DSA = {
    "deepseek_v32": dict(_COMMON, model_type="deepseek_v32", num_hidden_layers=3, v_head_dim=20,
                         index_n_heads=16, n_group=2, topk_group=1),
    "glm_moe_dsa": dict(_COMMON, model_type="glm_moe_dsa", num_hidden_layers=4, v_head_dim=28, index_n_heads=12,
                        n_group=1, topk_group=1, indexer_types=["full", "full", "shared", "full"],
                        rope_parameters=dict(rope_type="default", rope_theta=1e6)),
}


@pytest.mark.parametrize("family", list(TINY_DSA))
def test_sparse_attention_is_detected_and_refused(family):
    model = build_tiny_model(TINY_DSA[family])
    info = find_sparse_attention(model)
    assert info is not None and info.index_topk == 6
    if family == "glm_moe_dsa":
        assert info.shared_layers == (2,)
        assert info.indexer_paths == tuple(f"model.layers.{i}.self_attn.indexer" for i in (0, 1, 3))
    else:
        assert info.indexer_paths == tuple(f"model.layers.{i}.self_attn.indexer" for i in range(3))
    with pytest.raises(SparseAttentionNotCaptured, match=r"model\.layers\.0\.self_attn\.indexer.*index_topk=6"):
        optimize(model)


@pytest.mark.parametrize("family", list(TINY_DSA))
def test_sparse_differs_from_dense_past_index_topk(family):
    """Why the refusal: with every indexer's top-k widened past the prompt the model is dense MLA, and
    its logits move at the positions that see more than index_topk tokens (and only there)."""
    model = build_tiny_model(TINY_DSA[family])
    ids = torch.randint(2, 256, (1, 16), generator=torch.Generator().manual_seed(0))
    with torch.no_grad():
        sparse = model(ids).logits
        for layer in model.model.layers:
            if layer.self_attn.indexer is not None:
                layer.self_attn.indexer.index_topk = 16
        dense = model(ids).logits
    diff = (sparse - dense).abs().amax(-1)[0]
    assert diff[:6].max() < 1e-4  # rows that see <= index_topk tokens keep all of them
    assert diff[6:].min() > 1e-3


def test_dense_families_are_not_sparse():
    assert find_sparse_attention(build_tiny_model("deepseek_v3")) is None
