"""Which GPU test cases are `slow`, and what each GPU test is expected to cost on a fresh H200.

`pytest -m gpu` must finish in one 10-minute device call (issue 43, item 6). Most of a cold run's
time is compilation, not testing: every new (kernel, dims, config) pays a Triton or Gluon compile
(~2-8 s), every new head shape a FlashInfer JIT build (~20-40 s), every Inductor-compiled model tens
of seconds, and the device machine starts with empty caches. So the default run keeps one case per
kernel path and dim family (the others mostly repeat a compile with other numbers) and the cases
that only compile something once elsewhere; the rest are `slow` and run with `--slow`
(`benchmarks/gpu_checks.sh full`).

The marks live here, in one table, rather than on each test: the test files are being re-pointed at
the regrouped kernel layer by another change, and one table also keeps the budget readable.
`SLOW` entries are a test function (`file.py::test`: every case) or fnmatch patterns over node ids
relative to tests/ (`file.py::test[param-id]`, brackets literal);
tests/test_gpu_cases.py keeps every pattern and estimate pointing at a GPU test that exists.

`ESTIMATE_S` is the measured wall time (setup + call + teardown, rounded up) of each GPU test
function's *default* cases on a fresh H200, from `benchmarks/gpu_checks.sh` on 2026-11-29 at 1cbdc93
(its per-test times file, AUTODEPLOY_TEST_TIMES): 69 passed, 0 failed, pytest 486.6 s, `autodeploy
build` 27 s, the whole call 537 s. Correct them from a later run's times file when tests change.
"""

from __future__ import annotations

