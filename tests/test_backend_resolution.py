"""Per-node backend resolution logic, with fake backends and mocked devices/versions."""

import pytest
import torch

from autodeploy_mla.custom_ops.attention import registry as br
from autodeploy_mla.custom_ops.attention.mla_dims import MLADims
from autodeploy_mla.transforms.backend_resolution import BackendResolutionError, arch_key, resolve_backend

DS = MLADims(128, 128, 64, 128, 512)
SMALL_R = MLADims(32, 64, 64, 128, 256)
SM90 = br.DeviceInfo("cuda", (9, 0), "H200")
CPU = br.DeviceInfo("cpu")


class _Fake(br.MLABackend):
    """Accepts CUDA nodes with R == 512 only when 'fakelib' >= 1.0."""

    name = "fake_fast"
    cached_op = torch.ops.autodeploy.torch_mla_with_cache
    metadata = ()

    def check(self, dims, dtype, target):
        if target.device.type != "cuda":
            return br.CheckResult(False, "needs CUDA")
        v = br.parse_version(target.versions.get("fakelib"))
        if v is None:
            return br.CheckResult(False, "fakelib not installed")
        if dims.kv_lora_rank != 512:
            return br.CheckResult(False, f"R={dims.kv_lora_rank} unsupported (512 only)")
        return br.CheckResult(True, "ok")


@pytest.fixture(autouse=True)
def fake_backend(monkeypatch):
    monkeypatch.setitem(br._REGISTRY, "fake_fast", _Fake())


PREF = {"sm90": ["fake_fast", "torch"], "cpu": ["torch"]}


def T(device, versions):
    return br.Target(device, versions, 64)


def test_arch_keys():
    assert arch_key(CPU) == "cpu"
    assert arch_key(br.DeviceInfo("cuda", (8, 0))) == "sm80"
    assert arch_key(br.DeviceInfo("cuda", (8, 9))) == "sm80"
    assert arch_key(SM90) == "sm90"
    assert arch_key(br.DeviceInfo("cuda", (10, 0))) == "sm100"
    assert arch_key(br.DeviceInfo("cuda", (12, 0))) == "cuda"


def test_auto_takes_first_accepted_and_records_rejections():
    d = resolve_backend("L0", DS, torch.bfloat16, T(SM90, {"fakelib": "1.2"}), "auto", PREF)
    assert d.backend == "fake_fast" and d.rejected == ()
    d = resolve_backend("L1", SMALL_R, torch.bfloat16, T(SM90, {"fakelib": "1.2"}), "auto", PREF)
    assert d.backend == "torch"
    assert d.rejected == (("fake_fast", "R=256 unsupported (512 only)"),)
    d = resolve_backend("L2", DS, torch.bfloat16, T(SM90, {"fakelib": None}), "auto", PREF)
    assert d.backend == "torch" and d.rejected[0][1] == "fakelib not installed"
    d = resolve_backend("L3", DS, torch.float32, T(CPU, {}), "auto", PREF)
    assert d.backend == "torch" and "cpu order" in d.reason


def test_explicit_backend_error_and_fallback():
    with pytest.raises(BackendResolutionError, match="L0: backend 'fake_fast' cannot serve.*R=256 unsupported"):
        resolve_backend("L0", SMALL_R, torch.bfloat16, T(SM90, {"fakelib": "1.0"}), "fake_fast", PREF)
    d = resolve_backend("L0", SMALL_R, torch.bfloat16, T(SM90, {"fakelib": "1.0"}), "fake_fast", PREF,
                        allow_fallback=True)
    assert d.backend == "torch" and d.requested == "fake_fast" and "fallback" in d.reason
    assert d.rejected == (("fake_fast", "R=256 unsupported (512 only)"),)
    d = resolve_backend("L0", DS, torch.bfloat16, T(SM90, {"fakelib": "1.0"}), "fake_fast", PREF)
    assert d.backend == "fake_fast" and "requested explicitly" in d.reason


def test_missing_preference_and_no_backend():
    with pytest.raises(BackendResolutionError, match="no backend preference for device class 'sm100'"):
        resolve_backend("L0", DS, torch.bfloat16, T(br.DeviceInfo("cuda", (10, 0)), {}), "auto", PREF)
    with pytest.raises(BackendResolutionError, match="no backend can serve"):
        resolve_backend("L0", DS, torch.bfloat16, T(CPU, {}), "auto", {"cpu": ["fake_fast"]})
    with pytest.raises(KeyError, match="valid"):
        resolve_backend("L0", DS, torch.bfloat16, T(CPU, {}), "nope", PREF)


def test_per_layer_override_in_the_pass(monkeypatch):
    """Layer globs/indices pick backends per node; the user's config object is not mutated."""
    from autodeploy_mla import optimize
    from autodeploy_mla.config import load_config
    from autodeploy_mla.config import model_config_path

    monkeypatch.setattr(_Fake, "check", lambda self, *a: br.CheckResult(True, "fake accepts"))
    cfg = load_config(model_config_path("default"), overrides=[
        "model.device=cpu", "model.dtype=float32", "runtime.page_size=4",
        "transforms.insert_cached_mla_attention.layers={'1': fake_fast}",
    ])
    before = cfg.model_dump()
    om = optimize(None, cfg)
    assert [d["backend"] for d in om.report()["layers"]] == ["torch", "fake_fast"]
    assert cfg.model_dump() == before
    nodes = [n for n in om.gm.graph.nodes if "mla_backend" in n.meta]
    assert [n.meta["mla_backend"].backend for n in nodes] == ["torch", "fake_fast"]
