"""Bad input, tried as a new user would: each is a clear error that names the value and the limit,
raised before any build work where no model is needed, with nothing leaked.

Also: a checkpoint combined with a family's options (the README's own example), families named in
`--config` after a non-editable install, generation stopping at the model's EOS by default, and the
report's tokens/s taken after warm-up.
"""

from __future__ import annotations

import json
import subprocess
import sys
import time
import zipfile
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file, save_file

from autodeploy_mla import optimize
from autodeploy_mla.api import build_config
from autodeploy_mla.cli import build_parser, main
from autodeploy_mla.config import ConfigError, load_config, model_config_path
from autodeploy_mla.models.factory import ModelLoadError, build_model
from autodeploy_mla.runtime import CapacityError, RequestError
from autodeploy_mla.runtime.sampling import SamplingParams
from autodeploy_mla.testing import hf_greedy_generate

ROOT = Path(__file__).resolve().parents[1]
SMALL = ["model.device=cpu", "model.dtype=float32", "runtime.page_size=4", "runtime.max_seq_len=40",
         "runtime.max_num_tokens=10", "runtime.max_batch_size=3"]


@pytest.fixture(scope="module")
def om():
    return optimize("default", overrides=SMALL)


@pytest.fixture(scope="module")
def v2_ckpt(tmp_path_factory):
    cfg = load_config(model_config_path("deepseek_v2"), overrides=SMALL)
    model = build_model(cfg.model, torch.device("cpu"), torch.float32)
    path = tmp_path_factory.mktemp("ckpt") / "v2"
    model.save_pretrained(path)
    return path, model




# ----------------------------------------------------------------------------- checkpoints + families
def test_readme_checkpoint_with_family_options(v2_ckpt):
    """`optimize("/ckpts/...", "model_configs/deepseek_v2.yaml")`: the checkpoint wins over the family's
    random-weight hf_config, the family's options apply (the README's own example used to fail)."""
    path, model = v2_ckpt
    prompt = [5, 9, 200, 17, 3, 3, 8, 1, 90, 2]
    ref = hf_greedy_generate(model, prompt, 4)
    for family in (str(ROOT / "model_configs" / "deepseek_v2.yaml"), "deepseek_v2"):
        cfg, _ = build_config(str(path), family, SMALL)
        assert cfg.model.path == str(path.resolve()) and cfg.model.hf_config is None
        assert cfg.transforms == load_config(model_config_path("deepseek_v2"), overrides=SMALL).transforms
    om = optimize(str(path), "deepseek_v2", overrides=SMALL)
    assert om.generate([prompt], max_new_tokens=4) == [ref]


def test_cli_checkpoint_with_family_config(v2_ckpt, tmp_path):
    path, _ = v2_ckpt
    report = tmp_path / "r.json"
    argv = ["build", "--model", str(path), "--config", "deepseek_v2", "--max-new-tokens", "3", "--report", str(report)]
    for s in SMALL:
        argv += ["--set", s]
    assert main(argv) == 0
    rep = json.loads(report.read_text())
    assert rep["verification"]["ok"]


def test_last_model_source_wins():
    cfg = load_config("deepseek_v3", overrides=["model.path=/somewhere"])
    assert cfg.model.path == "/somewhere" and cfg.model.hf_config is None
    cfg = load_config({"model": {"path": "/x"}}, "minicpm3")
    assert cfg.model.path is None and cfg.model.hf_config["model_type"] == "minicpm3"
    with pytest.raises(ConfigError, match="not both"):
        load_config({"model": {"path": "/x", "hf_config": {"model_type": "deepseek_v3"}}})
    with pytest.raises(ConfigError, match="no such YAML file, and not a model family; families: deepseek_v2"):
        load_config("deepseek_v9")


