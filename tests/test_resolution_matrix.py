"""Backend resolution with the real descriptors and the packaged auto order, over mocked devices
(CPU, SM80, SM90, SM100) x FlashInfer (absent, 0.6.x, 0.7.x) x (R, Dr) x auto/explicit.

Expected values are written out by hand from DESIGN §8's capability table, not recomputed.
"""

import pytest
import torch

from autodeploy_mla.config import load_config
from autodeploy_mla.custom_ops.attention.registry import DeviceInfo, Target
from autodeploy_mla.custom_ops.attention.mla_dims import MLADims
from autodeploy_mla.transforms.backend_resolution import BackendResolutionError, resolve_backend

PREF = load_config().transforms["insert_cached_mla_attention"]["preference"]
DEVICES = {
    "cpu": DeviceInfo("cpu"),
    "sm80": DeviceInfo("cuda", (8, 0), "A100"),
    "sm90": DeviceInfo("cuda", (9, 0), "H200"),
    "sm100": DeviceInfo("cuda", (10, 0), "B200"),
}
FLASHINFER = {"absent": None, "0.6": "0.6.18.post1", "0.7": "0.7.2"}
RANK_ROPE = [(512, 64), (256, 64), (256, 32), (128, 64), (512, 0)]
FI, TR, TO = "flashinfer_mla", "triton", "torch"
AUTO = {  # device, flashinfer -> backend per RANK_ROPE entry
    ("cpu", "absent"): [TO] * 5, ("cpu", "0.6"): [TO] * 5, ("cpu", "0.7"): [TO] * 5,
    ("sm80", "absent"): [TR] * 5, ("sm80", "0.6"): [FI, TR, TR, TR, TR], ("sm80", "0.7"): [FI, FI, TR, FI, FI],
    ("sm90", "absent"): [TR] * 5, ("sm90", "0.6"): [FI, TR, TR, TR, TR], ("sm90", "0.7"): [FI, FI, TR, FI, FI],
    # SM100: TRT-LLM-gen is untested on hardware, so auto puts Triton first there.
    ("sm100", "absent"): [TR] * 5, ("sm100", "0.6"): [TR] * 5, ("sm100", "0.7"): [TR] * 5,
}


def _target(dev, fi, triton="3.6.0"):
    return Target(DEVICES[dev], {"torch": "2.11.0", "triton": triton, "flashinfer": FLASHINFER[fi]}, 64)


def _dtype(dev):
    return torch.bfloat16 if DEVICES[dev].type == "cuda" else torch.float32


@pytest.mark.parametrize("dev, fi", list(AUTO))
def test_auto(dev, fi):
    got = []
    for r, dr in RANK_ROPE:
        d = resolve_backend("L", MLADims(128, 128, dr, 128, r), _dtype(dev), _target(dev, fi),
                            "auto", PREF)
        got.append(d.backend)
        first = PREF[dev][0]
        if d.backend != first:  # every preferred backend that lost says why
            assert d.rejected and d.rejected[0][0] == first and d.rejected[0][1]
    assert got == AUTO[(dev, fi)]


def test_auto_without_triton_falls_to_torch_on_gpu():
    d = resolve_backend("L", MLADims(40, 64, 32, 64, 256), torch.bfloat16, _target("sm90", "0.6", triton=None),
                        "auto", PREF)
    assert d.backend == TO
    assert [b for b, _ in d.rejected] == [FI, TR]
    assert "triton not installed" in d.rejected[1][1]


@pytest.mark.parametrize(
    "dev, fi, dims, backend, message",
    [
        ("sm90", "0.6", MLADims(32, 64, 64, 128, 256), FI, "crashed"),  # the measured 0.6.18 R=256 crash
        ("sm90", "0.7", MLADims(40, 64, 32, 64, 256), FI, "not supported"),
        ("sm90", "absent", MLADims(128, 128, 64, 128, 512), FI, "not installed"),
        ("cpu", "0.7", MLADims(128, 128, 64, 128, 512), TR, "CUDA"),
        ("cpu", "0.7", MLADims(128, 128, 64, 128, 512), FI, ""),
        ("sm90", "0.7", MLADims(128, 128, 64, 128, 512), "flashinfer_trtllm_mla", ""),
        ("sm100", "0.7", MLADims(96, 128, 64, 128, 512), "flashinfer_trtllm_mla", "64 < N < 128"),
        ("sm100", "0.7", MLADims(128, 128, 32, 128, 256), "flashinfer_trtllm_mla", "not supported"),
    ],
)
def test_explicit_unsupported_is_an_error(dev, fi, dims, backend, message, monkeypatch):
    monkeypatch.delenv("TRITON_INTERPRET", raising=False)  # conftest sets it; users on CPU do not
    with pytest.raises(BackendResolutionError, match=f"backend '{backend}' cannot serve.*{message}"):
        resolve_backend("model.layers.0.self_attn", dims, _dtype(dev), _target(dev, fi), backend, PREF)


@pytest.mark.parametrize(
    "dev, fi, dims, backend",
    [
        ("sm90", "0.6", MLADims(128, 128, 64, 128, 512), FI),
        ("sm90", "0.7", MLADims(32, 64, 64, 128, 256), FI),
        ("sm90", "absent", MLADims(40, 64, 32, 64, 256), TR),
        ("sm100", "0.7", MLADims(128, 128, 64, 128, 512), "flashinfer_trtllm_mla"),
        ("sm100", "0.7", MLADims(16, 128, 64, 128, 512), "flashinfer_trtllm_mla"),
        ("cpu", "absent", MLADims(4, 8, 0, 8, 16), TO),
    ],
)
def test_explicit_supported(dev, fi, dims, backend):
    d = resolve_backend("L", dims, _dtype(dev), _target(dev, fi), backend, PREF)
    assert d.backend == backend and d.reason.startswith("requested explicitly")
