"""The torch reference cached op == the source op on whole sequences, over multi-step schedules."""

import pytest
import torch

from autodeploy_mla.custom_ops import MLADims, MLAShapeError, get_backend
from autodeploy_mla.runtime import PageAllocator, SequenceInfo, StepSequence
from autodeploy_mla.testing import STANDARD_SCHEDULES, run_scenario

DIMS = {
    "deepseek": MLADims(8, 128, 64, 128, 512),
    "glm_4_7_flash": MLADims(4, 192, 64, 256, 512),
    "mistral_small_4": MLADims(4, 64, 64, 128, 256),
    "minicpm3": MLADims(40, 64, 32, 64, 256),
    "nope": MLADims(4, 32, 0, 48, 64),
}


@pytest.mark.parametrize("dims_name", list(DIMS))
@pytest.mark.parametrize("schedule", list(STANDARD_SCHEDULES))
def test_cached_equals_source(dims_name, schedule):
    res = run_scenario("torch", DIMS[dims_name], STANDARD_SCHEDULES[schedule], page_size=4,
                       seed=len(schedule) + len(dims_name))
    assert res.max_rel_error() < 1e-5


def test_scale_is_honoured():
    d = DIMS["deepseek"]
    res = run_scenario("torch", d, STANDARD_SCHEDULES["mixed"], scale=0.31)
    assert res.max_rel_error() < 1e-5


@pytest.mark.parametrize("page_size", [1, 3, 16])
def test_page_sizes(page_size):
    res = run_scenario("torch", MLADims(3, 16, 8, 24, 32), STANDARD_SCHEDULES["mixed"], page_size=page_size)
    assert res.max_rel_error() < 1e-5


def test_padded_steps_are_harmless():
    d = MLADims(3, 16, 8, 24, 32)
    sch = STANDARD_SCHEDULES["mixed"]
    res = run_scenario("torch", d, sch, pad_to={1: 12, 4: 7}, max_batch_size=8)
    assert res.max_rel_error() < 1e-5
    res = run_scenario("torch", d, STANDARD_SCHEDULES["long_decode"], pad_to={2: 6, 7: 5}, max_batch_size=8)
    assert res.max_rel_error() < 1e-5


def test_bf16_within_tolerance():
    res = run_scenario("torch", DIMS["mistral_small_4"], STANDARD_SCHEDULES["mixed"], dtype=torch.bfloat16)
    assert 0 < res.max_rel_error() < 1e-2


def _one_step_args(d: MLADims, dtype=torch.float32):
    info = SequenceInfo(4, 16, 16, 4)
    alloc = PageAllocator(8, 4, info.max_pages_per_seq)
    alloc.ensure_many({0: 5, 1: 1})
    info.prepare_step([StepSequence(0, [1] * 5, 0), StepSequence(1, [1], 0)], alloc.pages_of)
    t = info.num_tokens
    g = torch.Generator().manual_seed(0)
    n, dn, dr, dv, r = d.num_heads, d.qk_nope_head_dim, d.qk_rope_head_dim, d.v_head_dim, d.kv_lora_rank
    x = [torch.randn(1, t, n, dn, generator=g), torch.randn(1, t, n, dr, generator=g),
         torch.randn(1, t, r, generator=g), torch.randn(1, t, 1, dr, generator=g),
         torch.randn(n * (dn + dv), r, generator=g)]
    meta = [info.get(m) for m in get_backend("torch").metadata]
    cache = torch.randn(8, 4, r + dr, generator=g).to(dtype)
    return [a.to(dtype) for a in x], meta, cache


def test_opcheck_cached_op():
    x, meta, cache = _one_step_args(MLADims(2, 8, 4, 6, 16))
    torch.library.opcheck(torch.ops.autodeploy.torch_mla_with_cache.default, (*x, *meta, cache, 0.2))


def test_bad_inputs_change_nothing():
    x, meta, cache = _one_step_args(MLADims(2, 8, 4, 6, 16))
    before = cache.clone()
    op = torch.ops.autodeploy.torch_mla_with_cache
    with pytest.raises(MLAShapeError, match="mla_cache"):
        op(*x, *meta, cache[..., :-1], None)
    with pytest.raises(MLAShapeError, match="dtype"):
        op(*x, *meta, cache.double(), None)
    bad = list(x)
    bad[0] = bad[0].expand(2, -1, -1, -1)
    bad[1] = bad[1].expand(2, -1, -1, -1)
    bad[2] = bad[2].expand(2, -1, -1)
    bad[3] = bad[3].expand(2, -1, -1, -1)
    with pytest.raises(MLAShapeError, match="flattened token batch"):
        op(*bad, *meta, cache, None)
    assert torch.equal(cache, before)