def test_families_resolve_after_a_non_editable_install(tmp_path):
    """`--config deepseek_v3` must work from an installed wheel: the family YAMLs are package data."""
    wheels = tmp_path / "wheels"
    subprocess.run([sys.executable, "-m", "pip", "wheel", "-q", "--no-deps", "--no-build-isolation", "-w",
                    str(wheels), str(ROOT)], check=True, capture_output=True, timeout=300)
    wheel = next(wheels.glob("autodeploy_mla-*.whl"))
    names = zipfile.ZipFile(wheel).namelist()
    for fam in ("default", "deepseek_v2", "deepseek_v3", "glm_4_7_flash", "minicpm3", "mistral_small_4"):
        assert f"autodeploy_mla/model_configs/{fam}.yaml" in names, names
    assert "autodeploy_mla/config/default.yaml" in names
    target = tmp_path / "site"
    subprocess.run([sys.executable, "-m", "pip", "install", "-q", "--no-deps", "--target", str(target), str(wheel)],
                   check=True, capture_output=True, timeout=300)
    code = ("import autodeploy_mla, sys; from autodeploy_mla.config import load_config, config_layers\n"
            "assert autodeploy_mla.__file__.startswith(sys.argv[1]), autodeploy_mla.__file__\n"
            "cfg = load_config(*config_layers('default', ['deepseek_v3']))\n"
            "assert cfg.model.hf_config['model_type'] == 'deepseek_v3'\nprint('ok')\n")
    out = subprocess.run([sys.executable, "-c", code, str(target)], capture_output=True, text=True, timeout=300,
                         cwd=tmp_path, env={"PYTHONPATH": str(target), "PATH": "/usr/bin:/bin"})
    assert out.returncode == 0 and "ok" in out.stdout, out.stderr[-2000:]


# ----------------------------------------------------------------------------- token ids
def test_token_outside_the_vocabulary_fails_alone(om):
    vocab = om.vocab_size
    good = [[1, 2, 3], [7, 8]]
    ref = [hf_greedy_generate(om.eager_model, p, 4) for p in good]
    reqs = om.generate_requests([good[0], [5, vocab, 6], good[1], [-1]], SamplingParams(max_new_tokens=4))
    assert [r.generated for r in (reqs[0], reqs[2])] == ref  # the others finish
    for r, tok, pos in ((reqs[1], vocab, 1), (reqs[3], -1, 0)):
        assert r.finish_reason == "error" and not r.generated
        assert f"token id {tok} at prompt position {pos}" in r.error and f"vocab_size={vocab}" in r.error
    assert om.allocator.num_free == om.allocator.num_usable  # every page came back
    with pytest.raises(RequestError, match=f"token id {vocab} .*vocab_size={vocab}"):
        om.generate([[vocab]], max_new_tokens=2)
    with pytest.raises(RequestError, match="outside the model's vocabulary"):
        om.prefill_logits([1, 2, vocab + 5])
    with pytest.raises(RequestError, match="integer token ids"):
        om.engine().add_request(["a", "b"])


def test_a_failing_step_leaks_no_pages(om, monkeypatch):
    """If a model step raises anyway, the step's requests fail, the rest of the run is cancelled,
    and every page is returned before the error propagates."""
    calls = {"n": 0}
    real = om.runner.launch

    def flaky(*args, **kwargs):
        calls["n"] += 1
        if calls["n"] == 3:
            raise RuntimeError("device fell over")
        return real(*args, **kwargs)

    monkeypatch.setattr(om.runner, "launch", flaky)
    eng = om.engine()
    prompts = [[1, 2, 3, 4, 5, 6, 7, 8, 9, 10, 11, 12], [3, 4], [5, 6, 7], [9, 9]]  # 4 requests, 3 slots
    with pytest.raises(RuntimeError, match="device fell over"):
        eng.run(prompts, SamplingParams(max_new_tokens=6))
    assert om.allocator.num_free == om.allocator.num_usable
    assert not eng.has_work() and len(eng.done) == 4
    assert {r.finish_reason for r in eng.done.values()} <= {"error", "cancelled"}


