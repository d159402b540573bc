"""The Gluon warp-specialised decode kernel (custom_ops/triton_mla/gluon_decode.py).

CPU (CI): the capability check's answers and the shared-memory plan. GPU (SM90, @pytest.mark.gpu): the
kernel against a float64 oracle on real dims, ragged histories (partial last tiles, one-token
sequences), shuffled pages whose unused slots hold NaN, split-K with a merge and the one-split path.
"""

from __future__ import annotations

import math

import pytest
import torch

from autodeploy_mla.custom_ops.triton_mla import call as tcall, launchers as tlaunch  # noqa: E402
from autodeploy_mla.custom_ops.triton_mla import gluon_decode as GD

#: (N, R, Dr): DeepSeek-V3 TP-8, GLM-4.7-Flash, Mistral-Small-4
REAL_DIMS = {"deepseek_v3_tp8_n16": (16, 512, 64), "glm_4_7_flash_n20": (20, 512, 64),
             "mistral_small_4_n32": (32, 256, 64)}


def test_config_fits_shared_memory():
    for n, r, dr in REAL_DIMS.values():
        for cfg in GD.candidate_configs(n, r, dr):
            assert cfg.cols >= n and cfg.cols in (16, 32)
            assert 2 <= cfg.stages <= 4
            assert GD.resident_programs(r, dr, cfg) * GD.smem_bytes(r, dr, cfg.cols, cfg.stages, cfg.convert) \
                <= GD.SMEM_PER_SM
    one = GD.config_for(16, 512, 64, 8, 132)  # a 576-wide tile: two 72 KB buffers, one program per SM
    assert one.stages == 2 and GD.resident_programs(512, 64, one) == 1
    assert len(GD.candidate_configs(16, 512, 64)) == 1
    # R 256: two programs share an SM (shared memory and registers) while the batch fills half the SMs
    two = GD.config_for(32, 256, 64, 64, 132)
    assert (two.stages, two.convert, two.maxnreg) == (2, False, 128)
    assert GD.resident_programs(256, 64, two) == 2
    big = GD.config_for(32, 256, 64, 128, 132)
    assert big.maxnreg == 224 and GD.resident_programs(256, 64, big) == 1 and big.stages == 4
    # N > 32: the many-heads kernel, 64 heads per program, one per SM
    for n in (64, 128):
        wide = GD.config_for(n, 512, 64, 8, 132)
        assert wide.wide and wide.cols == 64 and GD.resident_programs(512, 64, wide) == 1
        assert GD.config_smem(512, 64, wide) <= GD.SMEM_LIMIT
        assert GD.plan(n, 512, 64, 32, 8192, 0, torch.device("cpu"))[0] is wide
    ok, why = GD.dims_supported(64, 256, 64, 64, torch.bfloat16, 90)
    assert not ok and "R = 512" in why, why


def test_wide_split_plan_counts_the_merge(monkeypatch):
    """The many-heads kernel's split count (132 SMs, N 128): one split where the wave model without the
    merge's fixed cost picked two (batch 32 x kv 512: 26.5 vs 29.4 us measured on an H200), two where
    they pay (32 x 2048: 52.4 vs 72.7 us), none once the batch fills the SMs."""
    from autodeploy_mla.custom_ops.triton_mla import tuning

    monkeypatch.setattr(tuning, "num_sms", lambda device: 132)
    cuda = torch.device("cuda")
    assert [GD.plan(128, 512, 64, 32, kv, 0, cuda)[1] for kv in (512, 2048, 8192)] == [1, 2, 2]
    assert [GD.plan(128, 512, 64, 128, kv, 0, cuda)[1] for kv in (512, 8192)] == [1, 1]
    assert GD.plan(128, 512, 64, 1, 8192, 0, cuda)[1] == 64
    assert tuning.split_plan_waves(64, 512, 64, 0, cuda, 132, 3.56)[0] == 2  # no fixed term: two
    assert tuning.split_plan_waves(64, 512, 64, 0, cuda, 132, 3.56, GD.WIDE_SPLIT_FIXED_TILES)[0] == 1


