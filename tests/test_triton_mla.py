"""The Triton MLA backend ("triton") against the torch oracle.

CPU (CI): the kernels run in Triton's interpreter (TRITON_INTERPRET=1, set by conftest.py) on small
shapes; every intermediate buffer is NaN-poisoned (TritonPolicy.poison_buffers) on top of run_scenario's
NaN-poisoned, page-shuffled cache, so an element a kernel forgets to write fails the comparison.
The forced prefill path, split count and poisoning are the session's `TritonPolicy`.
GPU (@pytest.mark.gpu): real model dims in bf16, both prefill paths, split-K, and a captured CUDA
graph of a decode step replayed while the sequences grow.
"""

from __future__ import annotations

import os
import subprocess
import sys

import pytest
import torch

pytest.importorskip("triton")

from autodeploy_mla.custom_ops.triton_mla import call as tcall, step_shape as tshape, launchers as tlaunch, session as tsession  # noqa: E402
from autodeploy_mla.custom_ops import DeviceInfo, MLADims, MLAShapeError, SessionSpec, Target, get_backend  # noqa: E402
from autodeploy_mla.custom_ops.attention.step_context import using_sessions  # noqa: E402
from autodeploy_mla.custom_ops.triton_mla import TritonPolicy  # noqa: E402
from autodeploy_mla.custom_ops.triton_mla import op as top  # noqa: E402
from autodeploy_mla.custom_ops.triton_mla import tuning  # noqa: E402
from autodeploy_mla.runtime import PageAllocator, SequenceInfo, StepSequence  # noqa: E402
from autodeploy_mla.testing import STANDARD_SCHEDULES, run_scenario  # noqa: E402
from autodeploy_mla.testing.scenarios import REAL_MLA_DIMS  # noqa: E402

OP = torch.ops.autodeploy.triton_mla_with_cache


def scenario(dims, schedule, mode="auto", splits=0, layout="auto", kernel="auto", **kw):
    """run_scenario on the triton backend with a session policy: NaN-poisoned buffers, and a forced
    prefill path / split count / decode kernel layout / decode kernel (tl or Gluon) when given."""
    policy = TritonPolicy(prefill_mode=mode, decode_splits=splits, poison_buffers=True, decode_layout=layout,
                          decode_kernel=kernel)
    return run_scenario("triton", dims, schedule, policy=policy, **kw)


# Every (R, Dr) class scaled down: R 32/48/64 (48: not a power of two), Dr 0/8/16, Dn != Dv,
# N not a multiple of the head block (3, 5).
CPU_DIMS = {
    "r32_dr0": MLADims(3, 16, 0, 24, 32),
    "r32_dr8": MLADims(5, 16, 8, 32, 32),
    "r48_dr16": MLADims(3, 24, 16, 16, 48),
    "r64_dr16": MLADims(4, 32, 16, 16, 64),
    "r64_dr8": MLADims(5, 16, 8, 24, 64),
}

# Extra schedules: page-boundary crossings in one step, a chunk on a long prefix, decode after it.
EXTRA_SCHEDULES = {
    "long_chunks": [{0: 9, 1: 2}, {0: 13, 1: 1, 2: 3}, {0: 1, 1: 1, 2: 11}, {0: 1, 1: 1, 2: 1}],
}


# Schedules with decode tokens run in test_decode_layouts_match_oracle, on every CPU_DIMS with each
# of the two decode kernels forced; the default layout picks one of those two per dims (the choice is
# tested in test_decode_config_picks_the_measured_layout / test_multi_token_kernel_choice), so running
# them here too repeated one of those cases. Every schedule runs in one test or the other.
DECODE_SCHEDULES = ["mixed", "long_decode", "long_chunks", "prefill_then_decode"]
PREFILL_ONLY = [s for s in [*STANDARD_SCHEDULES, *EXTRA_SCHEDULES] if s not in DECODE_SCHEDULES]


@pytest.mark.parametrize("dims_name", list(CPU_DIMS))
@pytest.mark.parametrize("schedule", PREFILL_ONLY)
def test_matches_oracle(dims_name, schedule):
    sch = {**STANDARD_SCHEDULES, **EXTRA_SCHEDULES}[schedule]
    res = scenario(CPU_DIMS[dims_name], sch, page_size=4, seed=len(schedule) + len(dims_name))
    assert res.max_rel_error() < 1e-5


@pytest.mark.parametrize("mode", ["expand", "absorb"])
@pytest.mark.parametrize("schedule", ["ragged_prefill", "chunked_prefill_3", "mixed", "long_chunks"])
@pytest.mark.parametrize("dims_name", ["r32_dr0", "r64_dr16"])
def test_both_prefill_paths(mode, schedule, dims_name):
    sch = {**STANDARD_SCHEDULES, **EXTRA_SCHEDULES}[schedule]
    res = scenario(CPU_DIMS[dims_name], sch, mode, page_size=4, seed=3)
    assert res.max_rel_error() < 1e-5


@pytest.fixture
def small_blocks(monkeypatch):
    """16-token KV tiles, so the short CPU sequences span several split-K chunks; records the split
    count of every absorbed launch."""
    monkeypatch.setattr(tlaunch, "decode_config", lambda d, dt, *a: tuning.AbsorbedConfig(16, 1, 16, 4, 2))
    monkeypatch.setattr(tlaunch, "absorb_prefill_config", lambda d, dt, *a: tuning.AbsorbedConfig(16, 2, 16, 4, 2))
    return _record_splits(monkeypatch)


def _record_splits(monkeypatch) -> list[int]:
    """The split count of every absorbed launch, in order."""
    seen: list[int] = []
    orig = top.launch_absorbed

    def spy(*a, **k):
        seen.append(orig(*a, **k))
        return seen[-1]

    monkeypatch.setattr(top, "launch_absorbed", spy)
    return seen


# Sequences of 40-60 tokens: 3-4 KV tiles of 16.
SPLIT_SCHEDULE = [{0: 40, 1: 23}, {0: 1, 1: 19, 2: 5}, {0: 1, 1: 1, 2: 30}, {0: 1, 1: 1, 2: 1}]


@pytest.mark.parametrize("splits", [0, 1, 2, 3])
@pytest.mark.parametrize("mode", ["absorb", "expand"])
def test_split_k_on_and_off(splits, mode, small_blocks):
    # absorb: the forced split count applies to the absorbed prefill launch too.
    res = scenario(CPU_DIMS["r32_dr8"], SPLIT_SCHEDULE, mode, splits, page_size=4, seed=splits)
    assert res.max_rel_error() < 1e-5
    if splits == 1:
        assert max(small_blocks) == 1
    else:  # 0 = auto: the interpreter targets 8 programs, so these small batches split
        assert max(small_blocks) > 1


