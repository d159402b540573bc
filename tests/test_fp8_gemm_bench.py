"""The FP8 kernel benchmark's own plumbing on the CPU (`--smoke`: tiny shapes, Triton interpreted),
and the FP8 families' shapes it measures staying true to the model configs."""

from __future__ import annotations

import json
import re
from pathlib import Path

from background_runs import BackgroundRuns, written
from benchmarks.kernels import fp8_gemm
from benchmarks.lib import FP8_FAMILIES, linear_shapes, mla_dims

ROOT = Path(__file__).resolve().parents[1]


def _smoke(out: Path) -> dict:
    fp8_gemm.main(["--smoke", "--out", str(out / "all")])
    return written(out / "all")


def _refusing(out: Path) -> dict:
    fp8_gemm.main(["--smoke", "--no-moe", "--no-bf16", "--backends", "scaled_mm,triton", "--out", str(out / "refusing")])
    return written(out / "refusing")


# The two smoke runs (Triton interpreted: ~20 s) in a low-priority background driver from the start of the
# session (tests/background_runs.py), overlapping the tests before this file.
_BACKGROUND = BackgroundRuns(__name__, {"smoke": _smoke, "refusing": _refusing},
                             {"smoke": ["smoke"], "refusing": ["refusing"]})


start_background_runs = _BACKGROUND.select  # conftest.py calls it once the tests are collected
smoke = _BACKGROUND.fixture("smoke")
refusing = _BACKGROUND.fixture("refusing")


def test_smoke_run_writes_every_row_with_a_time_or_a_reason(smoke):
    res = json.loads(smoke["fp8_weights_kernels.json"])
    assert res["peaks"]["fp8_tflops"] > 0 and res["machine"]["command"]
    lin = res["linears"]
    assert {r["phase"] for r in lin} == {"prefill", "decode"}
    assert all(r["us"] is not None or r["note"] for r in lin)
    triton = [r for r in lin if r["backend"] == "triton"]
    assert triton and all(r["rel_err"] < 1e-5 for r in triton)  # fp32 on CPU: the emulation's math
    assert res["moe"] and all(r["rel_err"] < 1e-5 and r["floor_us"] > 0 for r in res["moe"])
    md = smoke["fp8_weights_kernels.md"]
    assert "DeepGEMM" in md and "| tiny | q_b |" in md


def test_a_refusing_backend_is_a_row_with_its_reason(refusing):
    lin = json.loads(refusing["fp8_weights_kernels.json"])["linears"]
    cublas = [r for r in lin if r["backend"] == "scaled_mm"]
    assert cublas and all(r["us"] is None and r["note"].startswith("refused: ") for r in cublas)


def test_family_mla_dims_agree_with_the_model_configs():
    yaml_dims = {}
    for path in (ROOT / "model_configs").glob("*.yaml"):
        m = re.search(r"# mla_dims: N=(\d+) Dn=(\d+) Dr=(\d+) Dv=(\d+) R=(\d+)", path.read_text())
        if m:
            yaml_dims[path.stem] = tuple(map(int, m.groups()))
    same_as = {"deepseek_v3": "deepseek_v3", "deepseek_v32": "deepseek_v32", "glm_4_7_flash": "glm_4_7_flash",
               "glm_5": "glm_5", "mistral_small_4": "mistral_small_4"}
    for fam, yml in same_as.items():
        assert mla_dims(FP8_FAMILIES[fam]) == yaml_dims[yml], fam
    # the YAMLs' notes: Kimi-K2 is V3 with N=64, V2-Lite is V2 with N=16
    assert mla_dims(FP8_FAMILIES["kimi_k2"]) == (64, *yaml_dims["deepseek_v3"][1:])
    assert mla_dims(FP8_FAMILIES["deepseek_v2_lite"]) == (16, *yaml_dims["deepseek_v2"][1:])
    v3 = {s.name: (s.n, s.k) for s in linear_shapes("deepseek_v3", FP8_FAMILIES["deepseek_v3"])}
    assert v3["q_a+kv_a"] == (1536 + 512 + 64, 7168) and v3["o"] == (7168, 16384) and v3["mlp.down"] == (7168, 18432)
