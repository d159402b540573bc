"""Block-FP8 weight format (models/fp8_format.py) and the FP8 source ops (custom_ops/fp8/linear.py)."""

from __future__ import annotations

import pytest
import torch

import autodeploy_mla.custom_ops  # noqa: F401  (registers the ops)
from autodeploy_mla.custom_ops.fp8.format import (BlockFP8Format, FP8FormatError, dequantize, quantize_weight,
                                                  scale_shape)

DS_QC = {"quant_method": "fp8", "fmt": "e4m3", "activation_scheme": "dynamic", "weight_block_size": [128, 128]}


def test_parse_deepseek_config():
    f = BlockFP8Format.from_quantization_config(DS_QC)
    assert (f.block_n, f.block_k, f.fmt, f.activation_scheme, f.per_tensor) == (128, 128, "e4m3", "dynamic", False)
    assert BlockFP8Format.from_quantization_config(f.to_quantization_config()) == f
    small = BlockFP8Format.from_quantization_config({**DS_QC, "weight_block_size": [32, 64]})
    assert small.block == (32, 64)


def test_parse_per_tensor_static_config():
    f = BlockFP8Format.from_quantization_config({"quant_method": "fp8", "activation_scheme": "static",
                                                 "weight_block_size": None, "ignored_layers": ["lm_head"]})
    assert f.per_tensor and f.block == (128, 128) and f.modules_to_not_convert == ("lm_head",)


@pytest.mark.parametrize("qc, words", [
    ({"quant_method": "awq"}, ["quant_method", "'awq'", "fp8"]),
    ({**DS_QC, "weight_block_size": [100, 128]}, ["block_n", "100", "power of two"]),
    ({**DS_QC, "weight_block_size": [128, 8]}, ["block_k", "8"]),
    ({**DS_QC, "weight_block_size": [128]}, ["weight_block_size", "two integers"]),
    ({**DS_QC, "activation_scheme": "static"}, ["activation_scheme", "static", "block"]),
    ({**DS_QC, "activation_scheme": "per_token"}, ["activation_scheme", "per_token"]),
    ({**DS_QC, "fmt": "e5m2"}, ["fmt", "e5m2"]),
    ({**DS_QC, "scale_fmt": "ue8m0"}, ["scale_fmt", "ue8m0"]),
])
def test_bad_configs_name_the_value(qc, words):
    with pytest.raises(FP8FormatError) as e:
        BlockFP8Format.from_quantization_config(qc, where="ckpt/config.json")
    msg = str(e.value)
    assert "ckpt/config.json" in msg or "block_" in msg
    for w in words:
        assert w in msg, msg