# ----------------------------------------------------------------------------- checkpoints with holes
def test_checkpoint_missing_a_weight_is_refused(v2_ckpt, tmp_path):
    path, model = v2_ckpt
    broken = tmp_path / "broken"
    model.save_pretrained(broken)
    sd = load_file(broken / "model.safetensors")
    gone = sorted(k for k in sd if "kv_b_proj" in k)
    for k in gone:
        del sd[k]
    save_file(sd, broken / "model.safetensors", metadata={"format": "pt"})
    with pytest.raises(ModelLoadError, match=r"incomplete.*2 weight tensor\(s\) missing: " + gone[0].replace(".", r"\.")):
        optimize(str(broken), overrides=SMALL)
    assert main(["build", "--model", str(broken), *sum((["--set", s] for s in SMALL), [])]) == 2


# ----------------------------------------------------------------------------- config and CLI
def test_layer_override_that_matches_nothing():
    with pytest.raises(ValueError, match=r"'model\.layer\.\*' match no MLA layer.*0: model\.layers\.0\.self_attn"):
        optimize("default", overrides=[*SMALL, "transforms.insert_cached_mla_attention.layers={'model.layer.*': torch}"])
    # an index past the layers: the same check (per_layer), without a second build
    from autodeploy_mla.transforms.insert_cached_attention import per_layer

    names = ["model.layers.0.self_attn", "model.layers.1.self_attn"]
    assert per_layer(names, {"1": "triton"}, "auto", "k") == ["auto", "triton"]
    with pytest.raises(ValueError, match="'7' match no MLA layer"):
        per_layer(names, {"7": "torch"}, "auto", "insert_cached_mla_attention.layers")


def test_unknown_device_class_under_preference(no_build):
    with pytest.raises(ConfigError, match="unknown device class 'sm70' under preference; valid device classes: "
                                          "sm100, sm90, sm80, cuda, cpu"):
        optimize("default", overrides=[*SMALL, "transforms.insert_cached_mla_attention.preference.sm70=[torch]"])


def test_pass_requirements_are_checked_up_front(no_build):
    with pytest.raises(ConfigError, match="gather_logits needs transforms.insert_cached_mla_attention"):
        optimize("default", overrides=[*SMALL, "transforms.insert_cached_mla_attention.enabled=false",
                                       "transforms.piecewise.enabled=false"])


@pytest.mark.parametrize("value", ["0", "-1", "two"])
def test_world_size_must_be_positive(value, capsys):
    with pytest.raises(SystemExit) as exc:
        build_parser().parse_args(["build", "--world-size", value])
    assert exc.value.code == 2
    err = capsys.readouterr().err
    assert "--world-size" in err and ("must be >= 1" in err or "not an integer" in err)


def test_max_new_tokens_checked_before_the_build(no_build, capsys):
    with pytest.raises(SystemExit):
        build_parser().parse_args(["build", "--max-new-tokens", "0"])
    assert main(["build", "--max-new-tokens", "600", "--set", "runtime.max_seq_len=512"]) == 2
    assert "--max-new-tokens 600 leaves no room for a prompt: runtime.max_seq_len=512" in capsys.readouterr().out


def test_report_path_checked_before_the_build(no_build, tmp_path, capsys):
    t0 = time.perf_counter()
    assert main(["build", "--report", str(tmp_path)]) == 2
    assert f"--report {tmp_path}: is a directory" in capsys.readouterr().out
    blocker = tmp_path / "file"
    blocker.write_text("x")
    assert main(["build", "--report", str(blocker / "r.json")]) == 2
    assert "cannot create it" in capsys.readouterr().out
    assert time.perf_counter() - t0 < 10


def test_text_prompt_needs_a_tokenizer_before_the_build(no_build, capsys):
    assert main(["build", "--prompt", "hello"]) == 2
    assert "needs a checkpoint with a tokenizer" in capsys.readouterr().out
    assert main(["build", "--prompt-ids", "1,x"]) == 2
    assert "expected comma-separated integers" in capsys.readouterr().out


