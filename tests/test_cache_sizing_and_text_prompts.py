"""Cache sizing (explicit pages, CPU default, fraction of free GPU memory) and text prompts through a
checkpoint's own tokenizer."""

import json

import pytest
import torch

from autodeploy_mla.cli import main
from autodeploy_mla.config import load_config
from autodeploy_mla.custom_ops.attention.registry import CacheSpec
from autodeploy_mla.config import model_config_path
from autodeploy_mla.models.factory import build_model
from autodeploy_mla.runtime import CapacityError
from autodeploy_mla.runtime.kv_cache import CacheLayout, page_bytes, plan_num_pages

LAYOUTS = [CacheLayout(f"mla_cache_{i}", f"L{i}", CacheSpec(576, torch.bfloat16)) for i in range(3)]


def test_page_bytes():
    assert page_bytes(LAYOUTS, 64) == 3 * 64 * 576 * 2  # (R + Dr) * 2 bytes per token per layer


def test_explicit_pages_and_cpu_default():
    assert plan_num_pages(LAYOUTS, 64, 8, 512, torch.device("cpu"), 100, 0.9) == 100
    assert plan_num_pages(LAYOUTS, 64, 8, 512, torch.device("cpu"), None, 0.9) == 1 + 8 * 8


def test_fraction_of_free_gpu_memory(monkeypatch):
    per_page = page_bytes(LAYOUTS, 64)
    monkeypatch.setattr(torch.cuda, "mem_get_info", lambda device=None: (40 * per_page, 80 * per_page))
    assert plan_num_pages(LAYOUTS, 64, 8, 512, torch.device("cuda"), None, 0.5) == 20  # 50% of free
    assert plan_num_pages(LAYOUTS, 64, 2, 128, torch.device("cuda"), None, 1.0) == 1 + 2 * 2  # capped: full batches
    monkeypatch.setattr(torch.cuda, "mem_get_info", lambda device=None: (per_page, 80 * per_page))
    with pytest.raises(CapacityError, match="holds 0 cache pages"):
        plan_num_pages(LAYOUTS, 64, 8, 512, torch.device("cuda"), None, 0.5)


def _word_tokenizer(vocab_size: int):
    from tokenizers import Tokenizer, models, pre_tokenizers
    from transformers import PreTrainedTokenizerFast

    words = ["[UNK]", "the", "latent", "cache", "is", "paged", "and", "attention", "absorbs", "weights"]
    vocab = {w: i for i, w in enumerate(words)}
    tok = Tokenizer(models.WordLevel(vocab, unk_token="[UNK]"))
    tok.pre_tokenizer = pre_tokenizers.Whitespace()
    assert len(vocab) <= vocab_size
    return PreTrainedTokenizerFast(tokenizer_object=tok, unk_token="[UNK]")


def test_cli_text_prompt_uses_the_checkpoint_tokenizer(tmp_path, capsys):
    cfg = load_config(model_config_path("deepseek_v2"), overrides=["model.device=cpu", "model.dtype=float32"])
    model = build_model(cfg.model, torch.device("cpu"), torch.float32)
    ckpt = tmp_path / "ckpt"
    model.save_pretrained(ckpt)
    _word_tokenizer(model.config.vocab_size).save_pretrained(ckpt)
    report = tmp_path / "r.json"
    rc = main(["build", "--model", str(ckpt), "--config", str(model_config_path("deepseek_v2")),
               "--prompt", "the latent cache is paged", "--prompt", "attention absorbs weights",
               "--max-new-tokens", "3", "--set", "runtime.page_size=4", "--report", str(report)])
    assert rc == 0, capsys.readouterr().out
    rep = json.loads(report.read_text())
    assert [p["prompt_len"] for p in rep["verification"]["prompts"]] == [5, 3]
    assert rep["verification"]["ok"]


def test_cli_text_prompt_without_tokenizer_is_explained(capsys):
    assert main(["build", "--prompt", "hello"]) == 2
    assert "needs a checkpoint with a tokenizer" in capsys.readouterr().out
