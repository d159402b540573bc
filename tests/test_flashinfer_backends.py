"""FlashInfer MLA backends: capability checks, host metadata, the ops end to end on CPU, and GPU tests.

CPU tests run without FlashInfer: capability checks take mocked versions/devices, and the ops run
against a small *fake* FlashInfer (pure torch) that enforces the real APIs' argument contracts
(keyword names, dtypes, shapes, strides, block-table padding, fixed CUDA-graph buffers) and computes
the attention from the CSR / block-table metadata it is given — so every index our code builds is
checked by the numbers. GPU tests (marked `gpu`) run the real FlashInfer on the H200.
"""

from __future__ import annotations

import math
import os
import subprocess
import sys

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from autodeploy_mla.custom_ops.triton_mla import step_shape as tshape, session as tsession  # noqa: E402
from autodeploy_mla.custom_ops import DeviceInfo, MLADims, SessionSpec, Target, get_backend, library_versions
from autodeploy_mla.custom_ops.flashinfer import capabilities as caps
from autodeploy_mla.custom_ops.flashinfer import trtllm_mla as ft
from autodeploy_mla.custom_ops.attention.handoff import resolve_fallback
from autodeploy_mla.custom_ops.flashinfer.common import FI_METADATA, PlanKey
from autodeploy_mla.custom_ops.flashinfer.mla import FlashInferPolicy
from autodeploy_mla.custom_ops.attention.prefill_cost import PathCost, PrefillCostFacts, path_costs
from autodeploy_mla.custom_ops.attention.step_context import using_sessions
from autodeploy_mla.custom_ops.flashinfer.metadata import (
    StepCounts,
    fa_plan_work_bound,
    fa_plan_work_count,
    fill_trtllm_block_table,
    mla_csr,
    trtllm_block_table,
    trtllm_block_table_width,
)
from autodeploy_mla.runtime import PageAllocator, SequenceInfo, StepSequence
from autodeploy_mla.runtime.piecewise import bucket_for
from autodeploy_mla.testing import STANDARD_SCHEDULES, run_scenario
from autodeploy_mla.testing.fake_flashinfer import install_fake_flashinfer
from autodeploy_mla.runtime.model_runner import step_descriptor

BF16 = torch.bfloat16

# ============================================================== capability tables
SM = {"sm80": DeviceInfo("cuda", (8, 0), "A100"), "sm90": DeviceInfo("cuda", (9, 0), "H200"),
      "sm100": DeviceInfo("cuda", (10, 0), "B200"), "cpu": DeviceInfo("cpu")}
VERSIONS = {"absent": None, "0.6.x": "0.6.18.post1", "0.7.x": "0.7.2"}
RANK_ROPE = [(512, 64), (256, 64), (256, 32), (128, 64), (512, 0)]
HEADS = [16, 96, 128]


def T(device, versions, page_size=64):
    return Target(device, versions, page_size)


def spec_for(dims_list, dtype, target, info, device="cpu"):
    return SessionSpec(tuple(dims_list), dtype, torch.device(device), target, info.max_batch_size,
                       info.max_num_tokens, info.max_pages_per_seq)


def expected_fa(version: str, dev: str, r: int, dr: int, n: int) -> bool:
    """DESIGN §8 for BatchMLAPagedAttentionWrapper, written out independently of capabilities.py."""
    if version == "absent" or dev == "cpu":
        return False
    if version == "0.6.x":
        return (r, dr) == (512, 64)
    if dev == "sm90":  # fa3, 0.7.x
        return r in (128, 256, 512) and dr in (0, 64)
    return r % 128 == 0 and r <= 512 and dr in (0, 64)  # fa2, 0.7.x


def expected_trtllm(version: str, dev: str, r: int, dr: int, n: int) -> bool:
    if version == "absent" or dev != "sm100":
        return False
    return (r, dr) in ((512, 64), (256, 64)) and not (64 < n < 128)


@pytest.mark.parametrize("n", HEADS)
@pytest.mark.parametrize("rank_rope", RANK_ROPE, ids=lambda x: f"R{x[0]}Dr{x[1]}")
@pytest.mark.parametrize("dev", list(SM))
@pytest.mark.parametrize("version", list(VERSIONS))
def test_check_table(version, dev, rank_rope, n):
    r, dr = rank_rope
    dims = MLADims(n, 128, dr, 128, r)
    vers = {"torch": "2.13", "triton": "3.6.0", "flashinfer": VERSIONS[version]}
    for name, expect in (("flashinfer_mla", expected_fa), ("flashinfer_trtllm_mla", expected_trtllm)):
        res = get_backend(name).check(dims, BF16, T(SM[dev], vers))
        want = expect(version, dev, r, dr, n)
        assert res.ok == want, (name, res.reason)
        assert res.reason  # every answer says why
        if version == "absent":
            assert "flashinfer not installed" in res.reason
        elif dev == "cpu":
            assert "CUDA" in res.reason


@pytest.mark.parametrize("version", ["0.5.3", "0.8.0", "1.0.0", "garbage"])
def test_unknown_versions_are_refused(version):
    d = MLADims(128, 128, 64, 128, 512)
    for name in ("flashinfer_mla", "flashinfer_trtllm_mla"):
        for dev in ("sm90", "sm100"):
            res = get_backend(name).check(d, BF16, T(SM[dev], {"flashinfer": version}))
            assert not res.ok
            assert "unparsable" in res.reason or "no " in res.reason


