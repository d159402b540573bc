"""What a new user hit (GitHub issue 42, item 4), each refused before any build work: exit code 2,
one `error:` line naming the value and the limit, no traceback, and no model built or exported
(the `no_build` fixture fails the test if anything starts building).

    1. --device tpu / cuda without CUDA / cuda:N past the device count
    2. sampling flags out of range (--temperature -1, --top-p 2, --top-k -1, --seed)
    3. --prompt-ids outside the vocabulary (from the config or the checkpoint's config.json), or
       too long for max_seq_len
    4. capacities the machine cannot hold (runtime.max_batch_size=100000000: 5 TiB of CPU cache)
    5. `autodeploy bench` with no flags on the default model (max_seq_len 128)
"""

from __future__ import annotations

import json
import re
import time

import pytest
import torch

from autodeploy_mla import optimize
from autodeploy_mla.api import build_config, check_runtime_capacity
from autodeploy_mla.cli import main
from autodeploy_mla.cli.bench_command import workload_lengths
from autodeploy_mla.config import ConfigError, load_config
from autodeploy_mla.config.schema import RuntimeConfig
from autodeploy_mla.models.factory import ModelLoadError, hf_config
from autodeploy_mla.runtime import CapacityError
from autodeploy_mla.runtime.capacity import INT32_MAX, cache_footprint, check_capacity
from autodeploy_mla.runtime.sequence_info import metadata_nbytes

SMALL = ["model.device=cpu", "model.dtype=float32", "runtime.page_size=4", "runtime.max_seq_len=40",
         "runtime.max_num_tokens=10", "runtime.max_batch_size=3"]
GiB = 2**30




def refused(argv: list[str], capsys, within_s: float = 20.0) -> str:
    """Run the CLI; it must exit 2 with exactly one line, `error: ...`, quickly. Returns that line."""
    t0 = time.perf_counter()
    rc = main(argv)
    dt = time.perf_counter() - t0
    out = capsys.readouterr().out
    assert rc == 2, out
    lines = [ln for ln in out.splitlines() if ln.strip()]
    assert len(lines) == 1 and lines[0].startswith("error: "), out
    assert "Traceback" not in out
    assert dt < within_s, f"refused after {dt:.1f}s"
    return lines[0]


# ----------------------------------------------------------------------------- 1. the device
@pytest.mark.parametrize("device", ["tpu", "xla", "CPU", "cuda:x", "cuda:-1", "npu"])
def test_device_form_is_checked_first(device, no_build, capsys):
    line = refused(["build", "--device", device], capsys)
    assert f"--device {device!r}" in line and "expected auto | cpu | cuda | cuda:N" in line
    # the same value through the config: one line, naming the key
    line = refused(["build", "--set", f"model.device={device}"], capsys)
    assert f"model.device: {device!r} is not a device this build supports" in line
    with pytest.raises(ConfigError, match=re.escape("expected auto | cpu | cuda | cuda:N")):
        optimize("default", overrides=[*SMALL, f"model.device={device}"])


def test_tensor_parallel_spawn_checks_the_device_before_spawning(no_build, capsys, monkeypatch):
    import autodeploy_mla.cli.tp as tp

    monkeypatch.setattr(tp, "spawn", lambda *a, **k: pytest.fail("ranks spawned before the device was checked"))
    line = refused(["build", "--world-size", "2", "--device", "tpu"], capsys)
    assert "--device 'tpu'" in line


def test_a_cuda_config_still_loads_on_a_cpu_host():
    """Presence is checked before the build, not in the schema: a CUDA config stays loadable anywhere."""
    assert load_config(overrides=["model.device=cuda:1"]).model.device == "cuda:1"


@pytest.mark.skipif(torch.cuda.is_available(), reason="checks the machine without CUDA")
def test_cuda_without_cuda(no_build, capsys):
    for dev in ("cuda", "cuda:0", "cuda:3"):
        line = refused(["build", "--device", dev], capsys)
        assert f"device '{dev}' requested but CUDA is not available" in line and "use --device cpu or auto" in line
    with pytest.raises(ModelLoadError, match="CUDA is not available"):
        optimize("default", overrides=[*SMALL, "model.device=cuda"])


