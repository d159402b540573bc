"""Background compiles of FlashInfer's JIT modules (custom_ops/flashinfer/jit.py), on CPU with a fake
`flashinfer.jit`: the module arguments are the ones FlashInfer's wrappers plan with, builds run in
their own threads and report their time and errors, and nothing is started where nothing can run."""

from __future__ import annotations

import threading
import types

import pytest
import torch

from autodeploy_mla.custom_ops.flashinfer import jit as fj
from autodeploy_mla.custom_ops.attention.mla_dims import MLADims


class _Spec:
    def __init__(self, log, name, args, gate):
        self.log, self.name, self.args, self.gate = log, name, args, gate

    def build(self, need_lock=False):
        assert need_lock  # FlashInfer's file lock: a wrapper planning the same module waits for it
        self.gate.wait(10)
        if self.name == "prefill" and self.args[5] == 96:
            raise RuntimeError("nvcc failed")
        self.log.append((self.name, self.args))


@pytest.fixture
def fake_jit(monkeypatch):
    log, gate = [], threading.Event()
    jit = types.SimpleNamespace(
        gen_batch_mla_module=lambda *a: _Spec(log, "mla", a, gate),
        gen_batch_prefill_module=lambda *a: _Spec(log, "prefill", a, gate),
    )
    monkeypatch.setattr(fj, "_flashinfer_jit", lambda: jit)
    return log, gate


def test_module_arguments_match_the_wrappers_plans(fake_jit):
    log, gate = fake_jit
    d = MLADims(16, 128, 64, 128, 512)
    builds = [fj.mla_module("fa3", d, torch.bfloat16, torch.bfloat16).start(),
              fj.fa3_prefill_module(192, 128, torch.bfloat16).start()]
    assert not any(b.done() for b in builds)  # compiling in the background
    gate.set()
    assert all(b.wait(10) for b in builds)
    assert ("mla", ("fa3", torch.bfloat16, torch.bfloat16, torch.bfloat16, torch.int32, 512, 64, False)) in log
    assert ("prefill", ("fa3", torch.bfloat16, torch.bfloat16, torch.bfloat16, torch.int32, 192, 128, 0, False, False,
                        False)) in log
    assert all(b.seconds is not None and b.to_dict()["done"] for b in builds)


def test_a_failed_build_is_reported_not_raised(fake_jit):
    _, gate = fake_jit
    gate.set()
    b = fj.fa3_prefill_module(96, 64, torch.bfloat16).start()
    assert not b.wait(10) and b.done() and "nvcc failed" in b.error


def test_prefetch_starts_nothing_where_nothing_runs(fake_jit):
    d = MLADims(16, 128, 64, 128, 512)
    assert fj.prefetch(d, torch.bfloat16, torch.bfloat16, torch.device("cpu")) == []
    assert fj.prefetch(d, torch.float32, torch.float32, torch.device("cuda")) == []
    assert fj.prefetch(d, torch.bfloat16, torch.float8_e4m3fn, torch.device("cuda")) == []


def test_dims_from_hf_configs():
    from autodeploy_mla.testing.tiny_configs import TINY_CONFIGS
    from transformers import AutoConfig

    for family, hf in TINY_CONFIGS.items():
        cfg = AutoConfig.for_model(**hf)
        d = fj.dims_from_hf_config(cfg)
        assert d is not None, family
        assert (d.num_heads, d.kv_lora_rank) == (cfg.num_attention_heads, cfg.kv_lora_rank)
    assert fj.dims_from_hf_config(types.SimpleNamespace(num_attention_heads=8)) is None
