"""The benchmarks' one import surface: every script takes what it needs from here.

    from benchmarks.lib import Case, time_us, optimize

Two kinds of names, both resolved on first use (a `--render` run needs neither CUDA nor Triton):

- helpers the scripts share (timing, the MLA step on a random paged cache, model building and step
  timing, model configs, plots, the HTTP load generator), each in a small module of this package;
- names of `autodeploy_mla`, re-exported from `benchmarks.lib.product`, the only file here that
  knows the package's module paths.

Scripts import nothing else of this repository: not each other, not `autodeploy_mla`, and no
private name (tests/test_benchmarks_layout.py checks all three). They run from the repository root
as modules, `python -m benchmarks.<topic>.<script>`, so no script edits `sys.path`.
"""

from __future__ import annotations

import importlib
from typing import Any

from benchmarks.lib import product

#: helper name -> "benchmarks.lib.<module>[:attribute]" (no attribute: the module itself)
HELPERS: dict[str, str] = {
    **{n: f"benchmarks.lib.timing:{n}" for n in (
        "COPY_TBS", "BF16_TFLOPS", "FLUSH_MODES", "do_bench", "time_us", "host_ms", "graph_time_ms", "median_ms",
        "sync")},
    **{n: f"benchmarks.lib.peaks:{n}" for n in ("measure_peaks", "fp8_peak_tflops", "add_fp8_peak")},
    **{n: f"benchmarks.lib.records:{n}" for n in ("error_line", "command", "machine")},
    "ints": "benchmarks.lib.args:ints",
    **{n: f"benchmarks.lib.mla_case:{n}" for n in (
        "DIMS", "PAGE", "Case", "flashinfer_accepts", "decode_core_triton", "FlashInferDecode")},
    **{n: f"benchmarks.lib.decode_row:{n}" for n in ("bench_decode", "TORCH_DECODE_MAX_TOKENS")},
    **{n: f"benchmarks.lib.model_steps:{n}" for n in (
        "step_stats", "fill_ours", "decode_step", "run_ours", "profile_kernels", "device_events", "time_decode",
        "time_prefill", "time_prefill_stream", "time_decode_stream", "profile_decode", "profile_prefill")},
    **{n: f"benchmarks.lib.model_build:{n}" for n in (
        "MODELS", "build_hf", "VARIANT_PARTS", "POLICY_PARTS", "RUNTIME_PARTS", "variant_policies",
        "variant_transforms", "build_model")},
    **{n: f"benchmarks.lib.shapes:{n}" for n in (
        "deepseek_v3_shaped", "deepseek_v32_shaped", "extra_tokens", "decode_runtime", "v3_4layer", "V2_LITE",
        "GLM_47_FLASH", "DEEPSEEK_V2", "MISTRAL_SMALL_4_119B", "PUBLISHED")},
    **{n: f"benchmarks.lib.fp8_shapes:{n}" for n in (
        "FP8_FAMILIES", "TINY", "LinearShape", "ExpertShape", "linear_shapes", "expert_shape", "mla_dims")},
    "pyplot": "benchmarks.lib.plotting:pyplot",
    "run_load": "benchmarks.lib.loadgen:run_load",
    "pyspy_markdown": "benchmarks.lib.pyspy_summary:markdown",
    "op_host": "benchmarks.lib.op_host",
}

__all__ = sorted([*HELPERS, *product.__all__])


def __getattr__(name: str) -> Any:
    if name in HELPERS:
        module, _, attr = HELPERS[name].partition(":")
        obj = importlib.import_module(module)
        value = getattr(obj, attr) if attr else obj
    elif name in product.__all__:
        value = getattr(product, name)
    else:
        raise AttributeError(f"benchmarks.lib has no {name!r} (the surface is HELPERS and product.__all__)")
    globals()[name] = value
    return value


def __dir__() -> list[str]:
    return __all__
