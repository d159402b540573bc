"""The uncached source op against plain float64 math, both layouts, all MLA dim classes."""

import math

import pytest
import torch

from autodeploy_mla.custom_ops.attention.mla_dims import MLADims, MLAShapeError

# (N, Dn, Dr, Dv, R): real dims of the families, and NoPE.
DIM_SETS = {
    "deepseek": MLADims(8, 128, 64, 128, 512),
    "glm_4_7_flash": MLADims(4, 192, 64, 256, 512),
    "mistral_small_4": MLADims(4, 64, 64, 128, 256),
    "minicpm3": MLADims(40, 64, 32, 64, 256),
    "nope": MLADims(4, 32, 0, 48, 64),
}


def plain_mla(q_nope, q_pe, ckv, kpe, w, causal, scale):
    """Loop-over-heads float64 MLA, written from the definition (bsnd)."""
    b, s, n, dn = q_nope.shape
    dv = w.shape[0] // n - dn
    out = torch.empty(b, s, n, dv, dtype=torch.float64)
    for h in range(n):
        wh = w[h * (dn + dv) : (h + 1) * (dn + dv)]
        k_nope = ckv @ wh[:dn].T  # [B,S,Dn]
        v = ckv @ wh[dn:].T  # [B,S,Dv]
        q = torch.cat([q_nope[:, :, h], q_pe[:, :, h]], -1)
        k = torch.cat([k_nope, kpe[:, :, 0]], -1)
        sc = (q @ k.transpose(1, 2)) * scale
        if causal:
            sc = sc.masked_fill(torch.ones(s, s, dtype=torch.bool).triu(1), -math.inf)
        out[:, :, h] = torch.softmax(sc, -1) @ v
    return out


def make_inputs(d: MLADims, b=2, s=6, dtype=torch.float32, seed=0):
    g = torch.Generator().manual_seed(seed)

    def r(*shape):
        return torch.randn(*shape, generator=g).to(dtype)

    return (
        r(b, s, d.num_heads, d.qk_nope_head_dim),
        r(b, s, d.num_heads, d.qk_rope_head_dim),
        r(b, s, d.kv_lora_rank),
        r(b, s, 1, d.qk_rope_head_dim),
        r(d.num_heads * (d.qk_nope_head_dim + d.v_head_dim), d.kv_lora_rank) * d.kv_lora_rank**-0.5,
    )


@pytest.mark.parametrize("name", list(DIM_SETS))
@pytest.mark.parametrize("layout", ["bsnd", "bnsd"])
@pytest.mark.parametrize("causal", [True, False])
def test_source_op_matches_plain_math(name, layout, causal):
    d = DIM_SETS[name]
    qn, qp, ckv, kpe, w = make_inputs(d, seed=hash((name, layout, causal)) % 1000)
    ref = plain_mla(*(x.double() for x in (qn, qp, ckv, kpe, w)), causal, d.default_scale())
    if layout == "bnsd":
        args = (qn.transpose(1, 2), qp.transpose(1, 2), ckv, kpe.transpose(1, 2), w)
        out = torch.ops.autodeploy.torch_mla(*args, causal, None, "bnsd").transpose(1, 2)
    else:
        out = torch.ops.autodeploy.torch_mla(qn, qp, ckv, kpe, w, causal, None, "bsnd")
    assert out.shape == (2, 6, d.num_heads, d.v_head_dim)
    err = (out.double() - ref).abs().max() / ref.abs().max()
    assert err < 1e-5, err


def test_explicit_scale_is_used():
    d = DIM_SETS["deepseek"]
    qn, qp, ckv, kpe, w = make_inputs(d)
    default = torch.ops.autodeploy.torch_mla(qn, qp, ckv, kpe, w)
    yarn = 1.7 * d.default_scale()
    scaled = torch.ops.autodeploy.torch_mla(qn, qp, ckv, kpe, w, True, yarn)
    assert not torch.allclose(default, scaled)
    ref = plain_mla(*(x.double() for x in (qn, qp, ckv, kpe, w)), True, yarn)
    assert (scaled.double() - ref).abs().max() / ref.abs().max() < 1e-5


@pytest.mark.parametrize("name", ["deepseek", "nope"])
def test_opcheck_source_op(name):
    d = DIM_SETS[name]
    args = make_inputs(d, b=1, s=3)
    torch.library.opcheck(torch.ops.autodeploy.torch_mla.default, args, {"is_causal": True, "scale": 0.1})


def test_bad_shapes_are_explained():
    d = DIM_SETS["mistral_small_4"]
    qn, qp, ckv, kpe, w = make_inputs(d)
    with pytest.raises(MLAShapeError, match="kv_b_proj_weight columns"):
        torch.ops.autodeploy.torch_mla(qn, qp, ckv, kpe, w[:, :-1])
    with pytest.raises(MLAShapeError, match="kpe shape"):
        torch.ops.autodeploy.torch_mla(qn, qp, ckv, kpe[..., :-1], w)
    with pytest.raises(MLAShapeError, match="dtypes"):
        torch.ops.autodeploy.torch_mla(qn, qp, ckv.double(), kpe, w)
    with pytest.raises(MLAShapeError, match="layout"):
        torch.ops.autodeploy.torch_mla(qn, qp, ckv, kpe, w, True, None, "sbnd")
