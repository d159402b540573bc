"""Two optimized models in one process, generate calls interleaved, for every backend.

Backend state belongs to the model (a session per backend per model), so building a second model
with other MLA dims and another page size must not change a single token of the first, and the two
engines may step in turn. Before sessions, a second `optimize()` reset FlashInfer's per-process
state: the first model's FlashInfer layers then failed (other dims) or planned with the second
model's page size (same dims). Each model's interleaved tokens are compared with the tokens it
produced alone, before the other model existed; fp32 backends also with the eager HF model.

CPU: torch, triton (interpreted), and both FlashInfer backends on the contract-enforcing fake
FlashInfer (an emulated SM90 / SM100 with tensors on the CPU, bf16). GPU (marked): real FlashInfer
and Triton on CUDA.
"""

from __future__ import annotations

import copy

import pytest
import torch

from autodeploy_mla import optimize
from autodeploy_mla.custom_ops.flashinfer.mla import FlashInferPolicy
from autodeploy_mla.custom_ops.flashinfer.trtllm_mla import TrtllmPolicy
from autodeploy_mla.runtime.sampling import SamplingParams
from autodeploy_mla.testing import hf_greedy_generate
from autodeploy_mla.testing.fake_flashinfer import install_fake_flashinfer
from autodeploy_mla.testing.tiny_configs import TINY_CONFIGS

PROMPTS_A = [[5, 6, 7, 8, 9, 10, 11], [3, 4], [200, 17, 9, 1, 1, 2, 90, 91, 92, 93, 94, 95, 96, 97, 98]]
PROMPTS_B = [[42, 43], [9, 8, 7, 6, 5, 4, 3, 2, 1, 11, 12, 13], [100]]
NEW = 5


def _hf(n: int, dn: int, dr: int, dv: int, r: int) -> dict:
    cfg = copy.deepcopy(TINY_CONFIGS["deepseek_v3"])
    cfg.update(num_attention_heads=n, num_key_value_heads=n, qk_nope_head_dim=dn, qk_rope_head_dim=dr,
               v_head_dim=dv, kv_lora_rank=r)
    return cfg


# (backend, dtype, model A (dims, page size), model B): dims the backend's capability facts accept.
CASES = {
    "torch": ("float32", (_hf(4, 24, 16, 20, 40), 4), (_hf(6, 16, 8, 12, 48), 8)),
    "triton": ("float32", (_hf(4, 24, 16, 20, 40), 4), (_hf(6, 16, 8, 12, 48), 8)),
    "flashinfer_mla": ("bfloat16", (_hf(4, 32, 64, 32, 128), 16), (_hf(8, 16, 64, 24, 256), 32)),
    "flashinfer_trtllm_mla": ("bfloat16", (_hf(4, 32, 64, 32, 256), 32), (_hf(8, 16, 64, 24, 512), 64)),
}
# Steps with prefill tokens go to the torch reference on the fake (Triton would run interpreted).
POLICIES = {"flashinfer_mla": FlashInferPolicy(fallback_order=("torch",)),
            "flashinfer_trtllm_mla": TrtllmPolicy(fallback_order=("torch",))}


def _build(backend: str, dtype: str, hf: dict, page_size: int, device: str = "cpu", **policies):
    transforms = {"insert_cached_mla_attention": {"backend": backend}}
    if device == "cpu" and backend.startswith("flashinfer"):
        # The fake emulates a GPU with tensors on the CPU: fuse_moe's `auto` would put the MoE layer on
        # the Triton kernels, run interpreted (four fifths of these tests' time). The experts are not
        # what this file tests (test_fuse_moe does): the dense reference op, as for prefill above.
        transforms["fuse_moe"] = {"backend": "torch"}
    return optimize(None, {
        "model": {"hf_config": hf, "device": device, "dtype": dtype},
        "runtime": {"max_batch_size": 3, "max_seq_len": 48, "max_num_tokens": 12, "page_size": page_size},
        "transforms": transforms,
    }, backend_policies=policies or None)


def _interleaved(a, b, prompts_a, prompts_b, n):
    """Both engines step in turn (A, B, A, B, ...) until both are done; tokens per prompt."""
    params = SamplingParams(max_new_tokens=n, ignore_eos=True)
    ea, eb = a.engine(), b.engine()
    ids_a = [ea.add_request(p, params) for p in prompts_a]
    ids_b = [eb.add_request(p, params) for p in prompts_b]
    while ea.has_work() or eb.has_work():
        if ea.has_work():
            ea.step()
        if eb.has_work():
            eb.step()
    return [ea.done[i].generated for i in ids_a], [eb.done[i].generated for i in ids_b]