def test_cuda_index_past_the_device_count(no_build, capsys, monkeypatch):
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    monkeypatch.setattr(torch.cuda, "device_count", lambda: 1)
    line = refused(["build", "--device", "cuda:3"], capsys)
    assert "device 'cuda:3': this machine has 1 CUDA device(s), cuda:0..cuda:0" in line
    line = refused(["build", "--set", "model.device=cuda:1"], capsys)
    assert "device 'cuda:1': this machine has 1 CUDA device(s)" in line
    line = refused(["build", "--device", "cuda", "--world-size", "2"], capsys)
    assert "--world-size 2 --device cuda: one GPU per rank, but this machine has 1 CUDA device(s)" in line


# ----------------------------------------------------------------------------- 2. sampling flags
@pytest.mark.parametrize("flags, message", [
    (["--temperature", "-1"], "--temperature -1.0: must be a finite number >= 0 (0 = greedy)"),
    (["--temperature", "inf"], "--temperature inf: must be a finite number >= 0"),
    (["--temperature", "nan"], "--temperature nan: must be a finite number >= 0"),
    (["--top-p", "2"], "--top-p 2.0: must be in (0, 1]"),
    (["--top-p", "0"], "--top-p 0.0: must be in (0, 1]"),
    (["--top-k", "-1"], "--top-k -1: must be >= 0 (0 = off)"),
    (["--seed", "-1"], "--seed -1: must be in [0, 2**63)"),
    (["--seed", str(2**63)], f"--seed {2**63}: must be in [0, 2**63)"),
    (["--max-new-tokens", "128"], "--max-new-tokens 128 leaves no room for a prompt: runtime.max_seq_len=128"),
])
def test_sampling_flags_are_checked_before_the_build(flags, message, no_build, capsys):
    assert message in refused(["build", *flags], capsys)


# ----------------------------------------------------------------------------- 3. prompt ids
def test_prompt_ids_outside_the_vocabulary(no_build, capsys):
    line = refused(["build", "--prompt-ids", "1,2,3", "--prompt-ids", "5,256,7"], capsys)
    assert ("--prompt-ids 5,256,7: token id 256 at position 1 is outside the model's vocabulary: vocab_size=256 "
            "(ids 0..255)") in line
    line = refused(["build", "--prompt-ids=4,-1"], capsys)
    assert "token id -1 at position 1" in line and "vocab_size=256" in line


def test_prompt_ids_against_a_checkpoints_config_json(tmp_path, no_build, capsys):
    """The vocabulary of a checkpoint is read from its config.json: no weights are needed to refuse."""
    hf = hf_config(load_config("default").model)
    hf.vocab_size = 300
    hf.save_pretrained(tmp_path)  # config.json only
    line = refused(["build", "--model", str(tmp_path), "--prompt-ids", "299,300"], capsys)
    assert "token id 300 at position 1" in line and "vocab_size=300" in line


def test_prompt_too_long_for_max_seq_len(no_build, capsys):
    ids = ",".join(["7"] * 125)
    line = refused(["build", "--prompt-ids", ids, "--max-new-tokens", "8"], capsys)
    assert "--prompt-ids #1 (125 ids): 125 prompt tokens + --max-new-tokens 8 = 133, over runtime.max_seq_len=128" \
        in line


