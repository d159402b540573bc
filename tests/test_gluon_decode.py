"""The Gluon warp-specialised decode kernel (custom_ops/triton_mla/gluon_decode.py).

CPU (CI): the capability check's answers and the shared-memory plan. GPU (SM90, @pytest.mark.gpu): the
kernel against a float64 oracle on real dims, ragged histories (partial last tiles, one-token
sequences), shuffled pages whose unused slots hold NaN, split-K with a merge and the one-split path.
"""

from __future__ import annotations

import math

import pytest
import torch

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


@pytest.mark.parametrize("args, needle", [
    ((16, 512, 64, 64, torch.bfloat16, torch.bfloat16, torch.device("cpu")), "CUDA"),
])
def test_supports_refuses_cpu(args, needle):
    ok, why = GD.supports(*args)
    assert not ok and (needle in why or "gluon unavailable" in why)


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
    from autodeploy_mla.custom_ops.triton_mla import kernels as K
    from autodeploy_mla.custom_ops.triton_mla.op import _reduce_meta

    n, r, dr = REAL_DIMS[dims_name]
    dev = torch.device("cuda")
    ok, why = GD.supports(n, r, dr, 64, torch.bfloat16, torch.bfloat16, dev)
    if not ok:
        pytest.skip(why)
    g = torch.Generator().manual_seed(hash(dims_name) % 1000 + splits)
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
    cfg = GD.config_for(n, r, dr, b, 132)
    if variant == "other":
        cfg = _other_config(cfg)
        assert GD.smem_bytes(r, dr, cfg.cols, cfg.stages, cfg.convert) <= GD.SMEM_LIMIT
    GD.launch(GD.cache_descriptors(cache, r, dr), q_abs, q_pe, page_table, cu, seq_len, latent, part_acc, part_lse,
              n_seqs=b, seq_base=0, tok_base=0, abs_base=0, splits=splits, chunk=64, qk_scale=scale / math.log(2),
              num_heads=n, r=r, dr=dr, page_size=page, cfg=cfg)
    if splits > 1:
        K.split_reduce_kernel[(b, n)](part_acc, part_lse, latent, cu, 0, 0, splits, *part_acc.stride()[:3],
                                      *part_lse.stride()[:2], latent.stride(0), latent.stride(1), **_reduce_meta(r))
    got = latent.double().cpu()
    assert torch.isfinite(got).all()
    err = float((got - ref).abs().max() / ref.abs().max())
    assert 0 < err < 1e-2, err