#: pattern -> why the case(s) are slow
SLOW: dict[str, str] = {
    # Inductor compiles of whole models (tens of seconds each, cold)
    "test_startup.py::test_gpu_inductor_groups_compile_at_most_twice_and_requests_pay_no_capture":
        "compiles every Inductor group of a model twice over (~110 s)",
    "test_real_rope.py::test_gpu_v2_rewritten_under_inductor_matches_hf_bf16": "Inductor on a V2 model (~60 s)",
    "test_piecewise.py::test_gpu_inductor_compiled_pieces_replay_correctly": "Inductor on every static piece (~60 s)",
    "test_server.py::test_gpu_server_concurrent_streams": "model build + HTTP server + 16 clients (~30 s)",
    # per-layer kernels: one case per path and dim family stays in the default run
    "test_triton_mla.py::test_gpu_real_dims_bf16[*-expand]": "forced modes repeat the auto cases' compiles per dims",
    "test_triton_mla.py::test_gpu_real_dims_bf16[*-absorb]": "forced modes repeat the auto cases' compiles per dims",
    "test_triton_mla.py::test_gpu_decode_layouts[*-heads_on_m]": "heads_on_m is what auto runs (test_gpu_real_dims_bf16)",
    "test_triton_mla.py::test_gpu_decode_layouts[mistral_small_4-*]": "one R 256 family is enough by default",
    "test_triton_mla.py::test_gpu_decode_layouts[minicpm3-*]": "one R 256 family is enough by default",
    "test_triton_mla.py::test_gpu_decode_layouts[glm_4_7_flash-*]": "N 16 and N 128 cover the layouts",
    "test_triton_mla.py::test_gpu_multi_token_decode[mistral_small_4-*]": "N 16 and N 128 cover the kernel",
    "test_triton_mla.py::test_gpu_multi_token_decode[minicpm3-*]": "N 16 and N 128 cover the kernel",
    "test_triton_mla.py::test_gpu_multi_token_decode[glm_4_7_flash-*]": "N 16 and N 128 cover the kernel",
    "test_triton_mla.py::test_gpu_multi_token_decode[deepseek_v3_tp8_n16-heads_on_m]": "one layout per N by default",
    "test_triton_mla.py::test_gpu_multi_token_decode[deepseek_v3_n128-heads_on_n]": "one layout per N by default",
    "test_triton_mla.py::test_gpu_decode_kernels[*-triton]": "forced kernels; auto runs the chosen one per dims",
    "test_triton_mla.py::test_gpu_decode_kernels[*-gluon]": "forced kernels; auto runs the chosen one per dims",
    "test_triton_mla.py::test_gpu_fa3_prefill[deepseek_v3_n128-*]": "a FlashInfer FA3 JIT build per head shape",
    "test_triton_mla.py::test_gpu_fa3_prefill[glm_4_7_flash-*]": "a FlashInfer FA3 JIT build per head shape",
    "test_triton_mla.py::test_gpu_fa3_prefill[deepseek_v3_tp8_n16-False]": "the Triton path is covered by real-dims cases",
    "test_gluon_decode.py::test_gpu_gluon_decode_matches_oracle[*-1-*]": "batch 3 keeps the multi-sequence path",
    "test_gluon_decode.py::test_gpu_gluon_decode_matches_oracle[*-8-*]": "batch 3 keeps the multi-sequence path",
    "test_gluon_decode.py::test_gpu_gluon_decode_matches_oracle[glm_4_7_flash_n20-3-other]": "one 'other' config",
    "test_gluon_decode.py::test_gpu_gluon_decode_matches_oracle[mistral_small_4_n32-3-other]": "one 'other' config",
    "test_gluon_decode.py::test_gpu_gluon_wide_matches_oracle[*-1]": "batch 3 per width by default",
    "test_gluon_decode.py::test_gpu_gluon_wide_matches_oracle[*-8]": "batch 3 per width by default",
    "test_flashinfer_backends.py::test_gpu_fa_scenarios[single_prefill-*]": "ragged / chunked prefill cover it",
    "test_flashinfer_backends.py::test_gpu_fa_scenarios[ragged_prefill-ds_n128]": "N 16 per scenario by default",
    "test_flashinfer_backends.py::test_gpu_fa_scenarios[ragged_prefill-n40]": "N 16 per scenario by default",
    "test_flashinfer_backends.py::test_gpu_fa_scenarios[prefill_then_decode-*]": "mixed and long_decode cover it",
    "test_flashinfer_backends.py::test_gpu_fa_scenarios[chunked_prefill_3-n40]": "N 16 / 128 chunked by default",
    "test_flashinfer_backends.py::test_gpu_fa_scenarios[long_decode-ds_n128]": "N 16 long decode by default",
    "test_flashinfer_backends.py::test_gpu_fa_scenarios[long_decode-n40]": "N 16 long decode by default",
    # FP8 cache
    "test_fp8_cache.py::test_gpu_flashinfer_fp8[prefill_then_decode-*]": "an FP8 FlashInfer JIT per head shape; mixed covers",
    "test_fp8_cache.py::test_gpu_flashinfer_fp8[long_decode-*]": "an FP8 FlashInfer JIT per head shape; mixed covers",
    "test_fp8_cache.py::test_gpu_flashinfer_fp8[mixed-n128]": "an FP8 FlashInfer JIT per head shape",
    "test_fp8_cache.py::test_gpu_flashinfer_fp8[mixed-dr0]": "an FP8 FlashInfer JIT per head shape",
    "test_fp8_cache.py::test_gpu_triton_fp8[chunked_prefill_3-*]": "mixed covers prefill over a prefix",
    "test_fp8_cache.py::test_gpu_triton_fp8[long_decode-deepseek]": "one long decode (nope) by default",
    "test_fp8_cache.py::test_gpu_triton_fp8[long_decode-glm]": "one long decode (nope) by default",
    "test_fp8_cache.py::test_gpu_triton_fp8[long_decode-minicpm3]": "one long decode (nope) by default",
    # static-bounds (mixed graph) steps
    "test_triton_mixed_graph.py::test_gpu_static_bounds_steps_on_real_dims[heads_on_m-*]": "auto layout per dims kept",
    "test_triton_mixed_graph.py::test_gpu_static_bounds_steps_on_real_dims[auto-minicpm3]": "three dim families by default",
    "test_triton_mixed_graph.py::test_gpu_static_bounds_steps_on_real_dims[auto-mistral_small_4]": "three families by default",
    "test_triton_mixed_graph.py::test_gpu_static_bounds_with_an_fp8_cache_on_real_dims[deepseek_*]": "GLM kept (Dn != Dv)",
    # MoE and routing
    "test_fuse_routing.py::test_gpu_kernel_equals_the_reference[*-dtype0]": "fp32 logits; bf16 per router kept",
    "test_fuse_routing.py::test_gpu_gate_route_equals_the_reference[*-dtype1]": "fp16; bf16 kept",
    "test_fuse_routing.py::test_gpu_gate_route_equals_the_reference[3-*]": "routers 0 and 4 by default",
    "test_fuse_moe.py::test_gpu_bf16_against_fp32[5]": "1, 64 and 2048 tokens cover the paths",
    "test_fuse_moe.py::test_gpu_bf16_against_fp32[700]": "1, 64 and 2048 tokens cover the paths",
    "test_fuse_moe.py::test_gpu_model_fused_and_graph_replayed_matches_hf_bf16[deepseek_v2]": "GLM kept (shared expert)",
    # whole-model runtime tests
    "test_engine.py::test_gpu_overlapped_engine_with_cuda_graphs[torch]": "auto kept; one model build per backend",
    "test_engine.py::test_gpu_overlapped_engine_with_cuda_graphs[triton]": "auto kept; one model build per backend",
    "test_piecewise.py::test_gpu_queued_prefill_steps_never_wait_for_the_device[*-1100]": "FA3 JIT for the tiny heads",
    "test_piecewise.py::test_gpu_cuda_graph_replay_matches_eager[triton-off]": "triton-auto and torch-auto kept",
    "test_two_models.py::test_gpu_two_models_interleaved[triton]": "FlashInfer kept (the session bug was there)",
    "test_sparse_attention.py::test_gpu_sparse_triton[glm_5]": "deepseek_v32 kept; two model builds each",
    "test_sparse_attention.py::test_gpu_sparse_flashinfer_model": "the sparse ops test covers FlashInfer's ops",
    "test_sparse_attention.py::test_gpu_flashinfer_sparse_ops_equal_the_reference[False]": "graph=True kept",
    "test_fp8_cache.py::test_gpu_fp8_model_with_cuda_graphs": "two model builds per backend; the FP8 kernels and the static-bounds FP8 case stay",
    "test_triton_mla.py::test_gpu_long_decode_split_k[1]": "7 splits kept",
    "test_triton_mla.py::test_gpu_real_dims_bf16[minicpm3-auto]": "MiniCPM3 dims run in the FP8 mixed case by default",
    "test_piecewise.py::test_gpu_queued_prefill_steps_never_wait_for_the_device[triton-300]": "flashinfer_mla-300 kept",
    "test_triton_mixed_graph.py::test_gpu_static_bounds_steps_on_real_dims[auto-deepseek_v3_tp8_n16]": "N 128 and GLM kept",
    "test_gluon_decode.py::test_gpu_gluon_wide_matches_oracle[64-*]": "N 128 kept",
    "test_fuse_moe.py::test_gpu_bf16_against_fp32[1]": "64 and 2048 tokens cover the paths",
    "test_flashinfer_backends.py::test_gpu_fa_scenarios[mixed-n40]": "N 16 / 128 mixed by default",
    "test_sampling.py::test_gpu_sampler_matches_the_cpu_sampler[T0.5-k0-p1.0]": "three sampler settings by default",
    "test_sampling.py::test_gpu_sampler_matches_the_cpu_sampler[T1.5-k7-p1.0]": "three sampler settings by default",
    "test_sampling.py::test_gpu_sampler_matches_the_cpu_sampler[T1.0-k0-p0.7]": "three sampler settings by default",
    # block-FP8 kernels (issue 44): cuBLAS on DeepSeek-V3 by default; every family and backend with --slow
    "test_fp8_kernels_gpu.py::test_gpu_linear_backends_match_the_emulation[*-triton]":
        "a Triton compile per tile config; ~60 s over the seven families",
    "test_fp8_kernels_gpu.py::test_gpu_linear_backends_match_the_emulation[*-cublas_triton]":
        "its halves are the triton and scaled_mm cases (T 1 / 64 Triton, T 2048 cuBLAS)",
    "test_fp8_kernels_gpu.py::test_gpu_linear_backends_match_the_emulation[*-flashinfer]":
        "FlashInfer's SM90 block-scale GEMM may JIT-build on first use (minutes cold)",
    "test_fp8_kernels_gpu.py::test_gpu_linear_backends_match_the_emulation[kimi_k2-scaled_mm]": "V3 kept",
    "test_fp8_kernels_gpu.py::test_gpu_linear_backends_match_the_emulation[deepseek_v32-scaled_mm]": "V3 kept",
    "test_fp8_kernels_gpu.py::test_gpu_linear_backends_match_the_emulation[glm_4_7_flash-scaled_mm]": "V3 kept",
    "test_fp8_kernels_gpu.py::test_gpu_linear_backends_match_the_emulation[glm_5-scaled_mm]": "V3 kept",
    "test_fp8_kernels_gpu.py::test_gpu_linear_backends_match_the_emulation[mistral_small_4-scaled_mm]": "V3 kept",
    "test_fp8_kernels_gpu.py::test_gpu_linear_backends_match_the_emulation[deepseek_v2_lite-scaled_mm]": "V3 kept",
    "test_fp8_kernels_gpu.py::test_gpu_moe_fp8_matches_the_emulation": "full-size FP8 expert stacks (up to 17 GB) per family",
    "test_fp8_kernels_gpu.py::test_gpu_fp8_ops_replay_in_cuda_graphs": "Triton compiles of both ops",
    "test_fp8_kernels_gpu.py::test_gpu_moe_fp8_sorted_path_matches_the_gathered_path":
        "full-size FP8 expert stacks per family; the opt-in path's check before the sweep (run with --slow -k sorted)",
}