# ----------------------------------------------------------------------------- 4. capacities
@pytest.mark.parametrize("setting, message", [
    ("runtime.max_batch_size=100000000",
     r"runtime\.max_batch_size=100000000, max_seq_len=128, page_size=16: the paged caches need 5340\.58 GiB on cpu "
     r"\(800000001 pages per layer: .*448 bytes per token \(2 layers x 56 float32\)\), more than the [\d.]+ GiB this "
     r"host has available .*About \d+ full sequences of 128 tokens fit"),
    ("runtime.max_seq_len=100000000", r"the paged caches need 166\.89 GiB .*Not one full sequence of 100000000 tokens "
                                      r"fits \(41\.72 GiB each\): lower max_seq_len"),
    ("runtime.page_size=100000000", r"One page of 100000000 tokens alone costs 41\.72 GiB: lower page_size"),
    ("runtime.num_pages=100000000", r"runtime\.num_pages=100000000, page_size=16: the paged caches need 667\.57 GiB "
                                    r"on cpu .*Lower runtime\.num_pages to at most \d+\."),
])
def test_impossible_capacities_are_refused_before_the_build(setting, message, no_build, capsys):
    """These used to pass check_runtime_capacity (it counted the step metadata only: 6 GiB for 1e8
    slots, under half of the host) and fail ~20 s later allocating the CPU cache, after every pass."""
    line = refused(["build", "--set", setting], capsys)
    assert re.search(message, line), line
    cfg, _ = build_config("default", None, [setting])
    with pytest.raises(CapacityError, match=message):
        optimize(None, cfg)


def test_capacities_that_work_are_not_refused():
    """Precise, not cautious: configs that build and run are let through."""
    for sets in ([], ["runtime.max_num_tokens=100000000"],  # 3 GiB of token buffers: runs
                 ["runtime.max_batch_size=10000"],  # 80001 pages x 16 x 448 B = 0.5 GiB of CPU cache
                 ["runtime.num_pages=5", *SMALL]):  # 16 cache slots < one 40-token sequence: short requests run
        cfg, _ = build_config("default", None, sets)
        check_runtime_capacity(cfg.runtime, cfg.model)
    # CUDA without num_pages: the cache is a fraction of free memory at build time, not checked here
    rt = RuntimeConfig(max_batch_size=100_000_000)
    check_capacity(rt, torch.device("cuda:0"), _footprint(rt), host_bytes=1000 * GiB, device_bytes=80 * GiB)


def _footprint(rt: RuntimeConfig, dtype: torch.dtype = torch.float32):
    return cache_footprint(hf_config(load_config("default").model), rt, dtype)


def test_cache_bound_is_exact_at_the_limit():
    rt = RuntimeConfig(num_pages=1000, page_size=16)
    fp = _footprint(rt)
    assert (fp.layers, fp.width, fp.itemsize, fp.bytes_per_token) == (2, 56, 4, 448)
    meta = metadata_nbytes(rt.max_batch_size, rt.max_num_tokens, rt.max_seq_len, rt.page_size)
    host = meta + 1000 * 16 * 448
    check_capacity(rt, torch.device("cpu"), fp, host_bytes=host)  # exactly fits
    with pytest.raises(CapacityError, match="Lower runtime.num_pages to at most 999"):
        check_capacity(rt, torch.device("cpu"), fp, host_bytes=host - 1)


def test_cache_bound_takes_the_smallest_cache_dtype():
    """A lower bound: with any layer in FP8 every layer is counted at 1 byte per element."""
    rt = RuntimeConfig(kv_cache_layers={"0": "fp8_e4m3"})
    fp = _footprint(rt, torch.bfloat16)
    assert (fp.itemsize, fp.dtype, fp.bytes_per_token) == (1, "fp8_e4m3", 2 * 56)
    assert _footprint(RuntimeConfig(kv_cache_dtype="float16")).itemsize == 2  # named: not the model's fp32


def test_explicit_cuda_cache_against_the_gpu():
    rt = RuntimeConfig(num_pages=100_000_000, page_size=16)
    with pytest.raises(CapacityError, match=r"333\.79 GiB on cuda:0 .*more than the [\d.]+ GiB of cuda:0 .*Lower "
                                            r"runtime\.num_pages to at most \d+, or leave it null"):
        check_capacity(rt, torch.device("cuda:0"), _footprint(rt, torch.bfloat16), host_bytes=1000 * GiB,
                       device_bytes=80 * GiB)


