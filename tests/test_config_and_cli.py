"""Config layering and errors, checkpoint loading, refusal of non-MLA models, and the CLI."""

import json

import pytest
import torch
import torch.nn.functional as F
from torch import nn

from autodeploy_mla import optimize
from autodeploy_mla.api import build_config
from autodeploy_mla.cli import main
from autodeploy_mla.config import ConfigError, deep_merge, load_config, parse_set_overrides
from autodeploy_mla.config import model_config_path
from autodeploy_mla.models.factory import build_model
from autodeploy_mla.testing import hf_greedy_generate

SMALL = ["runtime.max_num_tokens=8", "runtime.page_size=4", "runtime.max_seq_len=48", "model.device=cpu",
         "model.dtype=float32"]


def test_layering_order_and_no_mutation():
    user = {"runtime": {"page_size": 32}, "transforms": {"insert_cached_mla_attention": {"backend": "torch"}}}
    snapshot = json.dumps(user, sort_keys=True)
    cfg = load_config(model_config_path("deepseek_v2"), user, overrides=["runtime.page_size=16"])
    assert json.dumps(user, sort_keys=True) == snapshot
    assert cfg.runtime.page_size == 16  # --set wins over the user YAML
    assert cfg.model.hf_config["model_type"] == "deepseek_v2"  # from the model YAML
    assert list(cfg.transforms)[:10] == ["export", "match_mla", "shard", "load_weights", "fuse_gemms", "fuse_moe",
                                         "fuse_routing", "real_rope", "resolve_fp8_linear", "insert_cached_mla_attention"]
    assert cfg.transforms["insert_cached_mla_attention"]["backend"] == "torch"
    assert cfg.transforms["insert_cached_mla_attention"]["preference"]["cpu"] == ["torch"]  # deep-merged


def test_deep_merge_and_set_parsing():
    assert deep_merge({"a": {"b": 1, "c": 2}}, {"a": {"c": 3}}) == {"a": {"b": 1, "c": 3}}
    assert parse_set_overrides(["a.b=3", "a.c=true", "d=[1, 2]"]) == {"a": {"b": 3, "c": True}, "d": [1, 2]}
    with pytest.raises(ConfigError, match="KEY.PATH=VALUE"):
        parse_set_overrides(["novalue"])


@pytest.mark.parametrize(
    "override, message",
    [
        ("runtime.page_sise=4", "unknown key; valid keys: max_batch_size, max_seq_len"),
        ("bogus=1", "unknown key; valid keys: model, runtime, transforms"),
        ("transforms.fuse_everything.enabled=true",
         "valid transforms: export, fuse_gemms, fuse_moe, fuse_routing, gather_logits, insert_cached_mla_attention, "
         "load_weights, match_mla, piecewise, real_rope"),
        ("transforms.insert_cached_mla_attention.backend=flashmla", "unknown backend 'flashmla'; valid: auto"),
        ("transforms.insert_cached_mla_attention.colour=red", "valid options: enabled, backend"),
        ("runtime.max_batch_size=0", "greater than or equal to 1"),
        ("model.dtype=int8", "model.dtype"),
    ],
)
def test_config_errors_list_valid_choices(override, message):
    with pytest.raises(ConfigError, match=message.replace("(", r"\(").replace("[", r"\[")):
        build_config(overrides=[override])  # the schema, then every pass's options


def test_explicit_backend_that_cannot_serve_is_an_error(monkeypatch):
    from autodeploy_mla.custom_ops.attention import registry as br
    from autodeploy_mla.custom_ops.torch_backend import TorchMLABackend

    monkeypatch.setattr(TorchMLABackend, "check", lambda self, *a: br.CheckResult(False, "mocked: refuses"))
    with pytest.raises(ValueError, match="backend 'torch' cannot serve.*mocked: refuses"):
        optimize("default", overrides=SMALL + ["transforms.insert_cached_mla_attention.backend=torch"])


def test_checkpoint_directory_round_trip(tmp_path):
    cfg = load_config(model_config_path("deepseek_v3"), overrides=SMALL)
    model = build_model(cfg.model, torch.device("cpu"), torch.float32)
    model.save_pretrained(tmp_path / "ckpt")  # config.json + model.safetensors
    assert (tmp_path / "ckpt" / "model.safetensors").is_file()
    om = optimize(str(tmp_path / "ckpt"), overrides=SMALL)
    assert om.config.model.path is not None
    prompt = [5, 9, 200, 17, 3, 3, 8, 1, 90, 2]
    assert om.generate([prompt], max_new_tokens=5)[0] == hf_greedy_generate(model, prompt, 5)
    with pytest.raises(ConfigError, match="config.json"):
        optimize(str(tmp_path), overrides=SMALL)


class _PlainAttentionLM(nn.Module):
    """A causal LM whose attention is ordinary MHA: nothing to rewrite into MLA."""

    def __init__(self):
        super().__init__()
        self.emb, self.qkv, self.out = nn.Embedding(50, 32), nn.Linear(32, 96), nn.Linear(32, 50)
        self.config = type("C", (), {"vocab_size": 50})()

    def forward(self, input_ids, position_ids=None, use_cache=False):
        x = self.emb(input_ids)
        q, k, v = self.qkv(x).view(*x.shape[:2], 3, 4, 8).permute(2, 0, 3, 1, 4)
        a = F.scaled_dot_product_attention(q, k, v, is_causal=True).transpose(1, 2).reshape(x.shape)
        return self.out(a)


def test_model_without_mla_is_refused_clearly():
    with pytest.raises(ValueError, match="no MLA attention found"):
        optimize(_PlainAttentionLM().eval(), overrides=SMALL)


def test_cli_build_default_writes_complete_report(tmp_path, capsys):
    report = tmp_path / "report.json"
    rc = main(["build", "--report", str(report), "--max-new-tokens", "4", "--set", "runtime.max_num_tokens=8"])
    assert rc == 0
    out = capsys.readouterr().out
    assert "verification passed" in out and "export" in out
    rep = json.loads(report.read_text())
    assert rep["verification"]["ok"] is True
    assert len(rep["layers"]) == 2
    for lay in rep["layers"]:
        assert {"layer", "dims", "requested", "backend", "reason", "rejected"} <= set(lay)
    assert rep["cache"]["total_bytes"] > 0 and rep["generation"]["generated_tokens"] == 4 * 4


def test_cli_reports_config_errors(capsys):
    assert main(["build", "--set", "runtime.nope=1"]) == 2
    assert "unknown key" in capsys.readouterr().out
    assert main(["build", "--model", "llama"]) == 2
    assert "neither a checkpoint directory nor a model family" in capsys.readouterr().out