@pytest.mark.parametrize("n, k, block", [(200, 160, (128, 128)), (96, 80, (32, 32)), (64, 64, (32, 64)), (1, 5, (16, 16))])
def test_quantize_dequantize_partial_blocks(n, k, block):
    torch.manual_seed(0)
    w = torch.randn(n, k) * torch.linspace(0.01, 3.0, k)  # blocks of very different ranges
    q, s = quantize_weight(w, block)
    assert q.dtype == torch.float8_e4m3fn and s.dtype == torch.float32
    assert tuple(s.shape) == scale_shape(n, k, block) == (-(-n // block[0]), -(-k // block[1]))
    back = dequantize(q, s, block, torch.float32)
    # e4m3 has 3 mantissa bits: relative rounding error <= 2^-4 of each block's range
    err = (back - w).abs()
    bound = s.repeat_interleave(block[0], 0).repeat_interleave(block[1], 1)[:n, :k] * 448 * 2 ** -4
    assert (err <= bound + 1e-12).all()
    # each element is exactly its fp8 code times its block's scale (the partial edge blocks included)
    i, j = n - 1, k - 1
    assert back[i, j] == q[i, j].float() * s[i // block[0], j // block[1]]


def test_dequantize_leading_dims():
    torch.manual_seed(1)
    w = torch.randn(3, 40, 48)
    q, s = quantize_weight(w, (16, 32))
    assert s.shape == (3, 3, 2)
    for e in range(3):
        assert torch.equal(dequantize(q, s, (16, 32))[e], dequantize(q[e], s[e], (16, 32)))


def _case(n=200, k=160, block=(128, 128), bias=True, dtype=torch.float32, t=5):
    torch.manual_seed(2)
    q, s = quantize_weight(torch.randn(n, k) * 0.05, block)
    x = torch.randn(2, t, k, dtype=dtype)
    b = torch.randn(n, dtype=dtype) if bias else None
    return x, q, s, b


@pytest.mark.parametrize("block", [(128, 128), (32, 32), (16, 64)])
@pytest.mark.parametrize("bias", [True, False])
def test_fp8_block_linear_reference(block, bias):
    x, q, s, b = _case(block=block, bias=bias)
    out = torch.ops.autodeploy.fp8_block_linear(x, q, s, b, *block)
    ref = torch.nn.functional.linear(x, dequantize(q, s, block, torch.float32), b)
    assert out.dtype == x.dtype and out.shape == (2, 5, 200)
    assert torch.equal(out, ref)


def test_fp8_block_linear_bf16_out():
    x, q, s, b = _case(dtype=torch.bfloat16)
    out = torch.ops.autodeploy.fp8_block_linear(x, q, s, b, 128, 128)
    assert out.dtype == torch.bfloat16


#: opcheck's test_schema compares inputs before/after with float arithmetic that torch has no
#: float8 CPU kernel for; the no-mutation check is done by hand (bitwise) in test_opcheck instead.
_OPCHECKS = ("test_autograd_registration", "test_faketensor", "test_aot_dispatch_dynamic")


def test_opcheck():
    x, q, s, b = _case(block=(32, 32))
    q3, s3 = quantize_weight(torch.randn(2, 40, 48), (16, 32))
    calls = [(torch.ops.autodeploy.fp8_block_linear.default, (x, q, s, b, 32, 32)),
             (torch.ops.autodeploy.fp8_block_linear.default, (x, q, s, None, 32, 32)),
             (torch.ops.autodeploy.fp8_block_dequantize.default, (q, s, 32, 32, torch.float32)),
             (torch.ops.autodeploy.fp8_block_dequantize.default, (q3, s3, 16, 32, torch.bfloat16))]
    for op, args in calls:
        torch.library.opcheck(op, args, test_utils=_OPCHECKS)
        before = [a.clone() for a in args if isinstance(a, torch.Tensor)]
        op(*args)
        after = [a for a in args if isinstance(a, torch.Tensor)]
        assert all(torch.equal(a.view(torch.uint8) if a.dtype == torch.float8_e4m3fn else a,
                               b.view(torch.uint8) if b.dtype == torch.float8_e4m3fn else b)
                   for a, b in zip(before, after))


def test_fake_tensor_shapes():
    from torch._subclasses.fake_tensor import FakeTensorMode

    x, q, s, b = _case()
    with FakeTensorMode() as mode:
        fx, fq, fs = mode.from_tensor(x), mode.from_tensor(q), mode.from_tensor(s)
        out = torch.ops.autodeploy.fp8_block_linear(fx, fq, fs, None, 128, 128)
        assert out.shape == (2, 5, 200) and out.dtype == torch.float32
        dq = torch.ops.autodeploy.fp8_block_dequantize(fq, fs, 128, 128, torch.bfloat16)
        assert dq.shape == (200, 160) and dq.dtype == torch.bfloat16


@pytest.mark.parametrize("mutate, words", [
    (lambda x, q, s: (x, q.float(), s), ["weight", "float8_e4m3fn"]),
    (lambda x, q, s: (x, q, s[:1]), ["weight_scale_inv", "shape"]),
    (lambda x, q, s: (x, q, s.double()), ["weight_scale_inv", "float32"]),
    (lambda x, q, s: (x[..., :100], q, s), ["x has 100 features"]),
])
def test_bad_calls_name_the_argument(mutate, words):
    x, q, s, _ = _case()
    x, q, s = mutate(x, q, s)
    with pytest.raises(ValueError) as e:
        torch.ops.autodeploy.fp8_block_linear(x, q, s, None, 128, 128)
    for w in words:
        assert w in str(e.value)


def test_export_keeps_the_op():
    x, q, s, b = _case(block=(32, 32))

    class M(torch.nn.Module):
        def __init__(self):
            super().__init__()
            self.register_buffer("w", q)
            self.register_buffer("s", s)

        def forward(self, x):
            return torch.ops.autodeploy.fp8_block_linear(x, self.w, self.s, None, 32, 32)

    ep = torch.export.export(M(), (x,))
    targets = [n.target for n in ep.graph.nodes if n.op == "call_function"]
    assert torch.ops.autodeploy.fp8_block_linear.default in targets
    assert torch.equal(ep.module()(x), M()(x))