def test_metadata_that_cannot_be_allocated(no_build, capsys):
    huge = ["runtime.max_batch_size=100000000000", "runtime.max_seq_len=4096"]
    with pytest.raises(CapacityError, match=r"max_batch_size=100000000000.*needs [\d.]+ GiB.*available memory"):
        optimize("default", overrides=[*SMALL, *huge])
    assert main(["build", *sum((["--set", s] for s in huge), [])]) == 2
    assert "step metadata alone needs" in capsys.readouterr().out


def test_caches_that_cannot_be_allocated_are_explained(no_build):
    # refused before the build: the cache size follows from the config (2 layers x (R 40 + Dr 16) fp32)
    with pytest.raises(CapacityError, match=r"runtime\.num_pages=1000000000000, page_size=4: the paged caches need "
                                            r"[\d.]+ GiB on cpu .*448 bytes per token .*Lower runtime\.num_pages"):
        optimize("default", overrides=[*SMALL, "runtime.num_pages=1000000000000"])
    # where the size is only known at allocation (CUDA, a fraction of free memory), the runner explains it
    from autodeploy_mla.runtime.kv_cache import CacheLayout, MLACacheManager
    from autodeploy_mla.custom_ops.attention.registry import CacheSpec

    lay = [CacheLayout(f"cache_{i}", f"model.layers.{i}.self_attn", CacheSpec(56, torch.float32)) for i in range(2)]
    with pytest.raises(CapacityError, match=r"paged caches \(2 layers x 1000000000000 pages.*could not be allocated"):
        MLACacheManager(lay, 1_000_000_000_000, 4, torch.device("cpu"))


def test_pre_build_cache_estimate_is_the_built_cache(om):
    """The capacity check's cache size, from the config alone, is the one the runner allocated."""
    from autodeploy_mla.models.factory import hf_config
    from autodeploy_mla.runtime.capacity import cache_footprint, planned_num_pages

    cfg = om.config
    fp = cache_footprint(hf_config(cfg.model), cfg.runtime, om.dtype)
    cache = om.report()["cache"]
    assert fp.bytes_per_token == cache["bytes_per_token"]
    assert planned_num_pages(cfg.runtime, om.device) == cache["num_pages"]
    assert cache["total_bytes"] == cache["num_pages"] * cfg.runtime.page_size * fp.bytes_per_token


# ----------------------------------------------------------------------------- EOS and timing
def test_generation_stops_at_the_models_eos_by_default(om):
    eos = om.eos_token_ids
    assert eos == (om.eager_model.generation_config.eos_token_id,)
    prompt = [3, 1, 4, 1, 5, 9, 2, 6]
    free = hf_greedy_generate(om.eager_model, prompt, 8, ignore_eos=True)
    stop_at = free[2]  # make the model's eos a token it is about to produce
    eng = om.engine()
    eng.eos_token_ids = (stop_at,)
    req = eng.run([prompt], SamplingParams(max_new_tokens=8))[0]
    assert req.generated == free[: free.index(stop_at) + 1] and req.finish_reason == "stop"
    req = eng.run([prompt], SamplingParams(max_new_tokens=8, ignore_eos=True))[0]
    assert req.generated == free and req.finish_reason == "length"
    req = eng.run([prompt], SamplingParams(max_new_tokens=8, eos_token_id=free[0]))[0]  # explicit eos wins
    assert req.generated == free[:1]
    # the HF oracle follows the same rule
    om.eager_model.generation_config.eos_token_id = stop_at
    try:
        assert hf_greedy_generate(om.eager_model, prompt, 8) == free[: free.index(stop_at) + 1]
    finally:
        om.eager_model.generation_config.eos_token_id = eos[0]


def test_tokens_per_s_is_measured_after_warm_up(om, monkeypatch):
    calls = []

    def slow_warmup():
        calls.append(time.perf_counter())
        time.sleep(1.0)
        return {"seconds": 1.0}

    monkeypatch.setattr(om.runner, "warmup", slow_warmup)
    om.generate([[1, 2, 3]], max_new_tokens=2)
    gen = om.last_generation
    assert calls and gen["warmup_seconds"] == 1.0 and gen["seconds"] < 1.0