def test_static_split_plan_used_under_capture(monkeypatch, small_blocks):
    """Under CUDA-graph capture the decode split plan comes from the page-table width, not from the
    step's max kv length; it must give the same results (chunks past a sequence are skipped)."""
    monkeypatch.setattr(top, "capturing_on", lambda dev: True)  # the op and its launchers
    monkeypatch.setattr(tlaunch, "capturing_on", lambda dev: True)
    sch = [{0: 3, 1: 2}] + [{0: 1, 1: 1}] * 6 + [{0: 1, 1: 1, 2: 50}, {0: 1, 1: 1, 2: 1}]
    res = scenario(CPU_DIMS["r64_dr8"], sch, page_size=4)
    assert res.max_rel_error() < 1e-5
    assert max(small_blocks) > 2  # planned for the 52-token capacity while sequences were short


@pytest.mark.parametrize("page_size", [1, 3, 8])
def test_page_sizes(page_size):
    res = scenario(CPU_DIMS["r32_dr8"], EXTRA_SCHEDULES["long_chunks"], page_size=page_size)
    assert res.max_rel_error() < 1e-5


@pytest.mark.parametrize("heavy_first", [True, False])
@pytest.mark.parametrize("split_nope", [True, False])
@pytest.mark.parametrize("tma", [False, True])
def test_expanded_prefill_grid_orders_and_nope_chunks(monkeypatch, heavy_first, split_nope, tma):
    """Dn 48 (not a power of two: 32 + 16 chunks, or one tile padded to 64), both grid orders of the
    expanded prefill kernel (a head's query blocks from the last, or from the first) and K/V tiles by
    tensor descriptor or by pointer agree with the oracle, with several query blocks per sequence and
    several sequences per step (descriptor tiles then read past a sequence's rows)."""
    monkeypatch.setattr(tlaunch, "expand_config", lambda *a, **k: tuning.ExpandConfig(
        16, 16, 4, 1, heavy_first=heavy_first, split_nope=split_nope, tma=tma))
    assert tuning.nope_chunks(48) == (32, 16) and tuning.nope_chunks(48, split=False) == (64, 0)
    res = scenario(MLADims(3, 48, 8, 24, 32), {**STANDARD_SCHEDULES, **EXTRA_SCHEDULES}["long_chunks"], "expand",
                   page_size=4, seed=7)
    assert res.max_rel_error() < 1e-5


def test_head_block_tails(monkeypatch):
    """N=20 over head blocks of 16 (and 2 tokens x 16 heads for absorbed prefill): the last block
    is partial and every head must still be computed."""
    monkeypatch.setattr(tlaunch, "decode_config", lambda d, dt, *a: tuning.AbsorbedConfig(16, 1, 16, 4, 1))
    monkeypatch.setattr(tlaunch, "absorb_prefill_config", lambda d, dt, *a: tuning.AbsorbedConfig(16, 2, 16, 4, 1))
    d = MLADims(20, 16, 8, 24, 32)
    for mode in ("absorb", "expand"):
        res = scenario(d, STANDARD_SCHEDULES["mixed"], mode, page_size=4)
        assert res.max_rel_error() < 1e-5, mode


# ----------------------------------------------------------------------------- multi-token decode
# Speculative-decoding verification: after a prefill, every sequence gets 2-9 new tokens per step on
# its cached history (causal among them), some steps mixed with plain decode tokens.
SPEC_SCHEDULE = [{0: 9, 1: 6, 2: 13}, {0: 4, 1: 4, 2: 5}, {0: 3, 1: 9, 2: 1}, {0: 2, 1: 1, 2: 7, 3: 6},
                 {0: 5, 1: 3, 2: 4, 3: 1}, {0: 1, 1: 1, 2: 1, 3: 1}]


@pytest.mark.parametrize("layout", ["heads_on_n", "heads_on_m"])
@pytest.mark.parametrize("dims_name", list(CPU_DIMS))
def test_multi_token_decode_matches_oracle(monkeypatch, dims_name, layout):
    """Multi-token decode steps (absorbed: several new tokens per sequence on a cached history) on
    the decode kernel's query columns (heads-on-N) or the absorbed-prefill rows (heads-on-M), equal to
    the float64 oracle; the heads-on-N steps really ran with BLOCK_Q > 1."""
    cfgs = []
    orig = top.launch_absorbed

    def spy(*a, **k):
        cfgs.append(k["cfg"])
        return orig(*a, **k)

    monkeypatch.setattr(top, "launch_absorbed", spy)
    d = CPU_DIMS[dims_name]
    res = scenario(d, SPEC_SCHEDULE, "absorb", layout=layout, page_size=4, seed=11)
    assert res.max_rel_error() < 1e-5
    multi = [c for c in cfgs if c.block_q > 1]
    assert multi, cfgs
    if layout == "heads_on_n" and tuning.heads_on_n_supported(d):
        assert all(c.heads_on_n for c in multi)
        assert max(c.block_q for c in multi) == 4  # 16-head column blocks: 4 tokens x 16 heads = 64 columns
    else:
        assert not any(c.heads_on_n for c in multi)


def test_multi_token_config_columns():
    dec = tuning.AbsorbedConfig(16, 1, 64, 4, 2, heads_on_n=True, tma=True)
    assert [tuning.multi_token_config(dec, q, 512).block_q for q in (1, 2, 3, 4, 5, 9, 16)] == [1, 2, 4, 4, 4, 4, 4]
    wide = tuning.AbsorbedConfig(64, 1, 64, 8, 2, heads_on_n=True, tma=True)  # N = 128: one token per program
    assert tuning.multi_token_config(wide, 8, 512).block_q == 1
    assert tuning.multi_token_config(dec, 4, 512).tma and tuning.multi_token_config(dec, 4, 512).heads_on_n
    # warps as measured on the H200: 8 for 64 columns over R 512; the decode's 4 at 32 columns or R 256
    assert [tuning.multi_token_config(dec, q, 512).num_warps for q in (2, 4)] == [4, 8]
    assert tuning.multi_token_config(tuning.AbsorbedConfig(32, 1, 64, 4, 2, heads_on_n=True), 4, 256).num_warps == 4