def test_int32_metadata_limits():
    """Values the int32 step metadata cannot hold, on a host with memory to spare."""
    huge = 10**18
    rt = RuntimeConfig(num_pages=10**9, page_size=16)
    with pytest.raises(CapacityError, match=r"runtime\.num_pages=1000000000 x page_size=16 = 16000000000 cache slots "
                                            r"per layer, over the 2147483648 that the int32 cache slot index"):
        check_capacity(rt, torch.device("cpu"), _footprint(rt), host_bytes=huge)
    rt = RuntimeConfig(max_batch_size=INT32_MAX + 1, max_seq_len=2, page_size=2, num_pages=2)
    with pytest.raises(CapacityError, match=rf"runtime\.max_batch_size={INT32_MAX + 1}: over {INT32_MAX}"):
        check_capacity(rt, torch.device("cpu"), None, host_bytes=huge)
    check_capacity(RuntimeConfig(num_pages=2**31 // 16, page_size=16), torch.device("cpu"), None, host_bytes=huge)


# ----------------------------------------------------------------------------- 5. bench defaults
def test_bench_lengths_fit_the_model_when_not_given():
    std = workload_lengths(None, None, 4096)
    assert (std.prompt, std.output) == ((256, 2048), (128, 128)) and "the standard workload" in std.note
    tiny = workload_lengths(None, None, 128)
    assert (tiny.prompt, tiny.output) == ((15, 121), (7, 7))
    assert "fitted to max_seq_len=128" in tiny.note
    assert workload_lengths("40", None, 48).output == (2, 2)  # min(128, 48 // 17, 48 - 40)
    given = workload_lengths("4:8", "3", 128)
    assert (given.prompt, given.output, given.note) == ((4, 8), (3, 3), None)


def test_bench_explicit_lengths_that_do_not_fit(no_build, capsys):
    assert refused(["bench", "--prompt-len", "200"], capsys) == (
        "error: --prompt-len 200: prompts of up to 200 tokens leave no room for output in max_seq_len=128; shorten "
        "--prompt-len or raise runtime.max_seq_len")
    assert refused(["bench", "--output-len", "128"], capsys).startswith(
        "error: --output-len 128: outputs of up to 128 tokens leave no room for a prompt in max_seq_len=128")
    line = refused(["bench", "--prompt-len", "100:120", "--output-len", "9"], capsys)  # both given: as they are
    assert "prompt + 9 output tokens" in line and "over max_seq_len=128 of this config" in line
    line = refused(["bench", "--device", "tpu"], capsys)
    assert "--device 'tpu'" in line


def test_bench_with_no_flags_runs_the_default_model(capsys, tmp_path):
    """`autodeploy bench` with no length flags (it used to ask the default model, max_seq_len 128, for
    256:2048-token prompts); 8 requests instead of the default 64 keep the test to a few seconds."""
    assert main(["bench", "--num-requests", "8", "--out", str(tmp_path)]) == 0
    out = capsys.readouterr().out
    assert ("--prompt-len and --output-len not given: prompts 15:121, outputs 7 tokens (the standard 256:2048 / 128 "
            "workload fitted to max_seq_len=128)") in out
    run = json.loads((tmp_path / "bench.json").read_text())["runs"][0]
    assert run["failed"] == 0 and run["generated_tokens"] == 8 * 7 and run["mode"] == "in-process"


def test_bench_prefix_workload_flags(no_build, capsys):
    line = refused(["bench", "--shared-prefix", "8", "--multi-turn", "2"], capsys)
    assert "--shared-prefix and --multi-turn are two workloads" in line
    line = refused(["bench", "--multi-turn", "3", "--prompt-len", "40", "--question-len", "40", "--output-len", "9"],
                   capsys)
    assert "(turn 2 of a conversation)" in line and "over max_seq_len=128 of this config" in line


def test_bench_multi_turn_runs_and_reports_ttft_per_turn(capsys, tmp_path):
    args = ["--multi-turn", "3", "--num-requests", "2", "--prompt-len", "10", "--question-len", "4", "--output-len", "3"]
    assert main(["bench", *args, "--out", str(tmp_path)]) == 0
    assert "turn 2 TTFT p50 ms" in capsys.readouterr().out
    run = json.loads((tmp_path / "bench.json").read_text())["runs"][0]
    assert run["failed"] == 0 and run["requests"] == 6 and sorted(run["per_turn"]) == ["0", "1", "2"]
    assert run["prefix_caching"] and run["prefix_hit_tokens"] > 0
