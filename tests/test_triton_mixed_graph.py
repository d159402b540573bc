"""Prefill and mixed steps in whole-graph CUDA graphs: the Triton op on static bounds (issue 14, item 1).

A mixed graph is captured on one batch of T tokens and replayed for any other batch of T tokens, so
under `StepDescriptor.static_bounds` no launch of the op may depend on the step's host counts.
CPU (CI, interpreted Triton): outputs equal the float64 reference over prefill, chunked prefill,
mixed, multi-token and decode steps for both kernel layouts, with and without split-K, padded
tokens get a zero output even from NaN-poisoned buffers, and two different batches of the same token
count make exactly the same launches (grid, scalars, constexprs); the runner's step descriptor and
the split graph's mixed_graph_safe flag. GPU (marked): test_piecewise.py replays mixed graphs
across batches against the eager graph.
"""

from __future__ import annotations

import pytest
import torch

from autodeploy_mla.custom_ops.triton_mla import session as tsession  # noqa: E402
from autodeploy_mla.custom_ops import get_backend
from autodeploy_mla.custom_ops.attention.registry import Target, all_backends, make_session_spec
from autodeploy_mla.custom_ops.attention.mla_dims import MLADims
from autodeploy_mla.custom_ops.attention.step_context import using_sessions
from autodeploy_mla.custom_ops.triton_mla import op as top
from autodeploy_mla.custom_ops.triton_mla.launch import BoundKernel
from autodeploy_mla.custom_ops.triton_mla import TritonPolicy
from autodeploy_mla.runtime.model_runner import step_descriptor
from autodeploy_mla.runtime.page_allocator import PageAllocator
from autodeploy_mla.runtime.sequence_info import SequenceInfo, StepSequence
from autodeploy_mla.testing.scenarios import REAL_MLA_DIMS, run_scenario

pytestmark = pytest.mark.skipif("triton" not in all_backends(), reason="triton backend not registered")

#: prefill, a chunk over a cached prefix next to decode, multi-token rows, ragged prefill + decode
SCHEDULE = [{0: 6}, {0: 1, 1: 7}, {0: 1, 1: 1, 2: 5}, {2: 4, 0: 1, 1: 1}, {0: 3, 1: 1, 2: 1, 3: 9},
            {0: 1, 4: 20, 3: 2}]
PAD = {0: 8, 1: 16, 2: 8, 3: 8, 4: 16, 5: 32}  # every step padded to a bucket: every step is static


@pytest.mark.parametrize("dims", [
    MLADims(3, 8, 4, 8, 16),  # R < 32: heads on M only, N not a power of two
    MLADims(5, 8, 0, 16, 32),  # Dr = 0, heads on N possible
    MLADims(4, 16, 8, 16, 32),
], ids=["n3_r16", "n5_r32_dr0", "n4_r32"])
@pytest.mark.parametrize("policy", [
    TritonPolicy(poison_buffers=True),
    TritonPolicy(poison_buffers=True, decode_splits=3),
    TritonPolicy(poison_buffers=True, decode_layout="heads_on_m"),
], ids=["auto", "split3", "heads_on_m"])
def test_static_bounds_steps_match_reference(dims, policy, monkeypatch):
    launched = []
    orig = top.launch_absorbed

    def spy(*a, **k):
        launched.append(k.get("work_list", 0))
        return orig(*a, **k)

    monkeypatch.setattr(top, "launch_absorbed", spy)
    res = run_scenario("triton", dims, SCHEDULE, pad_to=PAD, graph_buckets={8, 16, 32}, mixed_graph_max_tokens=32,
                       policy=policy, max_batch_size=6)
    assert res.max_rel_error() < 1e-5
    assert launched == [6] * len(SCHEDULE)  # one work-list launch per step over the 6-sequence capacity
    for rows in res.extra["padded_rows"]:
        assert torch.equal(rows, torch.zeros_like(rows))  # finite and zero despite NaN-poisoned buffers


@pytest.mark.parametrize("fp8_dot", [False, True])
def test_static_bounds_with_an_fp8_cache(fp8_dot):
    """e4m3 cache with per-layer scales on static bounds: the oracle on the same e4m3 values (tiles
    converted to the query dtype: fp32 rounding; e4m3 products: within the format's error)."""
    from autodeploy_mla.custom_ops.attention.cache_format import FP8_DTYPE, CacheScales

    res = run_scenario("triton", MLADims(4, 16, 8, 16, 32), SCHEDULE, pad_to=PAD, graph_buckets={8, 16, 32},
                       mixed_graph_max_tokens=32, max_batch_size=6, cache_dtype=FP8_DTYPE,
                       cache_scales=CacheScales(0.37, 2.5), seed=3,
                       policy=TritonPolicy(poison_buffers=True, fp8_dot=fp8_dot))
    if fp8_dot:
        assert 1e-4 < res.max_rel_error() < 5e-2, res.max_rel_error()
    else:
        assert res.max_rel_error() < 1e-5, res.max_rel_error()
    for rows in res.extra["padded_rows"]:
        assert torch.equal(rows, torch.zeros_like(rows))