def test_multi_token_kernel_choice():
    """Columns (the heads-on-N decode kernel) by default where decode runs heads-on-N — measured
    faster on the H200 — rows (absorb_prefill_config) for chunks over MULTI_TOKEN_MAX_Q, N 33-64,
    an FP8 cache unless forced, and decode_layout="heads_on_m"."""
    d = CPU_DIMS["r64_dr16"]
    rows = tuning.absorb_prefill_config(d, torch.float32)
    f32, e4m3 = torch.float32, torch.float8_e4m3fn
    auto = tcall.OpCall(TritonPolicy())
    assert tlaunch.absorb_config(auto, d, f32, f32, 4).heads_on_n
    assert tlaunch.absorb_config(auto, d, f32, f32, tuning.MULTI_TOKEN_MAX_Q + 1) == rows
    assert tlaunch.absorb_config(auto, MLADims(48, 16, 8, 16, 64), f32, f32, 4) == \
        tuning.absorb_prefill_config(MLADims(48, 16, 8, 16, 64), f32)
    assert tlaunch.absorb_config(auto, d, f32, e4m3, 4) == rows
    assert tlaunch.absorb_config(tcall.OpCall(TritonPolicy(decode_layout="heads_on_n")), d, f32, e4m3, 4).heads_on_n
    assert tlaunch.absorb_config(tcall.OpCall(TritonPolicy(decode_layout="heads_on_m")), d, f32, f32, 4) == rows


# ----------------------------------------------------------------------------- heads on N (decode)
@pytest.mark.parametrize("layout", ["heads_on_m", "heads_on_n"])
@pytest.mark.parametrize("dims_name", list(CPU_DIMS))
@pytest.mark.parametrize("schedule", DECODE_SCHEDULES)
def test_decode_layouts_match_oracle(dims_name, schedule, layout):
    """Both decode kernels forced for every decode token (the default picks per dims): R 32/48/64
    (48: heads-on-N's second latent chunk half past R), Dr 0/8/16, head counts under one column
    block; pages of 4 hold no whole 16-token tile, so every unmasked tile gathers per-row page ids."""
    sch = {**STANDARD_SCHEDULES, **EXTRA_SCHEDULES}[schedule]
    res = scenario(CPU_DIMS[dims_name], sch, layout=layout, page_size=4, seed=len(schedule))
    assert res.max_rel_error() < 1e-5


@pytest.fixture
def heads_on_n_blocks(monkeypatch):
    """Heads-on-N decode with 16-token tiles and 16-head column blocks; records split counts."""
    monkeypatch.setattr(tlaunch, "decode_config",
                        lambda d, dt, *a: tuning.AbsorbedConfig(16, 1, 16, 4, 2, heads_on_n=True, tma=True))
    return _record_splits(monkeypatch)


@pytest.mark.parametrize("page_size", [4, 16, 32])
@pytest.mark.parametrize("splits", [0, 1, 3])
def test_heads_on_n_tiles_pages_and_splits(heads_on_n_blocks, page_size, splits):
    """N 20 = a full and a partial 16-head column block; pages of 16/32 hold whole tiles (one base
    pointer per tile; TMA is off on CPU), pages of 4 do not; split-K off, automatic and forced."""
    sch = [{0: 40, 1: 23}] + [{0: 1, 1: 1}] * 3 + [{0: 1, 1: 1, 2: 37}, {0: 1, 1: 1, 2: 1}]
    res = scenario(MLADims(20, 16, 8, 24, 32), sch, splits=splits, page_size=page_size, seed=page_size + splits)
    assert res.max_rel_error() < 1e-5
    assert (max(heads_on_n_blocks) == 1) if splits == 1 else (max(heads_on_n_blocks) > 1)


_HEADS_ON_N_COMPILE_CHECK = """
import inspect, re
from autodeploy_mla.custom_ops.triton_mla import kernels as K
fn = K.absorbed_attn_heads_on_n_kernel
consts = dict(N=16, R=512, DR=64, PAGE_SIZE=64, NUM_HB=1, BLOCK_H=16, BLOCK_Q=1, BLOCK_C=256, BLOCK_DR=64,
              SPLIT=True, DOT_PREC="tf32", SCALED=False, USE_TMA=True, F16=False, B_CAP=0, B_PAD=1, WS=False)
ptr = {"PAGE_TABLE": "*i32", "CU_SEQLEN": "*i32", "INPUT_POS": "*i32", "SEQ_LEN": "*i32", "PART_ACC": "*fp32",
       "PART_LSE": "*fp32"}
for block_n, stages in ((64, 2), (32, 3)):
    c = {**consts, "BLOCK_N": block_n}
    sig = {}
    for p in inspect.signature(fn.fn).parameters:
        if p in c:
            sig[p] = "constexpr"
        elif p == "KV_DESC":
            sig[p] = f"tensordesc<bf16[{block_n}, 256]>"
        elif p == "KPE_DESC":
            sig[p] = f"tensordesc<bf16[{block_n}, 64]>"
        elif p.isupper():
            sig[p] = ptr.get(p, "*bf16")
        else:
            sig[p] = "fp32" if p.endswith("scale") else "i32"
    k = triton.compile(ASTSource(fn, sig, constexprs=c), target=GPUTarget("cuda", 90, 32),
                       options={"num_warps": 4, "num_stages": stages})
    bufs = max(int(m) for m in re.findall(r"memdesc<(\\d+)x" + str(block_n) + r"x256xbf16", k.asm["ttgir"]))
    print(block_n, stages, "kv buffers", bufs, "shared", k.metadata.shared)
"""


def test_heads_on_n_kernel_compiles_for_sm90_without_a_gpu(tmp_path):
    """The heads-on-N decode kernel (TMA tiles, 64- and 32-token tiles) through Triton's compiler to SM90
    (the interpreter never compiles): it compiles, and the shipped 64-token config keeps two KV tiles
    in shared memory (docs/benchmarks/decode_pipeline.md)."""
    from autodeploy_mla.testing.sm90_compile import run_sm90_compile_check, sm90_backend_missing

    if why := sm90_backend_missing():
        pytest.skip(why)
    res = run_sm90_compile_check(_HEADS_ON_N_COMPILE_CHECK, tmp_path / "triton_cache")
    assert res.returncode == 0, res.stderr[-3000:]
    lines = [ln.split() for ln in res.stdout.splitlines() if "kv buffers" in ln]
    assert [ln[:2] for ln in lines] == [["64", "2"], ["32", "3"]], res.stdout
    assert int(lines[0][4]) == 2, res.stdout


def test_heads_on_n_fp8_cache_fp16_products():
    """bf16 activations on an e4m3 cache: the kernel runs its products in fp16 (F16) and stays within
    bf16 rounding of the oracle that reads the same e4m3 values."""
    from autodeploy_mla.custom_ops.attention.cache_format import FP8_DTYPE, CacheScales

    for sc in (CacheScales(1.0, 1.0), CacheScales(0.37, 2.5)):
        res = run_scenario("triton", CPU_DIMS["r64_dr16"], STANDARD_SCHEDULES["long_decode"], dtype=torch.bfloat16,
                           ref_dtype=torch.float64, cache_dtype=FP8_DTYPE, cache_scales=sc, page_size=4,
                           policy=TritonPolicy(decode_layout="heads_on_n", poison_buffers=True))
        assert 0 < res.max_rel_error() < 2e-2, (sc, res.max_rel_error())