#: test function (file::name) -> expected seconds of its default cases on a fresh H200
ESTIMATE_S: dict[str, int] = {
    "test_triton_mla.py::test_gpu_real_dims_bf16": 23,
    "test_triton_mla.py::test_gpu_decode_layouts": 9,
    "test_triton_mla.py::test_gpu_multi_token_decode": 9,
    "test_triton_mla.py::test_gpu_decode_kernels": 11,
    "test_triton_mla.py::test_gpu_fa3_prefill": 1,
    "test_triton_mla.py::test_gpu_long_decode_split_k": 3,
    "test_triton_mla.py::test_cuda_graph_decode_replays_as_sequences_grow": 5,
    "test_gluon_decode.py::test_gpu_gluon_decode_matches_oracle": 6,
    "test_gluon_decode.py::test_gpu_gluon_wide_matches_oracle": 4,
    "test_flashinfer_backends.py::test_gpu_fa_scenarios": 17,
    "test_flashinfer_backends.py::test_gpu_opcheck": 1,
    "test_flashinfer_backends.py::test_gpu_prefill_routed_to_triton_by_default": 2,
    "test_flashinfer_backends.py::test_gpu_fa_untileable_heads_fall_back_to_triton": 10,
    "test_flashinfer_backends.py::test_gpu_fa_long_chunked_prefill_and_mixed": 1,
    "test_flashinfer_backends.py::test_gpu_fa_captured_decode_graph_replays_after_growth": 1,
    "test_fp8_cache.py::test_gpu_flashinfer_fp8": 21,
    "test_fp8_cache.py::test_gpu_triton_fp8": 49,
    "test_fp8_cache.py::test_gpu_fp8_model_with_cuda_graphs": 0,
    "test_triton_mixed_graph.py::test_gpu_static_bounds_steps_on_real_dims": 10,
    "test_triton_mixed_graph.py::test_gpu_static_bounds_with_an_fp8_cache_on_real_dims": 16,
    "test_fuse_routing.py::test_gpu_kernel_equals_the_reference": 7,
    "test_fuse_routing.py::test_gpu_gate_route_equals_the_reference": 3,
    "test_fuse_routing.py::test_gpu_model_with_fused_routing_matches_the_model_routing": 16,
    "test_fuse_moe.py::test_gpu_bf16_against_fp32": 5,
    "test_fuse_moe.py::test_gpu_model_fused_and_graph_replayed_matches_hf_bf16": 15,
    "test_fuse_gemms.py::test_gpu_fused_gemms_match_hf_bf16_through_cuda_graphs": 24,
    "test_piecewise.py::test_gpu_cuda_graph_replay_matches_eager": 26,
    "test_piecewise.py::test_gpu_queued_prefill_steps_never_wait_for_the_device": 28,
    "test_piecewise.py::test_gpu_unseen_bucket_runs_eagerly": 7,
    "test_piecewise.py::test_gpu_capture_failure_falls_back_to_eager_and_generation_is_unchanged": 10,
    "test_engine.py::test_gpu_overlapped_engine_with_cuda_graphs": 42,
    "test_sampling.py::test_gpu_sampler_matches_the_cpu_sampler": 2,
    "test_sampling_features.py::test_gpu_sampler_matches_the_cpu_sampler_with_every_feature": 1,
    "test_triton_lean_path.py::test_gpu_direct_launches_equal_jit_launches": 2,
    "test_two_models.py::test_gpu_two_models_interleaved": 51,
    "test_sparse_attention.py::test_gpu_sparse_triton": 51,
    "test_sparse_attention.py::test_gpu_flashinfer_sparse_ops_equal_the_reference": 1,
    "test_fp8_kernels_gpu.py::test_gpu_act_quant_matches_the_reference": 1,
    "test_fp8_kernels_gpu.py::test_gpu_linear_backends_match_the_emulation": 1,
    # every case slow (SLOW names them)
    "test_startup.py::test_gpu_inductor_groups_compile_at_most_twice_and_requests_pay_no_capture": 0,
    "test_real_rope.py::test_gpu_v2_rewritten_under_inductor_matches_hf_bf16": 0,
    "test_piecewise.py::test_gpu_inductor_compiled_pieces_replay_correctly": 0,
    "test_server.py::test_gpu_server_concurrent_streams": 0,
    "test_sparse_attention.py::test_gpu_sparse_flashinfer_model": 0,
    "test_fp8_kernels_gpu.py::test_gpu_moe_fp8_matches_the_emulation": 0,
    "test_fp8_kernels_gpu.py::test_gpu_fp8_ops_replay_in_cuda_graphs": 0,
    "test_fp8_kernels_gpu.py::test_gpu_moe_fp8_sorted_path_matches_the_gathered_path": 0,
    # 2-GPU tests: skipped on one GPU (`gpu_checks.sh tp` runs them on two: 93-269 s)
    "test_tensor_parallel.py::test_gpu_two_ranks_nccl_bf16": 0,
    "test_tensor_parallel.py::test_gpu_one_shot_all_reduce_op": 0,
    "test_tensor_parallel.py::test_gpu_cli_world_size_2": 0,
}

#: the default run's budget: one 10-minute device call (600 s) less the call's start and wheel install
#: (~20 s), collection (~15 s), `autodeploy build` (27 s measured) and a margin of ~40 s
DEFAULT_BUDGET_S = 500