def test_other_batches_of_the_same_token_count_make_identical_launches(monkeypatch):
    """What a captured graph freezes (grid, scalar arguments, constexprs, buffers) must not depend on
    how the step's tokens split into sequences: a graph captured on one batch replays them all."""
    dims = MLADims(4, 16, 8, 16, 32)
    record: list[tuple] = []
    orig = BoundKernel.launch

    def spy(self, grid, ptrs, scalars):
        record.append((self.fn, tuple(grid), tuple(scalars), tuple(sorted(self.constexprs.items())),
                       tuple(p.shape if isinstance(p, torch.Tensor) else p for p in ptrs)))
        return orig(self, grid, ptrs, scalars)

    monkeypatch.setattr(BoundKernel, "launch", spy)
    be = get_backend("triton")
    sess = be.setup(make_session_spec([dims], torch.float32, "cpu", Target.detect("cpu", 4), 6, 16, 8))
    info = SequenceInfo(6, 16, 32, 4, torch.device("cpu"))
    alloc = PageAllocator(60, 4, info.max_pages_per_seq)
    cache = torch.zeros(60, 4, dims.latent_dim)
    gen = torch.Generator().manual_seed(0)
    w = torch.randn(dims.num_heads * (dims.qk_nope_head_dim + dims.v_head_dim), dims.kv_lora_rank, generator=gen) / 4
    launches = []
    for batch in ([(0, 12, 0)], [(1, 3, 0), (2, 1, 0), (3, 7, 0)], [(1, 1, 3), (2, 5, 1), (3, 1, 7), (4, 2, 0)]):
        alloc.ensure_many({sid: n + c for sid, n, c in batch})
        info.prepare_step([StepSequence(sid, [1] * n, c) for sid, n, c in batch], alloc.pages_of, pad_to=16)
        step = step_descriptor(info, (16,), 16)
        assert step.static_bounds and step.cuda_graph
        sess.prepare(info, step)
        x = [torch.randn(1, 16, dims.num_heads, dims.qk_nope_head_dim, generator=gen),
             torch.randn(1, 16, dims.num_heads, dims.qk_rope_head_dim, generator=gen),
             torch.randn(1, 16, dims.kv_lora_rank, generator=gen),
             torch.randn(1, 16, 1, dims.qk_rope_head_dim, generator=gen), w]
        record.clear()
        with using_sessions({"triton": sess}):
            be.cached_op.default(*x, *[info.get(m) for m in be.metadata], cache, None)
        launches.append(list(record))
    assert launches[0] and launches[0] == launches[1] == launches[2]


def test_step_descriptor_marks_static_bounds_only_for_mixed_buckets():
    info = SequenceInfo(4, 32, 64, 4, torch.device("cpu"))
    alloc = PageAllocator(40, 4, info.max_pages_per_seq)

    def desc(seqs, pad, buckets=(4, 8, 16), mixed_max=8):
        alloc.ensure_many({sid: n + c for sid, n, c in seqs})
        info.prepare_step([StepSequence(sid, [1] * n, c) for sid, n, c in seqs], alloc.pages_of, pad_to=pad)
        return step_descriptor(info, buckets, mixed_max)

    d = desc([(0, 1, 3), (1, 1, 5)], 4)  # decode-only, padded with dummy sequences: the decode graph
    assert d.cuda_graph and not d.static_bounds
    d = desc([(0, 5, 0), (1, 1, 5)], 8)  # mixed, bucket 8 <= 8
    assert d.cuda_graph and d.static_bounds
    assert not desc([(0, 9, 0)], 16).static_bounds  # bucket 16 > mixed_graph_max_tokens
    assert not desc([(0, 5, 0)], 8, mixed_max=0).cuda_graph  # mixed graphs off
    assert not desc([(0, 5, 0)], None).cuda_graph  # unpadded, not a bucket


def test_split_graph_reports_mixed_graph_safety():
    from autodeploy_mla.transforms.piecewise import split_graph

    def graph_with(op):
        g = torch.fx.Graph()
        xs = [g.placeholder(f"a{i}") for i in range(len(op._schema.arguments))]
        out = g.call_function(op, (g.call_function(torch.ops.aten.add.Tensor, (xs[0], 1.0)), *xs[1:]))
        g.output((g.call_function(torch.ops.aten.mul.Tensor, (out, 2.0)),))
        return torch.fx.GraphModule(torch.nn.Module(), g)

    tri = split_graph(graph_with(get_backend("triton").cached_op.default))
    assert tri.mixed_graph_safe and "mixed_graph_safe" in tri.mixed_graph_reason
    ref = split_graph(graph_with(get_backend("torch").cached_op.default))
    assert not ref.mixed_graph_safe and "'torch'" in ref.mixed_graph_reason
    sparse = get_backend("triton").sparse_ops.attention  # sparse attention sizes launches from host counts
    sp = split_graph(graph_with(getattr(sparse, "default", sparse)))
    assert not sp.mixed_graph_safe and "triton" in sp.mixed_graph_reason