def test_wave_split_plan():
    """The heads-on-N split count avoids a partial last wave (GLM B64 kv8192 on 132 one-program SMs:
    2 or 4 splits fill 1 or 2 waves, 5 would need 3), honours a forced count and min chunk length."""
    cuda = torch.device("cuda")  # the plan is arithmetic: no GPU touched
    splits, chunk = tuning.split_plan_waves(64, 8192, 64, 0, cuda, 132, 1.78)
    assert splits in (2, 4) and splits * chunk >= 8192 and chunk % 64 == 0
    assert tuning.split_plan_waves(1, 8192, 64, 0, cuda, 132, 1.78)[0] == 8192 // tuning.MIN_SPLIT_CHUNK
    assert tuning.split_plan_waves(64, 8192, 64, 3, cuda, 132, 1.78)[0] == 3
    assert tuning.split_plan_waves(128, 512, 64, 0, cuda, 132, 3.5)[0] == 1  # one wave already, partials cost


def test_decode_config_picks_the_measured_layout():
    bf16, fp8 = torch.bfloat16, torch.float8_e4m3fn
    ds16, glm, mistral, ds128 = (MLADims(16, 128, 64, 128, 512), MLADims(20, 192, 64, 256, 512),
                                 MLADims(32, 64, 64, 128, 256), MLADims(128, 128, 64, 128, 512))
    for d in (ds16, glm, mistral, ds128):
        assert tuning.decode_config(d, bf16, bf16).heads_on_n
    assert tuning.decode_config(glm, bf16, bf16).block_h == 32
    assert not tuning.decode_config(MLADims(64, 128, 64, 128, 512), bf16, bf16).heads_on_n  # one 64-head block
    assert tuning.decode_config(ds16, bf16, fp8).heads_on_n
    assert not tuning.decode_config(ds128, bf16, fp8).heads_on_n
    assert not tuning.decode_config(MLADims(20, 16, 8, 16, 16), bf16).heads_on_n  # R < 32
    assert not tuning.decode_config(glm, bf16, bf16, "heads_on_m").heads_on_n
    assert tuning.decode_config(ds16, bf16, bf16, "heads_on_n").heads_on_n
    with pytest.raises(ValueError, match="decode_layout='cols'"):
        TritonPolicy(decode_layout="cols")


def test_padded_steps_are_harmless():
    d = CPU_DIMS["r32_dr8"]
    res = scenario(d, STANDARD_SCHEDULES["mixed"], pad_to={1: 12, 4: 7}, max_batch_size=8)
    assert res.max_rel_error() < 1e-5
    res = scenario(d, STANDARD_SCHEDULES["long_decode"], pad_to={2: 6, 7: 5}, max_batch_size=8)
    assert res.max_rel_error() < 1e-5


def test_scale_is_honoured():
    res = scenario(CPU_DIMS["r64_dr16"], STANDARD_SCHEDULES["mixed"], scale=0.31)
    assert res.max_rel_error() < 1e-5


def test_bf16_within_tolerance():
    res = scenario(CPU_DIMS["r64_dr16"], STANDARD_SCHEDULES["mixed"], dtype=torch.bfloat16,
                       ref_dtype=torch.float64)
    assert 0 < res.max_rel_error() < 1e-2


# ----------------------------------------------------------------------------- op contract
def _one_step_args(d: MLADims, dtype=torch.float32, device="cpu"):
    info = SequenceInfo(4, 16, 16, 4, device)
    alloc = PageAllocator(8, 4, info.max_pages_per_seq)
    alloc.ensure_many({0: 5, 1: 1, 2: 3})
    info.prepare_step([StepSequence(0, [1] * 5, 0), StepSequence(1, [1], 0), StepSequence(2, [1] * 3, 0)],
                      alloc.pages_of)
    t = info.num_tokens
    g = torch.Generator().manual_seed(0)
    n, dn, dr, dv, r = d.num_heads, d.qk_nope_head_dim, d.qk_rope_head_dim, d.v_head_dim, d.kv_lora_rank
    x = [torch.randn(1, t, n, dn, generator=g), torch.randn(1, t, n, dr, generator=g),
         torch.randn(1, t, r, generator=g), torch.randn(1, t, 1, dr, generator=g),
         torch.randn(n * (dn + dv), r, generator=g)]
    meta = [info.get(m) for m in get_backend("triton").metadata]
    cache = torch.randn(8, 4, r + dr, generator=g).to(dtype)
    return [a.to(device=device, dtype=dtype) for a in x], meta, cache.to(device)


def test_opcheck():
    x, meta, cache = _one_step_args(MLADims(3, 16, 8, 24, 32))
    torch.library.opcheck(OP.default, (*x, *meta, cache, 0.2))


def test_schema_declares_cache_mutation():
    schema = OP.default._schema
    mutated = [a.name for a in schema.arguments if a.alias_info is not None and a.alias_info.is_write]
    assert mutated == ["mla_cache"]


def test_bad_inputs_are_explained():
    x, meta, cache = _one_step_args(MLADims(3, 16, 8, 24, 32))
    with pytest.raises(ValueError, match="prefill_mode='fast'"):
        TritonPolicy(prefill_mode="fast")
    with pytest.raises(ValueError, match="decode_splits=-1"):
        TritonPolicy(decode_splits=-1)
    with pytest.raises(MLAShapeError, match="mla_cache"):
        OP(*x, *meta, cache[..., :-1], None)
    big = MLADims(2, 300, 8, 24, 32)  # Dn over the expanded kernel's limit
    xb, metab, cacheb = _one_step_args(big)
    spec = SessionSpec((big,), torch.float32, torch.device("cpu"), Target.detect("cpu", 4), 4, 16, 4)
    expand = get_backend("triton").setup(spec, TritonPolicy(prefill_mode="expand"))
    with using_sessions({"triton": expand}), pytest.raises(MLAShapeError, match="expand"):
        OP(*xb, *metab, cacheb, None)
    OP(*xb, *metab, cacheb, None)  # auto falls back to absorb


def test_forced_gluon_decode_explains_why_it_cannot_run():
    """decode_kernel='gluon' where the Gluon kernel cannot run (here: the interpreter) raises at the
    decode step, naming the reason; decode_kernel='triton' runs the same steps on the tl kernels."""
    with pytest.raises(ValueError, match="decode_kernel='fast'"):
        TritonPolicy(decode_kernel="fast")
    with pytest.raises(MLAShapeError, match="decode_kernel='gluon'.*(interpreter|CUDA)"):
        scenario(CPU_DIMS["r32_dr8"], [{0: 3, 1: 2}, {0: 1, 1: 1}], kernel="gluon")
    res = scenario(CPU_DIMS["r32_dr8"], [{0: 3, 1: 2}, {0: 1, 1: 1}], kernel="triton")
    assert 0 < res.max_rel_error() < 1e-5