def test_query_descriptor_views_token_rows_or_refuses():
    """The many-heads kernel's query descriptor: q_abs [N, T, R] as [N, T * R] rows in [heads, R/2]
    boxes; None (the op then runs the `tl` kernel) where token rows are not contiguous or not 16-byte
    aligned."""
    if GD._GLUON_ERROR is not None:
        pytest.skip(f"no Gluon in this triton: {GD._GLUON_ERROR}")
    n, t, r = 128, 5, 512
    q = torch.zeros(n, t, r, dtype=torch.bfloat16)
    d = GD.query_descriptor(q, 64)
    assert list(d.shape) == [n, t * r] and list(d.strides) == [t * r, 1] and list(d.block_shape) == [64, r // 2]
    wide = torch.zeros(n, t, 2 * r, dtype=torch.bfloat16)[:, :, :r]  # token stride 2R: not [N, T * R] rows
    assert GD.query_descriptor(wide, 64) is None
    assert GD.query_descriptor(torch.zeros(t, n, r, dtype=torch.bfloat16).transpose(0, 1), 64) is None
    assert GD.query_descriptor(torch.zeros(n, r, t, dtype=torch.bfloat16).transpose(1, 2), 64) is None
    assert GD.query_descriptor(torch.zeros(n * t * r + 1, dtype=torch.bfloat16)[1:].view(n, t, r), 64) is None


def test_split_reduce_heads_kernel_matches_the_one_head_merge():
    """The several-heads split merge (interpreted): the same latent as split_reduce_kernel on random
    partials, with empty splits (LSE -inf, partial never written: NaN) skipped, and the host rule that
    picks it (many-heads decode, many rows, few splits)."""
    from autodeploy_mla.custom_ops.triton_mla import kernels as K

    g = torch.Generator().manual_seed(5)
    t, n, s, r = 3, 8, 3, 16
    acc = torch.randn(t, n, s, r, generator=g)
    lse = torch.randn(t, n, s, generator=g) * 3
    lse[0, :, 2] = float("-inf")
    acc[0, :, 2] = float("nan")
    lse[1, 3, :] = float("-inf")  # a row with no history at all: zero
    outs = []
    for heads in (1, 4):
        out = torch.full((n, t, r), float("nan"))
        rest = (0, 0, s, *acc.stride()[:3], *lse.stride()[:2], out.stride(0), out.stride(1))
        if heads == 1:
            K.split_reduce_kernel[(t, n)](acc, lse, out, torch.zeros(t + 1, dtype=torch.int32), *rest, R=r, BLOCK_R=r)
        else:
            K.split_reduce_heads_kernel[(t, n // heads)](acc, lse, out, *rest, R=r, BLOCK_H=heads)
        outs.append(out)
    assert torch.isfinite(outs[1]).all() and bool((outs[1][3, 1] == 0).all())
    torch.testing.assert_close(outs[1], outs[0], rtol=1e-5, atol=1e-6)
    assert tlaunch._reduce_heads(128, 512, 32, 2) == tlaunch.REDUCE_HEADS
    assert tlaunch._reduce_heads(128, 512, 8, 8) == 1 and tlaunch._reduce_heads(128, 512, 32, 8) == 1
    assert tlaunch._reduce_heads(42, 512, 64, 2) == 1  # heads not a multiple of REDUCE_HEADS


@pytest.mark.parametrize("args, needle", [
    ((16, 512, 64, 64, torch.bfloat16, torch.bfloat16, torch.device("cpu")), "CUDA"),
])
def test_supports_refuses_cpu(args, needle):
    ok, why = GD.supports(*args)
    assert not ok and (needle in why or "gluon unavailable" in why)


#: prepended to both compile checks: compile_gluon(fn, meta, r, dr) -> (compiled kernel, its PTX)
_GLUON_COMPILE_PRELUDE = """
import re
from triton.experimental.gluon import language as gl
from triton.experimental.gluon._runtime import GluonASTSource

PTRS = {"Q_ABS": "*bf16", "Q_PE": "*bf16", "PAGE_TABLE": "*i32", "CU_SEQLEN": "*i32", "SEQ_LEN": "*i32",
        "LATENT": "*bf16", "PART_ACC": "*fp32", "PART_LSE": "*fp32"}


def compile_gluon(fn, meta, r, dr):
    meta = dict(meta)
    opts = {"num_warps": meta.pop("num_warps"), "maxnreg": meta.pop("maxnreg")}
    sig = {}
    for p in fn.arg_names:
        if p in meta:
            sig[p] = "constexpr"
        elif p in ("kv_desc", "kpe_desc", "q_desc"):
            block = [64, dr] if p == "kpe_desc" else [64, r // 2]
            lay = gl.NVMMASharedLayout.get_default_for(block, gl.bfloat16)
            sig[p] = f"tensordesc<bf16[{block[0]},{block[1]}],{lay!r}>"
        else:
            sig[p] = PTRS.get(p, "fp32" if p == "qk_scale" else "i32")
    attrs = {(fn.arg_names.index(p),): [["tt.divisibility", 16]] for p in PTRS}
    k = triton.compile(GluonASTSource(fn, sig, constexprs=meta, attrs=attrs), target=GPUTarget("cuda", 90, 32),
                       options=opts)
    ptx = k.asm["ptx"]
    return k, ptx, len(re.findall(r"wgmma\\.mma_async", ptx)), len(re.findall(r"cp\\.async\\.bulk\\.tensor", ptx))
"""

def _compiled_rows(script: str, tag: str, tmp_path) -> list[list[int]]:
    """Run a compile-check script (a fresh process, SM90 target, no GPU) and return its `tag` rows as
    ints; skips where this Triton has no Gluon or no SM90 backend."""
    from autodeploy_mla.testing.sm90_compile import run_sm90_compile_check, sm90_backend_missing

    if GD._GLUON_ERROR is not None:
        pytest.skip(f"no Gluon in this triton: {GD._GLUON_ERROR}")
    if why := sm90_backend_missing():
        pytest.skip(why)
    res = run_sm90_compile_check(script, tmp_path / "triton_cache")
    assert res.returncode == 0, res.stderr[-3000:]
    return [list(map(int, ln.split()[1:])) for ln in res.stdout.splitlines() if ln.startswith(tag + " ")]


_GLUON_COMPILE_CHECK = _GLUON_COMPILE_PRELUDE + """
from autodeploy_mla.custom_ops.triton_mla import gluon_decode as GD

for n, r, dr in ((16, 512, 64), (20, 512, 64), (32, 256, 64)):
    for cfg in GD.candidate_configs(n, r, dr):
        k, ptx, wgmma, tma = compile_gluon(GD.gluon_decode_kernel, GD.kernel_meta(n, r, dr, 64, cfg, True), r, dr)
        print("gluon", n, r, cfg.stages, int(cfg.convert), cfg.maxnreg, k.metadata.shared,
              GD.smem_bytes(r, dr, cfg.cols, cfg.stages, cfg.convert), wgmma, tma, int("setmaxnreg" in ptx))
"""


def test_gluon_decode_kernel_compiles_for_sm90_without_a_gpu(tmp_path):
    """Every candidate config of the Gluon kernel through the installed Triton's compiler to SM90: it
    compiles (the interpreter never runs Gluon), warp-specialised (setmaxnreg per partition), with the
    expected wgmmas (QK: (2 R/2 + Dr) / 16 k-steps; PV: two halves of R/2 / 64 x 4) and TMA copies
    (three per tile, 64-column boxes), in the shared memory `smem_bytes` plans for."""
    rows = _compiled_rows(_GLUON_COMPILE_CHECK, "gluon", tmp_path)
    assert len(rows) == sum(len(GD.candidate_configs(n, r, dr)) for n, r, dr in REAL_DIMS.values()), rows
    for n, r, stages, convert, maxnreg, shared, planned, wgmma, tma, ws in rows:
        assert shared <= planned <= GD.SMEM_LIMIT, (n, r, stages, shared, planned)
        assert wgmma == (r + 64) // 16 + 2 * (r // 2 // 64) * 4, (n, r, wgmma)
        assert tma == 2 * (r // 2 // 64) + 1, (n, r, tma)
        assert ws == 1


def _oracle(q_abs, q_pe, cache, page_table, seq_len, scale):
    """[N, B, R] latent in float64: softmax over each sequence's history of q_abs . ckv + q_pe . kpe."""
    n, b, r = q_abs.shape
    page = cache.shape[1]
    out = torch.zeros(n, b, r, dtype=torch.float64)
    c64 = cache.double().cpu()
    for i in range(b):
        L = int(seq_len[i])
        pos = torch.arange(L)
        rows = page_table[i, pos // page].long().cpu() * page + pos % page
        kv = c64.view(-1, c64.shape[-1])[rows]
        s = (q_abs[:, i].double().cpu() @ kv[:, :r].T + q_pe[0, i].double().cpu() @ kv[:, r:].T) * scale
        out[:, i] = torch.softmax(s, -1) @ kv[:, :r]
    return out


def _make_case(n, r, dr, splits, seed, dev):
    """Ragged decode histories (partial last tiles, a one-token sequence) on shuffled 64-token pages
    whose unused slots hold NaN, NaN-filled outputs, and the float64 oracle."""
    g = torch.Generator().manual_seed(seed)
    lens = [1, 63, 64, 65, 700, 1000, 129, 2050]
    b, page = len(lens), 64
    pps = max(math.ceil(L / page) for L in lens)
    num_pages = b * pps + 3
    cache = torch.full((num_pages, page, r + dr), float("nan"), dtype=torch.bfloat16)
    perm = torch.randperm(num_pages, generator=g)
    page_table = torch.zeros(b, pps, dtype=torch.int32)
    for i, L in enumerate(lens):
        for p in range(math.ceil(L / page)):
            pid = int(perm[i * pps + p])
            page_table[i, p] = pid
            used = min(page, L - p * page)
            cache[pid, :used] = torch.randn(used, r + dr, generator=g).to(torch.bfloat16)
    q_abs = (torch.randn(n, b, r, generator=g) * 0.05).to(torch.bfloat16)
    q_pe = torch.randn(1, b, n, dr, generator=g).to(torch.bfloat16)
    scale = 1.0 / math.sqrt(192)
    ref = _oracle(q_abs, q_pe, cache, page_table, torch.tensor(lens), scale)

    cache, page_table, q_abs, q_pe = (t.to(dev) for t in (cache, page_table, q_abs, q_pe))
    cu = torch.arange(b + 1, dtype=torch.int32, device=dev)
    seq_len = torch.tensor(lens, dtype=torch.int32, device=dev)
    latent = torch.full_like(q_abs, float("nan"))
    part_acc = torch.full((b, n, splits, r), float("nan"), dtype=torch.float32, device=dev)
    part_lse = torch.full((b, n, splits), float("nan"), dtype=torch.float32, device=dev)
    return cache, page_table, q_abs, q_pe, cu, seq_len, latent, part_acc, part_lse, ref, scale, b, page


def _merge_and_check(part_acc, part_lse, latent, cu, ref, b, n, r, splits, heads=1):
    """Merge the split partials (split_reduce_kernel, or split_reduce_heads_kernel with `heads` per
    program) and compare the latent with the float64 oracle."""
    from autodeploy_mla.custom_ops.triton_mla import kernels as K
    from autodeploy_mla.custom_ops.triton_mla.launchers import _reduce_heads_meta, _reduce_meta

    rest = (0, 0, splits, *part_acc.stride()[:3], *part_lse.stride()[:2], latent.stride(0), latent.stride(1))
    if splits > 1 and heads > 1:
        K.split_reduce_heads_kernel[(b, n // heads)](part_acc, part_lse, latent, *rest, **_reduce_heads_meta(r, heads))
    elif splits > 1:
        K.split_reduce_kernel[(b, n)](part_acc, part_lse, latent, cu, *rest, **_reduce_meta(r))
    got = latent.double().cpu()
    assert torch.isfinite(got).all()
    err = float((got - ref).abs().max() / ref.abs().max())
    assert 0 < err < 1e-2, err


def _other_config(cfg):
    """The config config_for did not pick: two programs per SM (R 256) -> one with four KV stages and
    the epilogue's layout change; one per SM (R 512) -> no layout change, 128 registers at launch."""
    if cfg.maxnreg == 128:
        return GD.GluonDecodeConfig(cfg.cols, 4)
    return GD.GluonDecodeConfig(cfg.cols, cfg.stages, convert=False, maxnreg=128)


@pytest.mark.gpu
@pytest.mark.parametrize("variant", ["chosen", "other"])
@pytest.mark.parametrize("splits", [1, 3, 8])
@pytest.mark.parametrize("dims_name", list(REAL_DIMS))
def test_gpu_gluon_decode_matches_oracle(dims_name, splits, variant):
    n, r, dr = REAL_DIMS[dims_name]
    dev = torch.device("cuda")
    ok, why = GD.supports(n, r, dr, 64, torch.bfloat16, torch.bfloat16, dev)
    if not ok:
        pytest.skip(why)
    cache, page_table, q_abs, q_pe, cu, seq_len, latent, part_acc, part_lse, ref, scale, b, page = _make_case(
        n, r, dr, splits, hash(dims_name) % 1000 + splits, dev)
    cfg = GD.config_for(n, r, dr, b, 132)
    if variant == "other":
        cfg = _other_config(cfg)
        assert GD.smem_bytes(r, dr, cfg.cols, cfg.stages, cfg.convert) <= GD.SMEM_LIMIT
    GD.launch(GD.cache_descriptors(cache, r, dr), q_abs, q_pe, page_table, cu, seq_len, latent, part_acc, part_lse,
              n_seqs=b, seq_base=0, tok_base=0, abs_base=0, splits=splits, chunk=64, qk_scale=scale / math.log(2),
              num_heads=n, r=r, dr=dr, page_size=page, cfg=cfg)
    _merge_and_check(part_acc, part_lse, latent, cu, ref, b, n, r, splits)


def test_gluon_compile_failure_falls_back_or_explains(monkeypatch):
    """A Triton whose Gluon cannot build the kernel: decode_kernel='auto' warns once with the compiler's
    reason and the op decodes on the tl kernels (the launcher returns 0: nothing launched);
    decode_kernel='gluon' raises, naming the triton version and the reason."""
    import warnings

    from autodeploy_mla.custom_ops import MLADims, MLAShapeError
    from autodeploy_mla.custom_ops.triton_mla import TritonPolicy

    if GD._GLUON_ERROR is not None:
        pytest.skip(f"no Gluon in this triton: {GD._GLUON_ERROR}")

    def fails(*args, **kwargs):
        raise RuntimeError("while lowering\nunknown op 'ttng.example'")

    monkeypatch.setattr(tlaunch, "_warm_gluon_decode", fails)
    dims = MLADims(16, 128, 64, 128, 512)
    b = 2
    cache = torch.zeros(3, 64, 576, dtype=torch.bfloat16)
    q_abs = torch.zeros(16, b, 512, dtype=torch.bfloat16)
    q_pe = torch.zeros(1, b, 16, 64, dtype=torch.bfloat16)
    args = (q_abs, q_pe, cache, torch.zeros(b, 2, dtype=torch.int32), torch.arange(b + 1, dtype=torch.int32),
            torch.ones(b, dtype=torch.int32), torch.empty_like(q_abs))
    kw = dict(seq_base=0, n_seqs=b, tok_base=0, abs_base=0, kv_bound=64, dims=dims, qk_scale=1.0)
    call = tcall.OpCall(TritonPolicy(), warmed=set())
    with pytest.warns(RuntimeWarning, match="unknown op 'ttng.example'.*tl kernels"):
        assert tlaunch.launch_gluon_decode(call, *args, **kw) == 0
    with warnings.catch_warnings():
        warnings.simplefilter("error")  # remembered for the model: no second attempt, no second warning
        assert tlaunch.launch_gluon_decode(call, *args, **kw) == 0
    forced = tcall.OpCall(TritonPolicy(decode_kernel="gluon"), warmed=set())
    with pytest.raises(MLAShapeError, match="did not compile with triton .*unknown op 'ttng.example'"):
        tlaunch.launch_gluon_decode(forced, *args, **kw)


def test_gluon_warm_up_loads_every_variant(monkeypatch):
    """Before any capture the op compiles every variant a later decode graph may launch: each candidate
    config with and without SPLIT, and the split merge (recorded here instead of compiled: no GPU)."""
    from autodeploy_mla.custom_ops import MLADims
    from autodeploy_mla.custom_ops.triton_mla import TritonPolicy
    from autodeploy_mla.custom_ops.triton_mla import kernels as K

    if GD._GLUON_ERROR is not None:
        pytest.skip(f"no Gluon in this triton: {GD._GLUON_ERROR}")
    seen = []
    monkeypatch.setattr(tlaunch.BoundKernel, "warmup",
                        lambda self, ptrs, scalars: seen.append((self.fn, dict(self.constexprs), len(ptrs))))
    dims = MLADims(32, 64, 64, 128, 256)  # Mistral-Small-4: two candidate configs
    b = 3
    cache = torch.zeros(4, 64, 320, dtype=torch.bfloat16)
    q_abs = torch.zeros(32, b, 256, dtype=torch.bfloat16)
    latent = torch.empty_like(q_abs)
    common = dict(seq_base=0, tok_base=0, abs_base=0, chunk=128, qk_scale=1.0)
    tlaunch._warm_gluon_decode(tcall.OpCall(TritonPolicy(), warmed=set()), GD.cache_descriptors(cache, 256, 64), q_abs,
                           torch.zeros(1, b, 32, 64, dtype=torch.bfloat16), torch.zeros(b, 2, dtype=torch.int32),
                           torch.arange(b + 1, dtype=torch.int32), torch.ones(b, dtype=torch.int32), latent, dims, 64,
                           common)
    gluon = {(c["SPLIT"], c["STAGES"], c["CONVERT"], c["maxnreg"]) for f, c, _ in seen if f is GD.gluon_decode_kernel}
    want = {(split, cfg.stages, cfg.convert, cfg.maxnreg) for split in (False, True)
            for cfg in GD.candidate_configs(32, 256, 64)}
    assert gluon == want and len(want) == 4
    assert [n for f, _, n in seen if f is K.split_reduce_kernel] == [4]


@pytest.mark.gpu
@pytest.mark.parametrize("splits", [1, 3, 8])
@pytest.mark.parametrize("n", [128, 64])
def test_gpu_gluon_wide_matches_oracle(n, splits):
    """The N > 32 kernel (gluon_decode_wide.py): against the float64 oracle on DeepSeek-V3 dims (ragged
    histories: odd and even tile counts, partial last tiles, empty splits), its partials merged by
    split_reduce_kernel and by split_reduce_heads_kernel."""
    r, dr = 512, 64
    dev = torch.device("cuda")
    ok, why = GD.supports(n, r, dr, 64, torch.bfloat16, torch.bfloat16, dev)
    if not ok:
        pytest.skip(why)
    cache, page_table, q_abs, q_pe, cu, seq_len, latent, part_acc, part_lse, ref, scale, b, page = _make_case(
        n, r, dr, splits, n + splits, dev)
    GD.launch(GD.cache_descriptors(cache, r, dr), q_abs, q_pe, page_table, cu, seq_len, latent, part_acc, part_lse,
              n_seqs=b, seq_base=0, tok_base=0, abs_base=0, splits=splits, chunk=64, qk_scale=scale / math.log(2),
              num_heads=n, r=r, dr=dr, page_size=page, cfg=GD.WIDE_CONFIG)
    _merge_and_check(part_acc, part_lse, latent, cu, ref, b, n, r, splits)
    if splits > 1:  # the several-heads merge the op picks for large batches, on the same partials
        latent.fill_(float("nan"))
        _merge_and_check(part_acc, part_lse, latent, cu, ref, b, n, r, splits, heads=4)


_GLUON_WIDE_COMPILE_CHECK = _GLUON_COMPILE_PRELUDE + """
from autodeploy_mla.custom_ops.triton_mla import gluon_decode as GD

cfg = GD.WIDE_CONFIG
for split in (True, False):
    k, ptx, wgmma, tma = compile_gluon(GD.kernel_for(cfg), GD.kernel_meta(128, 512, 64, 64, cfg, split), 512, 64)
    print("wide", int(split), k.metadata.shared, GD.config_smem(512, 64, cfg), k.metadata.num_warps, wgmma, tma,
          int("setmaxnreg" in ptx))
"""


def test_gluon_wide_kernel_compiles_for_sm90_without_a_gpu(tmp_path):
    """The many-heads kernel: 12 warps (two consumer warpgroups + the loader's), warp-specialised, in the
    shared memory `config_smem` plans for, 132 wgmmas (WG0: 36 QK + 4 PV per tile, the loop unrolled by
    two plus the odd tile; WG1: 4 PV per tile, three times), 9 TMA copies per tile and 8 for the latent
    queries (two [64, 256] boxes in 64-column copies)."""
    rows = _compiled_rows(_GLUON_WIDE_COMPILE_CHECK, "wide", tmp_path)
    assert len(rows) == 2, rows
    for split, shared, planned, warps, wgmma, tma, ws in rows:
        assert shared <= planned <= GD.SMEM_LIMIT and warps == 12 and wgmma == 132 and tma == 9 + 8 and ws == 1, \
            rows