def test_long_prefix_chunks_are_declined_and_short_steps_kept():
    """Static bounds absorb the prefill part: a chunk on a long prefix (absorbing costs far more
    than expanding) is declined and runs piecewise; fresh prefills and decode-like chunks are kept."""
    dims = MLADims(16, 128, 64, 128, 512)  # DeepSeek-V2-Lite
    sess = get_backend("triton").setup(make_session_spec([dims], torch.bfloat16, "cpu", Target.detect("cpu", 64),
                                                         32, 256, 80))
    info = SequenceInfo(32, 256, 5120, 64, torch.device("cpu"))
    alloc = PageAllocator(800, 64, info.max_pages_per_seq)

    def ok(seqs):
        for sid in alloc.owners():
            alloc.free(sid)
        alloc.ensure_many({sid: n + c for sid, n, c in seqs})
        info.prepare_step([StepSequence(sid, [1] * n, c) for sid, n, c in seqs], alloc.pages_of)
        return sess.static_bounds_ok(info)

    assert ok([(0, 60, 0)] + [(i, 1, 1024) for i in range(1, 5)])
    assert ok([(0, 120, 1024)] + [(i, 1, 1024) for i in range(1, 9)])
    assert ok([(0, 256, 0)])
    assert ok([(i, 4, 1024) for i in range(16)])
    assert sess.stats()["static_bounds_declined"] == 0
    assert not ok([(0, 240, 4096)] + [(i, 1, 2048) for i in range(1, 17)])  # H200: 0.91-0.94x as a graph
    assert sess.stats()["static_bounds_declined"] == 1


def test_model_steps_on_static_bounds_generate_hf_greedy_tokens(monkeypatch):
    """The whole model through the runner with every prefill / mixed step marked static_bounds (as
    CUDA-graph buckets would; on CPU the graph runs eagerly, the op on static bounds): greedy tokens
    equal HF eager; a declined step (threshold forced below 0) runs as an ordinary step."""
    from autodeploy_mla.api import optimize
    from autodeploy_mla.runtime.piecewise import PiecewiseRunner
    from autodeploy_mla.testing import hf_greedy_generate
    from autodeploy_mla.testing.tiny_configs import TINY_CONFIGS

    cfg = dict(TINY_CONFIGS["deepseek_v3"], num_hidden_layers=2)
    om = optimize(None, {
        "model": {"hf_config": cfg, "device": "cpu", "dtype": "float32"},
        "runtime": {"max_batch_size": 4, "max_seq_len": 64, "max_num_tokens": 16, "page_size": 4},
        "transforms": {"piecewise": {"enabled": True, "on_cpu": True},
                       "insert_cached_mla_attention": {"backend": "triton"}},
    })
    pw = om.runner.piecewise
    assert pw.split.mixed_graph_safe
    monkeypatch.setattr(PiecewiseRunner, "capture_buckets", property(lambda self: (1, 2, 4, 8, 16)))
    pw.mixed_graph_max_tokens = 16
    steps = []
    orig = top._attend_static

    def spy(*a, **k):
        steps.append(a[0])
        return orig(*a, **k)

    monkeypatch.setattr(top, "_attend_static", spy)
    prompts = [[5, 6, 7], [3, 4], [9, 8, 7, 6, 5, 4, 3, 2, 1, 11, 12]]
    got = om.generate(prompts, max_new_tokens=5)
    for p, g in zip(prompts, got):
        assert g == hf_greedy_generate(om.eager_model, p, 5)
    assert steps  # the static path ran (prefill steps padded to buckets <= 16)
    sess = om.runner.sessions["triton"]
    monkeypatch.setattr(tsession, "STATIC_MAX_EXTRA_FLOPS", -1.0)
    n = len(steps)
    assert om.generate(prompts[:1], max_new_tokens=2) == [hf_greedy_generate(om.eager_model, prompts[0], 2)]
    assert len(steps) == n and sess.stats()["static_bounds_declined"] >= 1