def test_auto_decode_kernel_rule(monkeypatch):
    """decode_kernel='auto' where Gluon can run (supports stubbed: no GPU here): N > 32 always takes the
    many-heads Gluon kernel, whatever the `tl` decode layout; N <= 32 only where the `tl` decode would
    run heads-on-N; 'triton' never; cache scales never."""
    from types import SimpleNamespace

    from autodeploy_mla.custom_ops.triton_mla import gluon_decode

    monkeypatch.setattr(tlaunch, "interpreting", lambda: False)
    monkeypatch.setattr(gluon_decode, "supports", lambda *a, **k: (True, "ok"))
    cache = torch.zeros(2, 64, 576, dtype=torch.bfloat16)
    dev = torch.device("cuda")

    def choice(n, heads_on_n, kernel="auto", scaled=False):
        call = tcall.OpCall(TritonPolicy(decode_kernel=kernel), warmed=set())
        return tlaunch.gluon_decode_choice(call, SimpleNamespace(heads_on_n=heads_on_n), MLADims(n, 128, 64, 128, 512),
                                        torch.bfloat16, cache, dev, scaled)

    assert choice(128, False) and choice(64, False) and choice(128, True)
    assert choice(16, True) and not choice(16, False)
    assert choice(16, False, kernel="gluon")
    assert not choice(128, False, kernel="triton") and not choice(128, False, scaled=True)