def test_check_dtype_page_and_reasons():
    fa, tr = get_backend("flashinfer_mla"), get_backend("flashinfer_trtllm_mla")
    d = MLADims(128, 128, 64, 128, 512)
    v6 = {"flashinfer": "0.6.18.post1"}
    assert fa.check(d, torch.float16, T(SM["sm90"], v6, 64)).ok
    assert "dtype float32" in fa.check(d, torch.float32, T(SM["sm90"], v6, 64)).reason
    assert not tr.check(d, torch.float16, T(SM["sm100"], v6, 64)).ok  # trtllm-gen: bf16 only
    for ps, ok in ((1, True), (16, True), (32, True), (64, True), (128, False), (4, False)):
        assert fa.check(d, BF16, T(SM["sm90"], v6, ps)).ok == ok
    for ps, ok in ((16, False), (32, True), (64, True), (128, False)):
        res = tr.check(d, BF16, T(SM["sm100"], v6, ps))
        assert res.ok == ok and (ok or "page_size" in res.reason)
    # The measured 0.6.18 crash is named, not just "unsupported".
    res = fa.check(MLADims(128, 128, 64, 128, 256), BF16, T(SM["sm90"], v6, 64))
    assert not res.ok and "illegal memory access" in res.reason
    # N > 128 and 64 < N < 128 on trtllm-gen
    assert "limit of 128" in fa.check(MLADims(256, 128, 64, 128, 512), BF16, T(SM["sm90"], v6, 64)).reason
    assert "64 < N < 128" in tr.check(MLADims(96, 128, 64, 128, 512), BF16, T(SM["sm100"], v6, 64)).reason
    # Heads that break FlashInfer's causal tile are served, with prefill on the fallback.
    res = fa.check(MLADims(40, 64, 64, 64, 256), BF16, T(SM["sm90"], {"flashinfer": "0.7.2"}, 64))
    assert res.ok and "fallback" in res.reason
    # trtllm (256,64) is only recorded from 0.6.18
    assert not tr.check(MLADims(32, 64, 64, 128, 256), BF16, T(SM["sm100"], {"flashinfer": "0.6.5"}, 64)).ok
    assert tr.check(MLADims(32, 64, 64, 128, 256), BF16, T(SM["sm100"], {"flashinfer": "0.6.18"}, 64)).ok


def test_every_fact_cites_known_sources():
    for f in caps.FLASHINFER_FACTS:
        assert f.sources and all(s in caps.SOURCES for s in f.sources)
        assert f.min_version < f.max_version
    assert caps.fact_rows() and all(r["sources"] for r in caps.fact_rows())
    assert caps.fa_prefill_safe(128) and caps.fa_prefill_safe(16) and not caps.fa_prefill_safe(40)


# ============================================================== host metadata
def test_mla_csr_hand_computed():
    # 3 sequences, page size 4: a prefill of 5 on 2 cached, a fresh prefill of 3, a decode at length 9.
    cu = torch.tensor([0, 5, 8, 9, 9], dtype=torch.int32)
    kvlen = torch.tensor([7, 3, 9, 0], dtype=torch.int32)
    pt = torch.tensor([[5, 2, 0], [7, 0, 0], [1, 3, 4], [0, 0, 0]], dtype=torch.int32)
    csr = mla_csr(cu, kvlen, pt, 3, 4)
    assert csr.qo_indptr.tolist() == [0, 5, 8, 9]
    assert csr.kv_len.tolist() == [7, 3, 9]
    assert csr.kv_indptr.tolist() == [0, 2, 3, 6]
    assert csr.kv_indices.tolist() == [5, 2, 7, 1, 3, 4]
    assert all(t.dtype == torch.int32 for t in (csr.qo_indptr, csr.kv_indptr, csr.kv_indices, csr.kv_len))
    assert csr.qo_lens.tolist() == [5, 3, 1]
    empty = mla_csr(cu, kvlen, pt, 0, 4)
    assert empty.kv_indptr.tolist() == [0] and empty.kv_indices.numel() == 0
    with pytest.raises(ValueError, match="host tensor"):
        mla_csr(cu.to("meta"), kvlen, pt, 3, 4)
    with pytest.raises(ValueError, match="new tokens"):
        mla_csr(torch.tensor([0, 8, 9], dtype=torch.int32), torch.tensor([7, 1], dtype=torch.int32), pt, 2, 4)


def test_mla_csr_from_sequence_info():
    info = SequenceInfo(4, 32, 40, 8)
    alloc = PageAllocator(16, 8, info.max_pages_per_seq)
    alloc.ensure_many({0: 17, 1: 3, 2: 9})
    info.prepare_step([StepSequence(0, [1] * 7, 10), StepSequence(1, [1] * 3, 0), StepSequence(2, [1], 8)],
                      alloc.pages_of)
    counts = StepCounts.of(info.get("batch_info_host"))
    assert (counts.num_prefill_seqs, counts.num_prefill_tokens, counts.num_decode_seqs) == (2, 10, 1)
    csr = mla_csr(info.get("cu_seqlen_host"), info.get("seq_len_with_cache_host"), info.get("page_table_host"),
                  counts.num_seqs, 8)
    order = info.seq_ids
    want_pages = [alloc.pages_of(s)[: math.ceil(ln / 8)] for s, ln in zip(order, [17, 3, 9])]
    assert csr.kv_indices.tolist() == [p for ps in want_pages for p in ps]
    assert csr.kv_len.tolist() == [17, 3, 9] and csr.qo_indptr.tolist() == [0, 7, 10, 11]
    with pytest.raises(ValueError, match="host mirror"):
        StepCounts.of(info.get("batch_info").to("meta"))