def _check_two_models(backend, dtype, case_a, case_b, device="cpu", policies=None, whole_calls=True):
    policies = policies or {}
    a = _build(backend, dtype, *case_a, device=device, **policies)
    solo_a = a.generate(PROMPTS_A, max_new_tokens=NEW, ignore_eos=True)
    b = _build(backend, dtype, *case_b, device=device, **policies)  # other dims, other page size
    solo_b = b.generate(PROMPTS_B, max_new_tokens=NEW, ignore_eos=True)

    # The models' sessions are their own: different objects, each with its model's page size and dims.
    sa, sb = a.runner.sessions[backend], b.runner.sessions[backend]
    assert sa is not sb
    assert (sa.spec.page_size, sb.spec.page_size) == (case_a[1], case_b[1])
    assert {d.kv_lora_rank for d in sa.spec.dims} == {case_a[0]["kv_lora_rank"]}
    assert {d.kv_lora_rank for d in sb.spec.dims} == {case_b[0]["kv_lora_rank"]}

    # Whole generate calls interleaved, then engines stepping in turn: nothing changes.
    if whole_calls:
        assert a.generate(PROMPTS_A, max_new_tokens=NEW, ignore_eos=True) == solo_a
        assert b.generate(PROMPTS_B, max_new_tokens=NEW, ignore_eos=True) == solo_b
        assert a.generate(PROMPTS_A[:1], max_new_tokens=NEW, ignore_eos=True) == solo_a[:1]
    got_a, got_b = _interleaved(a, b, PROMPTS_A, PROMPTS_B, NEW)
    assert got_a == solo_a and got_b == solo_b
    for om in (a, b):
        assert om.allocator.num_free == om.allocator.num_usable
    if dtype == "float32":  # the oracle: greedy tokens identical to the eager HF model
        for om, prompts, solo in ((a, PROMPTS_A, solo_a), (b, PROMPTS_B, solo_b)):
            assert solo == [hf_greedy_generate(om.eager_model, p, NEW, ignore_eos=True) for p in prompts]
    return a, b


@pytest.mark.parametrize("backend", list(CASES))
def test_two_models_interleaved(backend, monkeypatch):
    dtype, case_a, case_b = CASES[backend]
    if backend.startswith("flashinfer"):
        install_fake_flashinfer(monkeypatch, "0.7.2", (10, 0) if "trtllm" in backend else (9, 0))
    # Triton runs interpreted on the CPU: the step-interleaved engines alone (the stronger check).
    a, b = _check_two_models(backend, dtype, case_a, case_b, whole_calls=backend != "triton",
                             policies={backend: POLICIES[backend]} if backend in POLICIES else None)
    if backend == "flashinfer_mla":  # every step of each model was planned by its own session
        assert a.runner.sessions[backend].plans > 0 and b.runner.sessions[backend].plans > 0
    if backend == "flashinfer_trtllm_mla":
        assert a.runner.sessions[backend].decode_steps > 0 and b.runner.sessions[backend].decode_steps > 0


# ----------------------------------------------------------------------------- GPU
GPU_CASES = {
    # real FlashInfer (fa3 on SM90, 0.7.x): (512, 64) and (256, 64), page 64 and 32
    "flashinfer_mla": ("bfloat16", (_hf(16, 32, 64, 32, 512), 64), (_hf(8, 16, 64, 24, 256), 32)),
    "triton": ("bfloat16", (_hf(16, 32, 64, 32, 512), 64), (_hf(6, 16, 32, 12, 48), 16)),
}


@pytest.mark.gpu
@pytest.mark.parametrize("backend", list(GPU_CASES))
def test_gpu_two_models_interleaved(backend):
    from autodeploy_mla.custom_ops import Target, get_backend
    from autodeploy_mla.custom_ops.attention.mla_dims import MLADims

    dtype, case_a, case_b = GPU_CASES[backend]
    for hf, ps in (case_a, case_b):
        dims = MLADims(hf["num_attention_heads"], hf["qk_nope_head_dim"], hf["qk_rope_head_dim"], hf["v_head_dim"],
                       hf["kv_lora_rank"])
        res = get_backend(backend).check(dims, torch.bfloat16, Target.detect("cuda", ps))
        if not res.ok:
            pytest.skip(f"{backend} cannot serve {dims.short()} here: {res.reason}")
    _check_two_models(backend, dtype, case_a, case_b, device="cuda")