@pytest.mark.gpu
@pytest.mark.parametrize("dims_name", sorted(REAL_MLA_DIMS))
@pytest.mark.parametrize("layout", ["auto", "heads_on_m"])
def test_gpu_static_bounds_steps_on_real_dims(dims_name, layout):
    """bf16, 64-token pages, every step on static bounds (fresh prefills crossing pages, a chunk on
    a cached prefix next to decodes, spec-verify rows): the float64 reference within bf16 error."""
    if not torch.cuda.is_available():
        pytest.skip("needs a CUDA GPU")
    sch = [{0: 200, 1: 40, 2: 1}, {0: 1, 1: 1, 2: 120, 3: 60}, {0: 1, 1: 1, 2: 4, 3: 9, 4: 1}, {4: 100}]
    pad = {0: 256, 1: 256, 2: 16, 3: 128}
    res = run_scenario("triton", REAL_MLA_DIMS[dims_name], sch, pad_to=pad, graph_buckets={16, 128, 256},
                       mixed_graph_max_tokens=256, max_batch_size=8, page_size=64, dtype=torch.bfloat16,
                       device="cuda", seed=5,
                       policy=TritonPolicy(poison_buffers=True, decode_layout=layout))
    assert 0 < res.max_rel_error() < 1e-2, res.max_rel_error()
    for rows in res.extra["padded_rows"]:
        assert torch.equal(rows, torch.zeros_like(rows))


@pytest.mark.gpu
@pytest.mark.parametrize("dims_name", ["deepseek_v3_tp8_n16", "glm_4_7_flash", "deepseek_v3_n128"])
def test_gpu_static_bounds_with_an_fp8_cache_on_real_dims(dims_name):
    """e4m3 cache, bf16 queries, every step on static bounds: as close to the oracle (on the same e4m3
    values) as the eager path's expanded prefill / decode is on the same schedule."""
    if not torch.cuda.is_available():
        pytest.skip("needs a CUDA GPU")
    from autodeploy_mla.custom_ops.attention.cache_format import FP8_DTYPE

    sch = [{0: 200, 1: 40, 2: 1}, {0: 1, 1: 1, 2: 120, 3: 60}, {0: 1, 1: 1, 2: 4, 3: 9, 4: 1}, {4: 100}]
    common = dict(max_batch_size=8, page_size=64, dtype=torch.bfloat16, device="cuda", seed=5,
                  cache_dtype=FP8_DTYPE, policy=TritonPolicy(poison_buffers=True))
    static = run_scenario("triton", REAL_MLA_DIMS[dims_name], sch, pad_to={0: 256, 1: 256, 2: 16, 3: 128},
                          graph_buckets={16, 128, 256}, mixed_graph_max_tokens=256, **common)
    eager = run_scenario("triton", REAL_MLA_DIMS[dims_name], sch, **common)
    assert 0 < static.max_rel_error() < 2e-2, (static.max_rel_error(), eager.max_rel_error())
    assert static.max_rel_error() < 2 * eager.max_rel_error() + 2e-3, (static.max_rel_error(), eager.max_rel_error())
    for rows in static.extra["padded_rows"]:
        assert torch.equal(rows, torch.zeros_like(rows))


def test_step_mode_is_decided_once_by_the_descriptor():
    """The model runner's descriptor carries the mode and the bucket the piecewise runner runs (issue 43):
    decode graph, mixed graph, pieces or eager, from the same facts the old runner re-checked per step."""
    from autodeploy_mla.custom_ops.attention.registry import StepDescriptor
    from autodeploy_mla.runtime.model_runner import without_static_bounds

    info = SequenceInfo(8, 16, 64, 4, "cpu")
    alloc = PageAllocator(64, 4, 16)

    def describe(spec, buckets=(4, 8, 16), mixed_max=8, decode_graph=True):
        alloc.ensure_many({i: c + n for i, (c, n) in enumerate(spec)})
        info.prepare_step([StepSequence(i, [0] * n, c) for i, (c, n) in enumerate(spec)], alloc.pages_of,
                          pad_to=next((b for b in buckets if b >= sum(n for _, n in spec)), None))
        return step_descriptor(info, buckets, mixed_max, decode_graph=decode_graph)

    dec = describe([(3, 1)] * 4)
    assert (dec.mode, dec.bucket, dec.cuda_graph, dec.static_bounds) == ("decode_graph", 4, True, False)
    assert describe([(3, 1)] * 4, decode_graph=False).mode == "piecewise"
    mixed = describe([(0, 5)])
    assert (mixed.mode, mixed.bucket, mixed.static_bounds) == ("mixed_graph", 8, True)
    assert (without_static_bounds(mixed).mode, without_static_bounds(mixed).bucket) == ("piecewise", 8)
    assert describe([(0, 12)]).mode == "piecewise"  # over mixed_graph_max_tokens
    eager = describe([(0, 5)], buckets=())
    assert (eager.mode, eager.bucket) == ("eager", None)
    with pytest.raises(ValueError, match="a bucket is given exactly when"):
        StepDescriptor(4, 4, 4, True, mode="piecewise")