def _work_count_reference(q_lens, kv_lens, n, num_sm, causal=True):
    """Literal transcription of FlashInfer 0.6.18 scheduler.cuh MLAPlan's work-item loop."""
    b = len(q_lens)
    avg = sum(q * n for q in q_lens) // b
    cluster = 2 if avg > 64 else 1
    clusters = num_sm // cluster
    tile = 64 * cluster

    def kv_end(q, kv, idx, tiles):
        if idx + 1 == tiles:
            return kv
        return max(min(kv - q + -(-((idx + 1) * tile) // n), kv), 0)

    total = 0
    for q, kv in zip(q_lens, kv_lens):
        tiles = -(-(q * n) // tile)
        for idx in range(tiles - 1, -1, -1):
            total += kv_end(q, kv, idx, tiles) if causal else kv
    x = max(-(-total // clusters), 1)
    limit = 32 if x <= 8 else 64 if x <= 16 else 128 if x <= 32 else 192 if x <= 64 else -(-x // 256) * 256
    works = 0
    for q, kv in zip(q_lens, kv_lens):
        tiles = -(-(q * n) // tile)
        for idx in range(tiles - 1, -1, -1):
            rem = kv_end(q, kv, idx, tiles) if causal else kv
            zero = rem == 0
            while rem > 0 or zero:
                rem -= min(rem, limit)
                works += 1
                if zero:
                    break
    return works


@settings(max_examples=120, deadline=None)
@given(data=st.lists(st.tuples(st.integers(1, 300), st.integers(0, 3000)), min_size=1, max_size=12),
       n=st.sampled_from([1, 16, 20, 40, 64, 96, 128]), num_sm=st.sampled_from([78, 132]),
       causal=st.booleans())
def test_fa_plan_work_count_matches_scheduler(data, n, num_sm, causal):
    q_lens = [q for q, _ in data]
    kv_lens = [q + extra for q, extra in data]
    got = fa_plan_work_count(torch.tensor(q_lens), torch.tensor(kv_lens), n, num_sm, causal)
    assert got == _work_count_reference(q_lens, kv_lens, n, num_sm, causal)
    assert got <= fa_plan_work_bound(torch.tensor(q_lens), n, num_sm)  # the cheap guard used per step


def test_fa_plan_work_count_large_prefill_exceeds_capacity():
    # 20000 prefill tokens at N=128: one 128-row tile per token -> over MLAPlan's 16384 work items.
    assert fa_plan_work_count(torch.tensor([20000]), torch.tensor([20000]), 128, 132) > caps.FA_MAX_WORK_ITEMS
    assert fa_plan_work_count(torch.tensor([1] * 256), torch.tensor([4096] * 256), 128, 132) < caps.FA_MAX_WORK_ITEMS


@pytest.mark.parametrize("pages,ps,width", [(5, 32, 8), (5, 64, 6), (4, 32, 4), (1, 64, 2), (0, 64, 2), (130, 32, 132)])
def test_trtllm_block_table_width(pages, ps, width):
    w = trtllm_block_table_width(pages, ps)
    assert w == width and w % (128 // ps) == 0 and w >= pages


def test_trtllm_block_table_fill():
    with pytest.raises(ValueError, match="divides 128"):
        trtllm_block_table_width(4, 48)
    pt = torch.tensor([[3, 9, 4, 0, 0], [7, 0, 0, 0, 0]], dtype=torch.int32)
    bt = trtllm_block_table(pt, 2, 32)
    assert bt.shape == (2, 8) and bt.dtype == torch.int32
    assert bt[:, :5].equal(pt) and (bt[:, 5:] == 0).all()
    dst = torch.full((4, 8), 99, dtype=torch.int32)
    fill_trtllm_block_table(dst, pt)
    assert dst[:2, :5].equal(pt) and (dst[:2, 5:] == 0).all() and (dst[2:] == 99).all()
    with pytest.raises(ValueError, match="smaller"):
        fill_trtllm_block_table(torch.zeros(1, 8, dtype=torch.int32), pt)


# ============================================================== import without FlashInfer
def test_import_and_refusal_without_flashinfer():
    code = (
        "import sys; sys.modules['flashinfer'] = None\n"
        "import torch, autodeploy_mla\n"
        "from autodeploy_mla.custom_ops import get_backend, library_versions, DeviceInfo, MLADims, Target\n"
        "from autodeploy_mla.custom_ops.flashinfer.mla import import_flashinfer_module, FlashInferUnavailable\n"
        "d = MLADims(128, 128, 64, 128, 512)\n"
        "r = get_backend('flashinfer_mla').check(d, torch.bfloat16, Target(DeviceInfo('cuda', (9, 0)), {'flashinfer': None}, 64))\n"
        "assert not r.ok and 'not installed' in r.reason, r\n"
        "try:\n    import_flashinfer_module('flashinfer.mla')\nexcept FlashInferUnavailable as e:\n"
        "    assert 'flashinfer-python' in str(e)\nelse:\n    raise SystemExit('no error')\n"
        "print('ok')\n"
    )
    env = dict(os.environ)
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, env=env, timeout=120)
    assert out.returncode == 0 and "ok" in out.stdout, out.stderr


def test_setup_refuses_without_flashinfer(monkeypatch):
    monkeypatch.setitem(sys.modules, "flashinfer", None)
    info = SequenceInfo(2, 8, 16, 16)
    target = T(SM["sm90"], {"flashinfer": None, "triton": None, "torch": "2.13"}, 16)
    with pytest.raises(ValueError, match="flashinfer not installed"):
        get_backend("flashinfer_mla").setup(spec_for([MLADims(16, 128, 64, 128, 512)], BF16, target, info))


@pytest.fixture
def fake_fi(monkeypatch):
    def install(version: str = "0.6.18.post1", sm=(9, 0)):
        install_fake_flashinfer(monkeypatch, version, sm)
    return install


#: On the fake, fallback steps go to the torch reference (Triton would run interpreted: slow).
TORCH_FB = FlashInferPolicy(fallback_order=("torch",))
DS16 = MLADims(16, 128, 64, 128, 512)  # DeepSeek per-head dims, 16 heads (a TP-8 shard)


def fa(dims, schedule, policy=TORCH_FB, **kw):
    return run_scenario("flashinfer_mla", dims, schedule, policy=policy, **kw)


# ============================================================== flashinfer_mla on the fake
@pytest.mark.parametrize("schedule", list(STANDARD_SCHEDULES))
def test_fa_scenarios_on_fake(fake_fi, schedule):
    fake_fi()
    res = fa(DS16, STANDARD_SCHEDULES[schedule], page_size=16, dtype=BF16, seed=3)
    assert 0 < res.max_rel_error() < 1e-2
    st_ = res.session
    assert st_.fallback_steps == 0
    assert st_.plans == len(STANDARD_SCHEDULES[schedule])  # one plan per step (one config)


def test_fa_scale_fp16_and_padding(fake_fi):
    fake_fi()
    res = fa(DS16, STANDARD_SCHEDULES["mixed"], page_size=16, dtype=torch.float16,
                       scale=0.3, seed=1)
    assert res.max_rel_error() < 5e-3
    res = fa(DS16, STANDARD_SCHEDULES["mixed"], page_size=16, dtype=BF16,
                       pad_to={1: 12, 4: 7}, max_batch_size=8)
    assert res.max_rel_error() < 1e-2
    res = fa(DS16, STANDARD_SCHEDULES["long_decode"], page_size=1, dtype=BF16,
                       pad_to={2: 6, 7: 5}, max_batch_size=8)
    assert res.max_rel_error() < 1e-2


def test_fa_untileable_heads_use_fallback_for_prefill(fake_fi):
    fake_fi("0.7.2")
    d = MLADims(40, 64, 64, 64, 256)  # MiniCPM3-like head count on a 0.7.x rank
    sch = STANDARD_SCHEDULES["prefill_then_decode"]
    res = fa(d, sch, page_size=16, dtype=BF16)
    assert res.max_rel_error() < 1e-2
    st_ = res.session
    assert st_.fallback_steps == 1  # the first (prefill) step
    assert st_.plans == len(sch) - 1  # decode steps still planned and run on FlashInfer


def test_fallback_runs_in_its_own_session(fake_fi):
    """The steps a FlashInfer session hands off run the fallback op inside the fallback backend's own
    per-model session (Triton's plans and FA3 prefill live there), added to the step's sessions; none
    when the configs fall back to different backends."""
    from autodeploy_mla.custom_ops.attention.cache_format import UNIT_SCALES
    from autodeploy_mla.custom_ops.attention.handoff import Fallback, call_fallback, fallback_sessions
    from autodeploy_mla.custom_ops.attention.step_context import active_session, using_sessions

    fake_fi()
    res = fa(DS16, STANDARD_SCHEDULES["prefill_then_decode"], FlashInferPolicy(prefill="fallback",
             fallback_order=("torch",)), page_size=16, dtype=BF16)
    assert res.max_rel_error() < 1e-2
    torch_sess = res.session.fallback_sessions["torch"]
    assert res.session.fallback_session(res.session.configs[next(iter(res.session.configs))]) is torch_sess
    seen = {}

    def op(*args):
        seen["fb"], seen["outer"] = active_session("fb"), active_session("outer")
        return "out"

    outer = object()
    with using_sessions({"outer": outer}):
        assert call_fallback(Fallback("fb", op, ()), (1,), {}, None, None, UNIT_SCALES, torch_sess) == "out"
    assert seen == {"fb": torch_sess, "outer": outer}
    sessions, why = fallback_sessions({1: Fallback("torch", op, ()), 2: Fallback("triton", op, ())}, res.session.spec)
    assert Fallback("fb", op, ()).call is op  # no direct call given: the op
    # resolved: the fallback backend's direct call (no second trip through the dispatcher), the op kept
    fb = resolve_fallback([DS16], BF16, Target.detect("cpu", 16), ("torch",), FI_METADATA)
    assert fb.op is get_backend("torch").cached_op and fb.call is get_backend("torch").direct_call
    assert sessions == {} and "['torch', 'triton']" in why
    assert res.session.stats()["fallback_session"] == {"torch": torch_sess.stats()}


@pytest.mark.parametrize("backend", ["flashinfer_mla", "flashinfer_trtllm_mla"])
def test_fallback_session_is_prepared_once_per_handed_step(fake_fi, monkeypatch, backend):
    """A step handed to the Triton fallback prepares Triton's session once (its host shape for all
    layers): the op then takes the session's step and shares its launch plans instead of re-reading
    the host metadata and re-making the plans in every layer. Decode steps FlashInfer runs itself
    leave the fallback session alone."""

    trtllm = backend == "flashinfer_trtllm_mla"
    fake_fi(sm=(10, 0) if trtllm else (9, 0))
    made = []
    real = tshape.StepShape.from_host.__func__

    def counting(cls, *a, **kw):
        made.append(kw.get("static", False))
        return real(cls, *a, **kw)

    monkeypatch.setattr(tshape.StepShape, "from_host", classmethod(counting))
    sch = [{0: 9, 1: 5}, {0: 1, 1: 1}]  # a prefill step (handed over), then a decode step (FlashInfer's)
    page = 32 if trtllm else 16
    fake = Target.detect("cpu", page)  # the fake's GPU, with Triton (interpreted here) installed
    target = Target(fake.device, {**fake.versions, "triton": "3.6.0"}, page)
    policy = ft.TrtllmPolicy(fallback_order=("triton",)) if trtllm else \
        FlashInferPolicy(prefill="fallback", fallback_order=("triton",))
    res = run_scenario(backend, DS16, sch, policy=policy, page_size=page, dtype=BF16, target=target)
    assert res.max_rel_error() < 1e-2
    tri = res.session.fallback_sessions["triton"]
    assert isinstance(tri, tsession.TritonMLASession)
    assert tri.step is not None and tri.step.key[:3] == (2, 14, 0)  # prepared for the prefill step
    assert tri.plans, "the op's launch plans went to the prepared session (shared by a step's layers)"
    assert len(made) == 1  # prepare read the host shape; the op call did not read it again
    assert res.session.fallback_steps == 1


@pytest.mark.parametrize("max_seqs, fast, routed", [(1, ("triton",), 2), (0, ("triton",), 0), (1, (), 0),
                                                    (2, ("triton",), 3)])
def test_small_decode_batches_go_to_the_triton_fallback(fake_fi, max_seqs, fast, routed):
    """decode_fallback_max_seqs: decode-only steps of at most that many sequences run on the fallback op
    when it is a fast decode fallback (Triton); larger ones, and prefill steps, stay FlashInfer's."""
    fake_fi(sm=(9, 0))
    fake = Target.detect("cpu", 16)
    target = Target(fake.device, {**fake.versions, "triton": "3.6.0"}, 16)
    sch = [{0: 9}, {0: 1}, {0: 1}, {0: 1, 1: 6}, {0: 1, 1: 1}]  # decode steps of 1, 1 and 2 sequences
    pol = FlashInferPolicy(prefill="flashinfer", fallback_order=("triton",), decode_fallback_max_seqs=max_seqs,
                           fast_decode_fallbacks=fast)
    res = run_scenario("flashinfer_mla", DS16, sch, policy=pol, page_size=16, dtype=BF16, target=target)
    assert res.max_rel_error() < 1e-2
    assert res.session.routed_steps == routed and res.session.fallback_steps == routed
    assert res.session.plans == len(sch) - routed
    with pytest.raises(ValueError, match="decode_fallback_max_seqs=-1"):
        FlashInferPolicy(decode_fallback_max_seqs=-1)


def _facts(expanded_overhead_us: float) -> PrefillCostFacts:
    """Both paths at 1 TFLOP/s; absorbed costs 100 us per call, expanded `expanded_overhead_us`."""
    return PrefillCostFacts(PathCost(1.0, 1.0, 100.0), PathCost(1.0, 1.0, expanded_overhead_us), "test")


@pytest.mark.parametrize("policy,fast,facts,routed", [
    ("auto", ("torch",), _facts(0.0), True),  # expanded is cheaper for DS16's prefill step
    ("auto", ("torch",), _facts(10**6), False),  # expanded's fixed cost outweighs its FLOP saving
    ("auto", ("triton",), _facts(0.0), False),  # the fallback (torch here) is not a fast one
    ("flashinfer", ("torch",), _facts(0.0), False),
    ("fallback", (), _facts(10**6), True),
])
def test_fa_prefill_policy(fake_fi, policy, fast, facts, routed):
    fake_fi()
    pol = FlashInferPolicy(prefill=policy, fast_prefill_fallbacks=fast, prefill_cost=facts, fallback_order=("torch",))
    sch = STANDARD_SCHEDULES["prefill_then_decode"]
    res = fa(DS16, sch, pol, page_size=16, dtype=BF16)
    assert res.max_rel_error() < 1e-2
    st_ = res.session
    assert st_.routed_steps == (1 if routed else 0) and st_.fallback_steps == st_.routed_steps
    assert st_.plans == len(sch) - st_.routed_steps  # routed steps are not planned at all
    with pytest.raises(ValueError, match="valid: auto, flashinfer, fallback"):
        FlashInferPolicy(prefill="sometimes")
    with pytest.raises(ValueError, match="max_work_items=20000"):
        FlashInferPolicy(max_work_items=20000)


def test_fa_work_item_capacity_routes_to_fallback(fake_fi):
    fake_fi()
    pol = FlashInferPolicy(fallback_order=("torch",), max_work_items=3)
    res = fa(DS16, STANDARD_SCHEDULES["ragged_prefill"], pol, page_size=16, dtype=BF16)
    assert res.max_rel_error() < 1e-2 and res.session.fallback_steps == 1 and res.session.plans == 0


def _drive(backend, dims_list, schedule, page_size=16, dtype=BF16, seed=0, scales=None, policy=TORCH_FB):
    """Several layers (one cache each) through one backend, steps planned once: (per-layer max rel
    err, the session)."""
    be = get_backend(backend)
    gen = torch.Generator().manual_seed(seed)
    lengths: dict[int, int] = {}
    for step in schedule:
        for sid, n in step.items():
            lengths[sid] = lengths.get(sid, 0) + n
    max_len = max(lengths.values())
    info = SequenceInfo(8, max(sum(s.values()) for s in schedule), max_len, page_size)
    alloc = PageAllocator(1 + len(lengths) * info.max_pages_per_seq + 2, page_size, info.max_pages_per_seq)
    layers = []
    for i, d in enumerate(dims_list):
        data = {s: [torch.randn(1, n, *shape, generator=gen).to(dtype) for shape in
                    ((d.num_heads, d.qk_nope_head_dim), (d.num_heads, d.qk_rope_head_dim), (d.kv_lora_rank,),
                     (1, d.qk_rope_head_dim))] for s, n in lengths.items()}
        w = (torch.randn(d.num_heads * (d.qk_nope_head_dim + d.v_head_dim), d.kv_lora_rank, generator=gen)
             * d.kv_lora_rank ** -0.5).to(dtype)
        cache = torch.full((alloc.num_pages, page_size, d.latent_dim), float("nan"), dtype=dtype)
        layers.append((d, data, w, cache, (scales or [None] * len(dims_list))[i], {s: [] for s in lengths}))
    sess = be.setup(spec_for(dims_list, dtype, Target.detect("cpu", page_size), info), policy)
    done = {s: 0 for s in lengths}
    for step in schedule:
        alloc.ensure_many({s: done[s] + n for s, n in step.items()})
        order = info.prepare_step([StepSequence(s, [0] * n, done[s]) for s, n in step.items()], alloc.pages_of)
        sess.prepare(info, step_descriptor(info))
        for d, data, w, cache, scale, outs in layers:
            ins = [torch.cat([data[s][k][:, done[s]: done[s] + step[s]] for s in order], 1) for k in range(4)]
            with using_sessions({backend: sess}):
                out = be.cached_op(*ins, w, *[info.get(m) for m in be.metadata], cache, scale)
            off = 0
            for s in order:
                outs[s].append(out[0, off: off + step[s]])
                off += step[s]
        for s, n in step.items():
            done[s] += n
    errs = []
    for d, data, w, cache, scale, outs in layers:
        num = den = 0.0
        for s in lengths:
            ref = torch.ops.autodeploy.torch_mla(*[x.double() for x in data[s]], w.double(), True, scale, "bsnd")[0]
            got = torch.cat(outs[s]).double()
            num, den = max(num, (got - ref).abs().max().item()), max(den, ref.abs().max().item())
        errs.append(num / den)
    return errs, sess


def test_fa_one_plan_per_config_per_step_shared_by_layers(fake_fi):
    fake_fi("0.7.2")
    d128 = MLADims(16, 128, 64, 128, 512)
    d_other = MLADims(32, 64, 64, 128, 256)
    sch = STANDARD_SCHEDULES["mixed"]
    # 4 layers: 3 share (N=16, R=512) with two different scales, one has (N=32, R=256).
    errs, st_ = _drive("flashinfer_mla", [d128, d128, d_other, d128], sch, scales=[None, 0.05, None, 0.2])
    assert max(errs) < 1e-2, errs
    assert len(st_.configs) == 2 and len(st_.eager) == 2
    assert st_.plans == 2 * len(sch)  # per step: one plan per config, not per layer
    wrappers = list(st_.eager.values())
    assert all(w.runs == (3 if w._num_heads == 16 else 1) * len(sch) for w in wrappers)


def test_fa_cuda_graph_mode_uses_fixed_buffers(fake_fi):
    fake_fi()
    assert get_backend("flashinfer_mla").decode_graph_safe
    sch = STANDARD_SCHEDULES["long_decode"]
    pol = FlashInferPolicy(fallback_order=("torch",), cuda_graph=True)
    res = fa(DS16, sch, pol, page_size=16, dtype=BF16, pad_to={k: 4 for k in range(1, len(sch))}, max_batch_size=8)
    assert res.max_rel_error() < 1e-2
    st_ = res.session
    # decode steps (batch 3 padded to 4) share one graph wrapper whose buffers never moved
    assert list(st_.graph) == [(PlanKey.of(DS16, BF16), 4)]
    w = st_.graph[(PlanKey.of(DS16, BF16), 4)]
    assert w.plans == len(sch) - 1 and w._kv_indices_buf is st_.graph_buffers[4].kv_indices


def test_fa_graph_steps_select_graph_wrappers(fake_fi):
    """Decode-only steps the runner pads to a CUDA-graph bucket (StepDescriptor.cuda_graph) get
    fixed-buffer wrappers (one per bucket); other steps the eager wrapper."""
    fake_fi()
    be = get_backend("flashinfer_mla")
    info = SequenceInfo(8, 32, 64, 16)
    buckets = (2, 4, 8)
    alloc = PageAllocator(1 + 8 * info.max_pages_per_seq, 16, info.max_pages_per_seq)
    st_ = be.setup(spec_for([DS16], BF16, Target.detect("cpu", 16), info), TORCH_FB)
    g = torch.Generator().manual_seed(0)
    cache = torch.full((alloc.num_pages, 16, 576), float("nan"), dtype=BF16)
    w = (torch.randn(16 * 256, 512, generator=g) * 0.04).to(BF16)
    done = {}
    for step in [{0: 5, 1: 3, 2: 2}, {0: 1, 1: 1, 2: 1}, {0: 1, 1: 1, 2: 1, 3: 9}, {0: 1, 1: 1, 2: 1, 3: 1},
                 {0: 1, 1: 1}, {0: 1}]:
        alloc.ensure_many({s: done.get(s, 0) + n for s, n in step.items()})
        seqs = [StepSequence(s, [0] * n, done.get(s, 0)) for s, n in step.items()]
        pad = bucket_for(buckets, sum(step.values()), all(q.is_decode for q in seqs), 8, 32)
        info.prepare_step(seqs, alloc.pages_of, pad_to=pad)
        st_.prepare(info, step_descriptor(info, buckets))
        t = info.num_padded_tokens
        x = [torch.randn(1, t, *shape, generator=g).to(BF16) for shape in ((16, 128), (16, 64), (512,), (1, 64))]
        with using_sessions({"flashinfer_mla": st_}):
            out = be.cached_op(*x, w, *[info.get(m) for m in be.metadata], cache, None)
        assert torch.isfinite(out).all()
        for s, n in step.items():
            done[s] = done.get(s, 0) + n
    key = PlanKey.of(DS16, BF16)
    # decode steps of 3, 4, 2, 1 sequences were padded to buckets 4, 4, 2, 2
    assert sorted(b for _, b in st_.graph) == [2, 4] and list(st_.eager) == [key]
    assert st_.graph[(key, 4)].plans == 2 and st_.graph[(key, 2)].plans == 2


def test_fa_errors_are_actionable(fake_fi):
    fake_fi()
    be = get_backend("flashinfer_mla")
    info = SequenceInfo(2, 8, 32, 16)
    target = Target.detect("cpu", 16)
    with pytest.raises(ValueError, match=r"illegal memory access"):
        be.setup(spec_for([MLADims(16, 128, 64, 128, 256)], BF16, target, info))
    with pytest.raises(ValueError, match="dtype float32"):
        be.setup(spec_for([DS16], torch.float32, target, info))
    sess = be.setup(spec_for([DS16], BF16, target, info), TORCH_FB)
    alloc = PageAllocator(8, 16, info.max_pages_per_seq)
    alloc.ensure_many({0: 3})
    info.prepare_step([StepSequence(0, [1, 2, 3], 0)], alloc.pages_of)
    args = _op_args(DS16, info, 3)
    cache = torch.zeros(8, 16, 576, dtype=BF16)
    with pytest.raises(RuntimeError, match="no active flashinfer_mla session"):
        be.cached_op(*args, cache, None)
    with using_sessions({"flashinfer_mla": sess}):
        with pytest.raises(RuntimeError, match="not prepared"):
            be.cached_op(*args, cache, None)
        sess.prepare(info, step_descriptor(info))
        other = _op_args(MLADims(8, 128, 64, 128, 512), info, 3)
        with pytest.raises(RuntimeError, match="not set up for"):
            be.cached_op(*other, cache, None)


def _op_args(d, info, t, dtype=BF16, seed=0):
    g = torch.Generator().manual_seed(seed)
    x = [torch.randn(1, t, d.num_heads, d.qk_nope_head_dim, generator=g), torch.randn(1, t, d.num_heads, d.qk_rope_head_dim, generator=g),
         torch.randn(1, t, d.kv_lora_rank, generator=g), torch.randn(1, t, 1, d.qk_rope_head_dim, generator=g),
         torch.randn(d.num_heads * (d.qk_nope_head_dim + d.v_head_dim), d.kv_lora_rank, generator=g) * 0.05]
    return [a.to(dtype) for a in x] + [info.get(m) for m in FI_METADATA]


@pytest.mark.parametrize("backend,sm,ps", [("flashinfer_mla", (9, 0), 16), ("flashinfer_trtllm_mla", (10, 0), 32)])
def test_opcheck(fake_fi, backend, sm, ps):
    fake_fi(sm=sm)
    be = get_backend(backend)
    info = SequenceInfo(4, 8, 64, ps)
    sess = be.setup(spec_for([DS16], BF16, Target.detect("cpu", ps), info))
    alloc = PageAllocator(8, ps, info.max_pages_per_seq)
    alloc.ensure_many({0: 40, 1: 9})
    info.prepare_step([StepSequence(0, [1], 39), StepSequence(1, [1], 8)], alloc.pages_of)  # decode-only
    sess.prepare(info, step_descriptor(info))
    cache = torch.randn(8, ps, 576).to(BF16)
    with using_sessions({backend: sess}):
        torch.library.opcheck(be.cached_op.default, (*_op_args(DS16, info, 2), cache, 0.1))


# ============================================================== trtllm on the fake
TRT_TORCH_FB = ft.TrtllmPolicy(fallback_order=("torch",))

@pytest.mark.parametrize("schedule", ["prefill_then_decode", "mixed", "long_decode"])
@pytest.mark.parametrize("dims", [DS16, MLADims(32, 64, 64, 128, 256), MLADims(128, 32, 64, 16, 512)],
                         ids=["ds16", "r256", "n128"])
def test_trtllm_scenarios_on_fake(fake_fi, schedule, dims):
    fake_fi(sm=(10, 0))
    sch = STANDARD_SCHEDULES[schedule]
    res = run_scenario("flashinfer_trtllm_mla", dims, sch, page_size=32, dtype=BF16, scale=0.07, seed=2,
                       policy=TRT_TORCH_FB)
    assert 0 < res.max_rel_error() < 1e-2
    st_ = res.session
    n_decode = sum(1 for k, s in enumerate(sch) if k > 0 and all(
        sum(p.get(sid, 0) for p in sch[:k]) > 0 and n == 1 for sid, n in s.items()))
    assert st_.decode_steps == n_decode and st_.fallback_steps == len(sch) - n_decode
    assert st_.block_table.shape[1] % (128 // 32) == 0


def test_trtllm_padded_decode_and_refusals(fake_fi):
    fake_fi(sm=(10, 0))
    sch = STANDARD_SCHEDULES["long_decode"]
    res = run_scenario("flashinfer_trtllm_mla", DS16, sch, page_size=64, dtype=BF16,
                       pad_to={k: 5 for k in range(1, len(sch))}, max_batch_size=8, policy=TRT_TORCH_FB)
    assert res.max_rel_error() < 1e-2
    be = get_backend("flashinfer_trtllm_mla")
    for d, ps, match in ((MLADims(96, 128, 64, 128, 512), 64, "64 < N < 128"),
                         (DS16, 16, "page_size=16"), (MLADims(16, 128, 32, 128, 256), 64, r"\(R, Dr\)")):
        info = SequenceInfo(2, 8, 64, ps)
        with pytest.raises(ValueError, match=match):
            be.setup(spec_for([d], BF16, Target.detect("cpu", ps), info))
    assert not be.decode_graph_safe


# ============================================================== GPU (real FlashInfer on the H200)
GPU_DIMS = {"ds_n128": MLADims(128, 128, 64, 128, 512), "ds_n16": MLADims(16, 128, 64, 128, 512),
            "n40": MLADims(40, 128, 64, 128, 512)}


def _need_flashinfer():
    if caps.flashinfer_version(library_versions())[0] is None:
        pytest.skip("flashinfer not installed")
    res = get_backend("flashinfer_mla").check(GPU_DIMS["ds_n16"], BF16, Target.detect("cuda", 64))
    if not res.ok:
        pytest.skip(res.reason)


# GPU tests of this backend use the torch reference as fallback where failures must be ours alone.


@pytest.mark.gpu
@pytest.mark.parametrize("dims_name", list(GPU_DIMS))
@pytest.mark.parametrize("schedule", list(STANDARD_SCHEDULES))
def test_gpu_fa_scenarios(dims_name, schedule):
    _need_flashinfer()
    for ps in (64, 16):
        res = fa(GPU_DIMS[dims_name], STANDARD_SCHEDULES[schedule], page_size=ps, dtype=BF16, device="cuda", seed=7)
        err = res.max_rel_error()
        assert 0 < err < 1e-2, (dims_name, schedule, ps, err)


@pytest.mark.gpu
def test_gpu_fa_untileable_heads_fall_back_to_triton():
    """N=40: prefill steps go to the fallback op, which on a GPU is the Triton backend when it accepts."""
    _need_flashinfer()
    d = GPU_DIMS["n40"]
    pol = FlashInferPolicy()
    fb = resolve_fallback([d], BF16, Target.detect("cuda", 64), pol.fallback_order, FI_METADATA)
    if fb.name != "triton":
        pytest.skip(f"Triton backend not available as fallback ({fb.name})")
    res = fa(d, STANDARD_SCHEDULES["mixed"], pol, page_size=64, dtype=BF16, device="cuda")
    assert 0 < res.max_rel_error() < 1e-2
    assert res.session.configs[PlanKey.of(d, BF16)].name == "triton" and res.session.fallback_steps > 0


@pytest.mark.gpu
def test_gpu_prefill_routed_to_triton_by_default():
    """Default policy (prefill="auto"): large prefill steps run on Triton, the rest on FlashInfer."""
    _need_flashinfer()
    d = GPU_DIMS["ds_n128"]
    pol = FlashInferPolicy()  # the default policy
    fb = resolve_fallback([d], BF16, Target.detect("cuda", 64), pol.fallback_order, FI_METADATA)
    if fb.name not in pol.fast_prefill_fallbacks:
        pytest.skip(f"fallback is {fb.name}: prefill stays on FlashInfer")
    # the shortest fresh prefill the cost model sends to Triton (2048 at N=128 on the H200 facts)
    big = next(t for t in range(64, 8192, 64)
               if (lambda a, e: e < a)(*path_costs(d, torch.tensor([t, 77]), torch.tensor([t, 77]))))
    sch = [{0: big, 1: 77}, {0: 1, 1: 1, 2: 130}] + [{0: 1, 1: 1, 2: 1}] * 4
    res = fa(d, sch, pol, page_size=64, dtype=BF16, device="cuda", scale=0.11, seed=5)
    assert 0 < res.max_rel_error() < 1e-2
    st_ = res.session
    assert st_.routed_steps == 1 and st_.plans == len(sch) - 1  # the small mixed step stays on FlashInfer


@pytest.mark.gpu
def test_gpu_fa_long_chunked_prefill_and_mixed():
    _need_flashinfer()
    d = GPU_DIMS["ds_n128"]
    sch = [{0: 300, 1: 77}, {0: 257, 1: 1, 2: 130}, {0: 1, 1: 1, 2: 200, 3: 3}] + [{0: 1, 1: 1, 2: 1, 3: 1}] * 3
    res = fa(d, sch, page_size=64, dtype=BF16, device="cuda", scale=0.11, seed=5)
    assert 0 < res.max_rel_error() < 1e-2
    assert res.session.fallback_steps == 0


@pytest.mark.gpu
def test_gpu_fa_captured_decode_graph_replays_after_growth():
    """Capture one decode step in a CUDA graph, then replay it for later steps (sequences grow, pages are added),
    re-planning before each replay; compare with the eager torch reference op."""
    _need_flashinfer()
    d, ps, dtype = GPU_DIMS["ds_n128"], 64, BF16
    be = get_backend("flashinfer_mla")
    dev = torch.device("cuda")
    bs, max_len = 4, 700
    info = SequenceInfo(bs, 512, max_len, ps, dev)
    alloc = PageAllocator(1 + bs * info.max_pages_per_seq, ps, info.max_pages_per_seq)
    g = torch.Generator().manual_seed(0)
    w = (torch.randn(d.num_heads * (d.qk_nope_head_dim + d.v_head_dim), d.kv_lora_rank, generator=g)
         * d.kv_lora_rank ** -0.5).to(dev, dtype)
    cache = torch.randn(alloc.num_pages, ps, d.latent_dim, generator=g).to(dev, dtype)
    ref_cache = cache.clone()
    sess = be.setup(spec_for([d], dtype, Target.detect(dev, ps), info, dev),
                    FlashInferPolicy(fallback_order=("torch",), cuda_graph=True))
    use = {"flashinfer_mla": sess}
    lens = {0: 60, 1: 1, 2: 63, 3: 200}  # prefill these first (eager)
    alloc.ensure_many(lens)
    info.prepare_step([StepSequence(s, [0] * n, 0) for s, n in lens.items()], alloc.pages_of)
    sess.prepare(info, step_descriptor(info))
    t = sum(lens.values())

    def inputs(t_):
        return [torch.randn(1, t_, d.num_heads, d.qk_nope_head_dim, generator=g).to(dev, dtype),
                torch.randn(1, t_, d.num_heads, d.qk_rope_head_dim, generator=g).to(dev, dtype),
                torch.randn(1, t_, d.kv_lora_rank, generator=g).to(dev, dtype),
                torch.randn(1, t_, 1, d.qk_rope_head_dim, generator=g).to(dev, dtype)]

    x = inputs(t)
    meta = lambda names: [info.get(m) for m in names]  # noqa: E731
    with using_sessions(use):
        be.cached_op(*x, w, *meta(be.metadata), cache, None)
    torch.ops.autodeploy.torch_mla_with_cache(*x, w, *meta(get_backend("torch").metadata), ref_cache, None)
    # static decode inputs
    static = inputs(bs)
    for s in lens:
        lens[s] += 1
    alloc.ensure_many(lens)
    info.prepare_step([StepSequence(s, [0], lens[s] - 1) for s in lens], alloc.pages_of)
    sess.prepare(info, step_descriptor(info))
    side = torch.cuda.Stream()
    side.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(side), using_sessions(use):
        be.cached_op(*static, w, *meta(be.metadata), cache.clone(), None)  # warm-up (not on the real cache)
    torch.cuda.current_stream().wait_stream(side)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph), using_sessions(use):
        out_static = be.cached_op(*static, w, *meta(be.metadata), cache, None)
    errs = []
    for step in range(40):  # crosses page boundaries (60->100, 63->103, 1->41, 200->240)
        if step:
            for s in lens:
                lens[s] += 1
            alloc.ensure_many(lens)
            info.prepare_step([StepSequence(s, [0], lens[s] - 1) for s in lens], alloc.pages_of)
            sess.prepare(info, step_descriptor(info))
        new = inputs(bs)
        for a, b in zip(static, new):
            a.copy_(b)
        graph.replay()
        ref = torch.ops.autodeploy.torch_mla_with_cache(*new, w, *meta(get_backend("torch").metadata),
                                                        ref_cache, None)
        errs.append(((out_static.float() - ref.float()).abs().max() / ref.float().abs().max()).item())
    assert max(errs) < 1e-2, errs
    assert torch.equal(cache, ref_cache)  # the graph's appends wrote exactly what the reference wrote
    assert sess.graph and all(b == bs for _, b in sess.graph)


@pytest.mark.gpu
def test_gpu_opcheck():
    _need_flashinfer()
    d, ps = GPU_DIMS["ds_n16"], 64
    be = get_backend("flashinfer_mla")
    info = SequenceInfo(4, 64, 256, ps, "cuda")
    sess = be.setup(spec_for([d], BF16, Target.detect("cuda", ps), info, "cuda"))
    alloc = PageAllocator(16, ps, info.max_pages_per_seq)
    alloc.ensure_many({0: 100, 1: 9})
    info.prepare_step([StepSequence(0, [1] * 5, 95), StepSequence(1, [1], 8)], alloc.pages_of)
    sess.prepare(info, step_descriptor(info))
    args = [a.cuda() if a.device.type == "cpu" and a.dtype == BF16 else a for a in _op_args(d, info, 6)]
    cache = torch.randn(16, ps, 576, device="cuda").to(BF16)
    with using_sessions({"flashinfer_mla": sess}):
        torch.library.opcheck(be.cached_op.default, (*args, cache, 0.1))