# ----------------------------------------------------------------------------- cost rule
def test_prefill_cost_rule():
    ds = MLADims(128, 128, 64, 128, 512)
    rule = tuning.choose_prefill_path
    assert rule(ds, 2048, 0, 2048 * 2049 // 2) == "expand"  # fresh prefill
    assert rule(ds, 1, 0, 1) == "expand"
    p = 8192
    # Long prefix: expand iff T > R(Dn+Dv) / (k(2R+Dr) - (Dn+Dr+Dv)) = 131072 / 2944 = 44.5 (k = 3).
    k = tuning.ABSORB_SLOWDOWN
    threshold = 512 * 256 / (k * (2 * 512 + 64) - (128 + 64 + 128))
    assert 40 < threshold < 50
    for q, want in ((1, "absorb"), (16, "absorb"), (40, "absorb"), (50, "expand"), (1024, "expand")):
        assert rule(ds, q, p, q * p + q * (q + 1) // 2) == want, (q, threshold)
    # Raw FLOPs (k = 1) would keep a 160-token chunk absorbed; measured, expansion is 3.6x faster
    # at T=128 on a 4096 prefix (docs/benchmarks/mla_kernels.md).
    e, a = tuning.prefill_costs(ds, 160, p, 160 * p + 160 * 161 // 2)
    assert a < e < k * a
    assert rule(MLADims(4, 512, 64, 128, 512), 512, 0, 512 * 513 // 2) == "absorb"  # Dn over the limit


# ----------------------------------------------------------------------------- check()
V_OK = {"torch": "2.13.0", "triton": "3.6.0", "flashinfer": None}
H200 = DeviceInfo("cuda", (9, 0), "NVIDIA H200")
CHECK_TABLE = [
    # (dims, dtype, device, versions, page_size, ok, reason fragment)
    (MLADims(128, 128, 64, 128, 512), torch.bfloat16, H200, V_OK, 64, True, "triton on cuda SM90"),
    (MLADims(20, 192, 64, 256, 512), torch.bfloat16, H200, V_OK, 64, True, "any N"),
    (MLADims(40, 64, 32, 64, 256), torch.float16, H200, V_OK, 16, True, "any N"),
    (MLADims(4, 32, 0, 48, 64), torch.float32, H200, V_OK, 1, True, "any N"),
    (MLADims(4, 512, 64, 128, 512), torch.bfloat16, H200, V_OK, 64, True, "absorbed only"),
    (MLADims(16, 128, 64, 128, 512), torch.bfloat16, H200, {**V_OK, "triton": None}, 64, False,
     "triton not installed"),
    (MLADims(16, 128, 64, 128, 512), torch.bfloat16, H200, {**V_OK, "triton": "2.3.1"}, 64, False, "older"),
    (MLADims(16, 128, 64, 128, 512), torch.bfloat16, DeviceInfo("cuda", (7, 5)), V_OK, 64, False, "SM80"),
    (MLADims(16, 128, 64, 128, 2048), torch.bfloat16, H200, V_OK, 64, False, "kv_lora_rank"),
    (MLADims(16, 128, 512, 128, 512), torch.bfloat16, H200, V_OK, 64, False, "qk_rope_head_dim"),
    (MLADims(16, 128, 64, 128, 512), torch.float64, H200, V_OK, 64, False, "dtype"),
    (MLADims(16, 128, 64, 128, 512), torch.bfloat16, DeviceInfo("mps"), V_OK, 64, False, "CUDA only"),
]


@pytest.mark.parametrize("row", CHECK_TABLE, ids=[f"{r[5]}-{r[6]}" for r in CHECK_TABLE])
def test_check_table(row):
    dims, dtype, device, versions, page_size, ok, frag = row
    res = get_backend("triton").check(dims, dtype, Target(device, versions, page_size))
    assert res.ok == ok and frag in res.reason, res


@pytest.mark.parametrize("dims, dtype, device, page_size, frag", [
    (MLADims(16, 128, 64, 128, 512), torch.bfloat16, H200, 64, "decode on the Gluon warp-specialised kernel"),
    (MLADims(32, 64, 64, 128, 256), torch.float16, H200, 128, "decode on the Gluon warp-specialised kernel"),
    (MLADims(128, 128, 64, 128, 512), torch.bfloat16, H200, 64,
     "decode on the Gluon warp-specialised kernel, 64 heads per program"),
    (MLADims(64, 64, 64, 128, 256), torch.bfloat16, H200, 64, "not Gluon: gluon decode of N > 32 heads"),
    (MLADims(40, 64, 32, 64, 256), torch.bfloat16, H200, 64, "not Gluon: gluon decode needs R in (256, 512) and Dr == 64"),
    (MLADims(16, 128, 64, 128, 512), torch.bfloat16, H200, 16, "not Gluon: gluon decode needs pages of whole 64"),
    (MLADims(16, 128, 64, 128, 512), torch.float32, H200, 64, "not Gluon: gluon decode runs bf16/fp16"),
    (MLADims(16, 128, 64, 128, 512), torch.bfloat16, DeviceInfo("cuda", (10, 0)), 64, "written for SM90"),
])
def test_check_says_which_decode_kernel_runs(dims, dtype, device, page_size, frag):
    """The capability check names the decode path of TritonPolicy.decode_kernel='auto' and, where it
    is not the Gluon kernel, why not."""
    from autodeploy_mla.custom_ops.triton_mla import gluon_decode

    res = get_backend("triton").check(dims, dtype, Target(device, V_OK, page_size))
    assert res.ok, res
    if gluon_decode._GLUON_ERROR is not None:  # a triton without Gluon: every decode on the tl kernels
        frag = "gluon unavailable"
    assert frag in res.reason, res.reason


def test_check_cpu_only_under_interpreter(monkeypatch):
    be, d = get_backend("triton"), MLADims(4, 16, 8, 16, 32)
    monkeypatch.setenv("TRITON_INTERPRET", "1")
    assert be.check(d, torch.float32, Target(DeviceInfo("cpu"), V_OK, 4)).ok
    monkeypatch.setenv("TRITON_INTERPRET", "0")
    res = be.check(d, torch.float32, Target(DeviceInfo("cpu"), V_OK, 4))
    assert not res.ok and "CUDA GPU" in res.reason


def test_imports_without_triton():
    code = (
        "import sys; sys.modules['triton'] = None\n"
        "import torch, autodeploy_mla\n"
        "from autodeploy_mla.custom_ops import get_backend, DeviceInfo, MLADims, Target\n"
        "r = get_backend('triton').check(MLADims(16, 128, 64, 128, 512), torch.bfloat16,\n"
        "    Target(DeviceInfo('cuda', (9, 0)), {'triton': '3.6.0'}, 64))\n"
        "assert not r.ok and 'triton not installed' in r.reason, r\n"
        "print('OK')\n"
    )
    env = {k: v for k, v in os.environ.items() if k != "TRITON_INTERPRET"}
    p = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, env=env, timeout=300)
    assert p.returncode == 0 and "OK" in p.stdout, p.stderr[-2000:]


# ============================================================================= GPU
# Real model dims (DESIGN §3): N, Dn, Dr, Dv, R.
GPU_DIMS = REAL_MLA_DIMS
# Fresh prefills crossing 64-token pages, a chunk on a cached prefix, mixed prefill+decode, decodes.
GPU_SCHEDULE = (
    [{0: 300, 1: 77, 2: 1}, {0: 1, 1: 1, 2: 129, 3: 700}, {0: 1, 1: 1, 2: 1, 3: 40}]
    + [{0: 1, 1: 1, 2: 1, 3: 1}] * 3
)


@pytest.mark.gpu
@pytest.mark.parametrize("mode", ["auto", "expand", "absorb"])
@pytest.mark.parametrize("dims_name", list(GPU_DIMS))
def test_gpu_real_dims_bf16(dims_name, mode):
    res = scenario(GPU_DIMS[dims_name], GPU_SCHEDULE, mode, page_size=64, dtype=torch.bfloat16,
                       device="cuda", seed=1)
    err = res.max_rel_error()
    assert 0 < err < 1e-2, err


@pytest.mark.gpu
@pytest.mark.parametrize("forced", [False, True])
@pytest.mark.parametrize("dims_name", ["deepseek_v3_tp8_n16", "glm_4_7_flash", "deepseek_v3_n128"])
def test_gpu_fa3_prefill(dims_name, forced):
    """The expanded prefill's attention on FlashInfer's FA3 (qk 192 / vo 128 and 256 / 256), where it
    runs: a 1100-token fresh prefill beside a short one, then a 1030-token chunk on that cached prefix
    beside a decode (kv longer than q), then decodes; against the fp64 oracle. Forced: both prefill
    steps take FA3; auto: the steps from tuning.FA3_PREFILL_MIN_TOKENS new tokens, where a workspace was set up."""
    from autodeploy_mla.custom_ops.flashinfer.fa3_prefill import fa3_unavailable

    why = fa3_unavailable(GPU_DIMS[dims_name], torch.bfloat16, torch.device("cuda"))
    if why:
        pytest.skip(why)
    sch = [{0: 1100, 1: 77}, {0: 1030, 1: 1}, {0: 1, 1: 1}]
    policy = TritonPolicy(prefill_mode="expand", poison_buffers=True,
                          prefill_attention="flashinfer" if forced else "auto")
    res = run_scenario("triton", GPU_DIMS[dims_name], sch, page_size=64, dtype=torch.bfloat16, device="cuda",
                       seed=3, policy=policy)
    err = res.max_rel_error()
    assert 0 < err < 1e-2, err
    fa3 = res.session.fa3
    if forced:
        assert fa3 is not None and fa3.calls == 2, res.session.stats()
    else:  # auto: no FA3 where max_num_tokens is under the threshold, else the long steps only
        assert fa3 is None or fa3.calls == sum(m >= tuning.FA3_PREFILL_MIN_TOKENS for m in (1100, 1030))


@pytest.mark.gpu
@pytest.mark.parametrize("layout", ["heads_on_m", "heads_on_n"])
@pytest.mark.parametrize("dims_name", list(GPU_DIMS))
def test_gpu_decode_layouts(dims_name, layout):
    """Both decode kernels on real dims with 64-token pages: heads_on_n's whole tiles by TMA, the
    masked last tile by pointer; long histories so split-K and several tiles per chunk run."""
    sch = [{0: 1000, 1: 130, 2: 64, 3: 7}] + [{0: 1, 1: 1, 2: 1, 3: 1}] * 3
    res = scenario(GPU_DIMS[dims_name], sch, layout=layout, page_size=64, dtype=torch.bfloat16, device="cuda", seed=2)
    assert 0 < res.max_rel_error() < 1e-2, res.max_rel_error()


@pytest.mark.gpu
@pytest.mark.parametrize("layout", ["heads_on_m", "heads_on_n"])
@pytest.mark.parametrize("dims_name", list(GPU_DIMS))
def test_gpu_multi_token_decode(dims_name, layout):
    """Speculative-decoding verification steps on real dims (2-9 new tokens per sequence on
    histories of 64-1000 tokens, with plain decode tokens in the same step), 64-token pages: the
    decode kernel's query columns (TMA tiles) and the absorbed-prefill rows."""
    sch = [{0: 1000, 1: 130, 2: 64, 3: 7}, {0: 4, 1: 9, 2: 2, 3: 5}, {0: 3, 1: 1, 2: 8, 3: 1}, {0: 1, 1: 1, 2: 1, 3: 6}]
    res = scenario(GPU_DIMS[dims_name], sch, "absorb", layout=layout, page_size=64, dtype=torch.bfloat16,
                   device="cuda", seed=4)
    assert 0 < res.max_rel_error() < 1e-2, res.max_rel_error()


def _gluon_launches(session) -> int:
    from autodeploy_mla.custom_ops.triton_mla import gluon_decode

    kernels = [gluon_decode.kernel_for(gluon_decode.GluonDecodeConfig(16, 2)),
               gluon_decode.kernel_for(gluon_decode.WIDE_CONFIG)] if gluon_decode._GLUON_ERROR is None else []
    return sum(bk.jit_launches + bk.direct_launches for bk in session.launches._bound.values() if bk.fn in kernels)


@pytest.mark.gpu
@pytest.mark.parametrize("kernel", ["triton", "gluon", "auto"])
@pytest.mark.parametrize("dims_name", ["deepseek_v3_tp8_n16", "glm_4_7_flash", "mistral_small_4", "deepseek_v3_n128"])
def test_gpu_decode_kernels(dims_name, kernel):
    """The tl decode and the Gluon warp-specialised ones (gluon_decode.py, N > 32 gluon_decode_wide.py)
    through the op on the dims Gluon serves: ragged histories whose last tiles are partial
    (NaN-poisoned cache and buffers), split and unsplit steps; "auto" must pick Gluon on SM90."""
    sch = [{0: 1000, 1: 130, 2: 64, 3: 7}] + [{0: 1, 1: 1, 2: 1, 3: 1}] * 3
    for splits in (0, 1):
        res = scenario(GPU_DIMS[dims_name], sch, "auto", splits, kernel=kernel, page_size=64, dtype=torch.bfloat16,
                       device="cuda", seed=5)
        assert 0 < res.max_rel_error() < 1e-2, res.max_rel_error()
        sm90 = torch.cuda.get_device_capability()[0] == 9
        assert (_gluon_launches(res.session) > 0) == (kernel == "gluon" or (kernel == "auto" and sm90))


@pytest.mark.gpu
@pytest.mark.parametrize("splits", [1, 7])
def test_gpu_long_decode_split_k(splits):
    sch = [{0: 3000, 1: 1500}] + [{0: 1, 1: 1}] * 4
    res = scenario(GPU_DIMS["deepseek_v3_tp8_n16"], sch, "auto", splits, page_size=64,
                       dtype=torch.bfloat16, device="cuda")
    assert 0 < res.max_rel_error() < 1e-2


@pytest.mark.gpu
def test_cuda_graph_decode_replays_as_sequences_grow():
    """Capture one decode step at short lengths, replay it for 300 steps while the sequences grow
    past the page and split-chunk sizes; each replay must match the torch op run eagerly."""
    torch.manual_seed(0)
    dims = GPU_DIMS["mistral_small_4"]
    dev, dt, ps, bsz, max_seq = "cuda", torch.bfloat16, 64, 4, 1024
    n, dn, dr, dv, r = dims.num_heads, dims.qk_nope_head_dim, dims.qk_rope_head_dim, dims.v_head_dim, dims.kv_lora_rank
    info = SequenceInfo(bsz, 512, max_seq, ps, dev)
    alloc = PageAllocator(1 + bsz * info.max_pages_per_seq, ps, info.max_pages_per_seq)
    cache_t = torch.full((alloc.num_pages, ps, r + dr), float("nan"), dtype=dt, device=dev)
    cache_r = cache_t.clone()
    w = (torch.randn(n * (dn + dv), r, device=dev) * r**-0.5).to(dt)
    be_t, be_r = get_backend("triton"), get_backend("torch")

    def inputs(t):
        return [torch.randn(1, t, n, dn, device=dev, dtype=dt), torch.randn(1, t, n, dr, device=dev, dtype=dt),
                torch.randn(1, t, r, device=dev, dtype=dt), torch.randn(1, t, 1, dr, device=dev, dtype=dt)]

    def step(lens_new, done):
        alloc.ensure_many({s: done[s] + k for s, k in lens_new.items()})
        info.prepare_step([StepSequence(s, [0] * k, done[s]) for s, k in lens_new.items()], alloc.pages_of)

    done = {0: 0, 1: 0, 2: 0, 3: 0}
    prefill = {0: 37, 1: 64, 2: 100, 3: 5}
    step(prefill, done)
    x = inputs(info.num_tokens)
    be_t.cached_op(*x, w, *[info.get(m) for m in be_t.metadata], cache_t, None)
    be_r.cached_op(*x, w, *[info.get(m) for m in be_r.metadata], cache_r, None)
    for s, k in prefill.items():
        done[s] += k

    dec = {s: 1 for s in done}
    static_x = inputs(bsz)
    step(dec, done)
    meta_t = [info.get(m) for m in be_t.metadata]
    be_t.cached_op(*static_x, w, *meta_t, cache_t, None)  # warm-up (eager split plan, compiles)
    torch.cuda.synchronize()
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        static_out = be_t.cached_op(*static_x, w, *meta_t, cache_t, None)
    worst = 0.0
    for i in range(300):
        if i:
            step(dec, done)
        for buf, new in zip(static_x, inputs(bsz)):
            buf.copy_(new)
        graph.replay()
        ref = be_r.cached_op(*static_x, w, *[info.get(m) for m in be_r.metadata], cache_r, None)
        err = ((static_out.float() - ref.float()).abs().max() / ref.float().abs().max()).item()
        worst = max(worst, err)
        for s in done:
            done[s] += 1
    assert max(done.values()) > 350
    assert worst < 1e-2, worst


# ----------------------------------------------------------------------------- FA3 prefill attention
class _TorchFa3:
    """Stands in for fa3_prefill.Fa3Prefill on CPU: the same call, ragged causal attention in fp32 torch
    (query i of a sequence sees its first kv_len - q_len + i + 1 keys, FlashInfer's alignment)."""

    def __init__(self, ready: bool = True):
        self.calls = 0
        self.seen: list[tuple[tuple[int, ...], tuple[int, ...]]] = []
        self.ready = ready  # Fa3Prefill.ready: its module compiled

    def run(self, q, k, v, out, qo_indptr, kv_indptr, sm_scale):
        assert q.shape[-1] == k.shape[-1] and q.stride(-1) == k.stride(-1) == v.stride(-1) == out.stride(-1) == 1
        for b in range(len(qo_indptr) - 1):
            q0, q1, k0, k1 = qo_indptr[b], qo_indptr[b + 1], kv_indptr[b], kv_indptr[b + 1]
            s = torch.einsum("qhd,khd->hqk", q[q0:q1].double(), k[k0:k1].double()) * sm_scale
            keep = torch.arange(k1 - k0)[None, :] <= torch.arange(q1 - q0)[:, None] + (k1 - k0) - (q1 - q0)
            p = s.masked_fill(~keep, float("-inf")).softmax(-1)
            out[q0:q1] = torch.einsum("hqk,khd->qhd", p, v[k0:k1].double()).to(out.dtype)
        self.calls += 1
        self.seen.append((qo_indptr, kv_indptr))

    def stats(self):
        return {"fa3_prefill_calls": self.calls}


@pytest.mark.parametrize("schedule", ["ragged_prefill", "chunked_prefill_3", "mixed"])
@pytest.mark.parametrize("dims_name", ["r32_dr8", "r32_dr0"])
def test_expanded_prefill_through_fa3_call_matches_oracle(monkeypatch, dims_name, schedule):
    """The expanded prefill's attention handed to the FA3 wrapper (a torch stand-in on CPU): q and K
    written per head ([nope | rope]), V as a strided view of the expansion GEMM, output rows in place,
    host indptrs of every prefill sequence (chunks on a cached prefix: kv longer than q); equals the
    oracle. The real wrapper is checked against the same oracle on the GPU."""
    fake = _TorchFa3()
    monkeypatch.setattr(tsession, "make_fa3", lambda spec, policy: (fake, ""))
    policy = TritonPolicy(prefill_mode="expand", prefill_attention="flashinfer", poison_buffers=True)
    res = run_scenario("triton", CPU_DIMS[dims_name], STANDARD_SCHEDULES[schedule], policy=policy)
    assert res.max_rel_error() < 1e-5
    assert fake.calls > 0
    if schedule == "chunked_prefill_3":  # second chunk: 5 new tokens on 6 cached
        assert ((0, 5), (0, 11)) in fake.seen


def test_fa3_prefill_choice_and_refusals():
    """FA3 is a per-model session object: never on CPU (the reason is in the stats), refused when forced
    where it cannot run; head dims outside its kernels named; used under "auto" only from
    FA3_PREFILL_MIN_TOKENS new tokens and never while a graph is captured."""
    from autodeploy_mla.custom_ops.flashinfer.fa3_prefill import fa3_unavailable

    with pytest.raises(ValueError, match="prefill_attention='fa2'"):
        TritonPolicy(prefill_attention="fa2")
    bf16, cpu = torch.bfloat16, torch.device("cpu")
    assert "head dims qk 96 / vo 64" in fa3_unavailable(MLADims(40, 64, 32, 64, 256), bf16, cpu)  # MiniCPM3
    assert "bf16/fp16" in fa3_unavailable(MLADims(16, 128, 64, 128, 512), torch.float32, cpu)
    assert "CUDA device" in fa3_unavailable(MLADims(16, 128, 64, 128, 512), bf16, cpu)
    d = MLADims(16, 128, 64, 128, 512)
    spec = SessionSpec((d,), bf16, cpu, Target.detect(cpu, 16), 4, 64, 8)
    sess = get_backend("triton").setup(spec)
    assert sess.fa3 is None and "FA3" in sess.stats()["fa3_prefill"]
    with pytest.raises(ValueError, match="prefill_attention='flashinfer': FA3 prefill needs a CUDA device"):
        get_backend("triton").setup(spec, TritonPolicy(prefill_attention="flashinfer"))
    assert "off" in get_backend("triton").setup(spec, TritonPolicy(prefill_attention="triton")).fa3_reason
    assert "no step is long enough" in sess.fa3_reason  # max_num_tokens 64: "auto" never takes FA3 here
    long_spec = SessionSpec((d,), bf16, cpu, Target.detect(cpu, 16), 4, tuning.FA3_PREFILL_MIN_TOKENS, 8)
    assert "CUDA device" in get_backend("triton").setup(long_spec).fa3_reason

    def step(max_q, indptr=(0, 1)):
        return tshape.StepShape(1, max_q, 0, max_q, max_q, 0, 0, False, indptr, indptr)

    call = tcall.OpCall(TritonPolicy(), fa3=_TorchFa3())
    assert tlaunch.fa3_for_step(call, step(tuning.FA3_PREFILL_MIN_TOKENS), cpu)
    assert not tlaunch.fa3_for_step(call, step(tuning.FA3_PREFILL_MIN_TOKENS - 1), cpu)
    assert not tlaunch.fa3_for_step(call, step(4096, ()), cpu)
    assert tlaunch.fa3_for_step(tcall.OpCall(TritonPolicy(prefill_attention="flashinfer"), fa3=_TorchFa3()), step(8), cpu)
    assert not tlaunch.fa3_for_step(tcall.OpCall(TritonPolicy()), step(4096), cpu)
    # "auto" never waits for FA3's compile: until its module is built, the Triton kernel attends
    assert not tlaunch.fa3_for_step(tcall.OpCall(TritonPolicy(), fa3=_TorchFa3(ready=False)), step(4096), cpu)
    assert tlaunch.fa3_for_step(tcall.OpCall(TritonPolicy(prefill_attention="flashinfer"), fa3=_TorchFa3(ready=False)),
                             step(8), cpu)


_PACK_COMPILE_CHECK = """
from autodeploy_mla.custom_ops.triton_mla import kernels as K
sig = {"A": "*bf16", "B": "*bf16", "DST": "*bf16", "rows": "i32", **{f"stride_{x}_{y}": "i32" for x in "abd" for y in "th"}}
for da, db in ((128, 64), (192, 64), (128, 0)):
    compile_sm90(K.pack_heads_kernel, sig, {"DA": da, "DB": db, "BLOCK_T": 32, "BLOCK_DA": 1 << (da - 1).bit_length(),
                                            "BLOCK_DB": max(16, db)})
print("compiled")
"""


def test_pack_heads_kernel_compiles_for_sm90_without_a_gpu(tmp_path):
    """FA3's q/K packing kernel through Triton's compiler to SM90 (Dn 128 / 192 with Dr 64, and Dr 0)."""
    from autodeploy_mla.testing.sm90_compile import run_sm90_compile_check, sm90_backend_missing

    if why := sm90_backend_missing():
        pytest.skip(why)
    res = run_sm90_compile_check(_PACK_COMPILE_CHECK, tmp_path / "triton_cache")
    assert res.returncode == 0 and "compiled" in res.stdout, res.stderr[-3000:]


def test_step_shape_prefill_indptrs():
    """The host indptrs FA3 plans with: new tokens and kv lengths (prefix + new) of the prefill sequences."""
    shape = tshape.StepShape.from_host(torch.tensor([2, 7, 1]), torch.tensor([5, 9]), torch.tensor([0, 2, 7, 8]),
                                    torch.tensor([3, 4, 20]))
    assert shape.qo_indptr == (0, 2, 7) and shape.kv_indptr == (0, 5, 14)
