"""Tensor parallelism over block-FP8 weights on CPU: 2 ranks over gloo.

A tiny DeepSeek-V3 FP8 checkpoint in the published layout with blocks [32, 32] and dims chosen so
that every split lands on a block multiple (per rank: 2 heads x 32 query rows, 2 x 32 kv_b_proj
rows, 2 x 16 o_proj columns = one block; dense intermediate 64, expert and shared-expert
intermediate 32). One spawned run holds three jobs per rank:
- the checkpoint read by slices (a weightless skeleton: each rank reads its weights' and scales'
  slices, kv_b_proj dequantized from the rank's FP8 slice),
- the same checkpoint loaded whole and sliced (`shard.load: full`: kv_b_proj's 16-bit copy made at
  match_mla, then sliced like any 16-bit weight),
- `model.init: hashed` random FP8 weights, each rank generating only its slices (returned, to be
  compared with the same slices of the whole model generated in one process).
Greedy tokens of every rank == the single-process model == HF eager with the dequantized weights
(fp32). A misaligned split is refused in-process (tests/test_fp8_checkpoint.py). The checkpoint and
the spawned run are made in a background driver process (tests/background_runs.py).
"""

from __future__ import annotations

import copy
import json
from pathlib import Path

import pytest
import torch

from autodeploy_mla import optimize
from autodeploy_mla.custom_ops.fp8.format import BlockFP8Format
from autodeploy_mla.distributed import spawn
from autodeploy_mla.models.checkpoint import ShardSpec
from autodeploy_mla.testing.fp8_checkpoints import reference_hf_model, write_fp8_checkpoint
from autodeploy_mla.testing.probe import ProbeJob, probe_rank
from autodeploy_mla.testing.tiny_configs import TINY_CONFIGS, build_tiny_model
from autodeploy_mla.verify import hf_greedy_generate
from background_runs import BackgroundRuns

RUNTIME = ["runtime.max_num_tokens=8", "runtime.page_size=4", "runtime.max_seq_len=64", "runtime.max_batch_size=4",
           "model.device=cpu", "model.dtype=float32"]
PROMPTS = [[5, 9, 200, 17], [3, 3, 8, 1, 90, 2, 7, 7, 7, 100, 11], [42]]
NEW = 5
BLOCK = BlockFP8Format(32, 32)
#: every tensor-parallel split of these dims at world size 2 is a multiple of 32 (module doc); the
#: replicated kv_a_proj_with_mqa (40 + 16 rows) keeps a partial edge block, and fuse_gemms joins it
#: after q_a_proj (64 rows) on every rank.
DIMS = {"qk_nope_head_dim": 16, "qk_rope_head_dim": 16, "v_head_dim": 16, "intermediate_size": 128,
        "moe_intermediate_size": 64, "q_lora_rank": 64}
#: the passes that rename or concatenate weights, off for the job whose weights are compared by name
NO_FUSION = ["transforms.fuse_gemms.enabled=false", "transforms.fuse_moe.enabled=false"]


def _config() -> dict:
    cfg = copy.deepcopy(TINY_CONFIGS["deepseek_v3"])
    cfg.update(DIMS)
    return cfg


def _hashed_overrides() -> list[str]:
    """Random FP8 weights of the same dims, made by `model.init: hashed` (per rank: only its slices)."""
    hf = {**_config(), "quantization_config": BLOCK.to_quantization_config()}
    return [*RUNTIME, *NO_FUSION, f"model.hf_config={json.dumps(hf)}", "model.init=hashed"]


def _write_ckpt(out: Path) -> None:
    """The background driver's prelude: the FP8 checkpoint (ckpt/) and the reference weights its
    writer returns (ref.pt: fp32, the FP8 values dequantized)."""
    torch.save(write_fp8_checkpoint(build_tiny_model(_config()), out / "ckpt", BLOCK), out / "ref.pt")


def _run_tp(out: Path) -> list:
    path = out / "ckpt"
    jobs = [ProbeJob("slices", str(path), RUNTIME, PROMPTS, NEW),
            ProbeJob("full", str(path), [*RUNTIME, "transforms.shard.load=full"], PROMPTS, NEW),
            ProbeJob("hashed", None, _hashed_overrides(), PROMPTS, NEW, weight_values=True)]
    return spawn(probe_rank, 2, jobs, all_results=True)


# The one spawned run starts in a low-priority driver process as soon as the session's tests are
# collected (tests/background_runs.py), overlapping the single-threaded tests of the files before this one.
_BACKGROUND = BackgroundRuns(__name__, {"tp": _run_tp}, {"tp_runs": ["tp"]}, prelude=_write_ckpt)


start_background_runs = _BACKGROUND.select  # conftest.py calls it once the tests are collected


@pytest.fixture(scope="module")
def ckpt():
    out = _BACKGROUND.prelude_dir()
    return out / "ckpt", reference_hf_model(build_tiny_model(_config(), seed=1), torch.load(out / "ref.pt"))


tp_runs = _BACKGROUND.fixture("tp", "tp_runs")


def test_fp8_tp2_equals_tp1_and_hf(ckpt, tp_runs):
    path, hf = ckpt
    want = [hf_greedy_generate(hf, p, NEW, ignore_eos=True) for p in PROMPTS]
    single = optimize(str(path), overrides=RUNTIME).generate(PROMPTS, max_new_tokens=NEW, ignore_eos=True)
    assert single == want
    for job in ("slices", "full"):
        for r in tp_runs:
            assert r[job]["tokens"] == want, (job, r["rank"])
            assert "world 2 rank" in r[job]["shard_summary"] and "(heads 4 -> 2)" in r[job]["shard_summary"]
            assert "0 replicated" in r[job]["shard_summary"], r[job]["shard_summary"]
    # scales are sliced with their weights, in blocks: rank 1 keeps q_b_proj rows [64, 128) = scale rows [2, 4)
    rules = tp_runs[1]["slices"]["shard_details"]["rules"]
    q = "model.model.layers.0.self_attn.q_b_proj"
    assert rules[q + ".weight"]["ranges"] == ((64, 128),) and rules[q + ".weight_scale_inv"]["ranges"] == ((2, 4),)
    up = "model.model.layers.1.mlp.experts.gate_up_proj"
    assert rules[up]["ranges"] == ((32, 64), (96, 128)) and rules[up + "_scale_inv"]["ranges"] == ((1, 2), (3, 4))
    down = "model.model.layers.1.mlp.experts.down_proj"
    assert rules[down]["dim"] == rules[down + "_scale_inv"]["dim"] == 2
    load = tp_runs[1]["slices"]["load_details"]
    assert len(load["dequantized"]) == 2  # each rank's 16-bit kv_b_proj, from its own FP8 slice
    kv = load["dequantized"][0]
    assert tp_runs[1]["slices"]["weights"][kv][0] == (2 * 32, 40)  # 2 heads x (Dn + Dv) rows, R columns
    assert tp_runs[1]["full"]["load_details"]["source"] == "model"


def test_fp8_hashed_init_per_rank_is_the_slice_of_the_whole(tp_runs):
    """`model.init: hashed` in FP8 per rank: every sharded FP8 weight and scale a rank generated
    equals (bitwise) the same slice of the whole model generated in one process; tokens == TP 1."""
    single = optimize(None, overrides=_hashed_overrides())
    whole = dict(single.eager_model.named_parameters())
    assert single.generate(PROMPTS, max_new_tokens=NEW, ignore_eos=True) == tp_runs[0]["hashed"]["tokens"]
    for r in tp_runs:
        res = r["hashed"]
        assert res["tokens"] == tp_runs[0]["hashed"]["tokens"]
        checked = 0
        for target, rule in res["shard_details"]["rules"].items():
            name = target.removeprefix("model.")
            if name not in whole or target not in res["weight_values"]:
                continue
            full = whole[name].detach()
            if full.dtype != torch.float8_e4m3fn and not name.endswith("_scale_inv"):
                continue
            spec = ShardSpec(rule["dim"], tuple(tuple(x) for x in rule["ranges"]), rule["rule"], rule["zero"])
            got, exp = res["weight_values"][target], spec.slice(full)  # FP8 returned as uint8 bits
            if exp.dtype == torch.float8_e4m3fn:
                exp = exp.view(torch.uint8)
            assert got.dtype == exp.dtype and got.shape == exp.shape, target
            assert torch.equal(got, exp), (r["rank"], target)
            checked += 1
        assert checked >= 20, checked  # FP8 weights and scales of q_b, o, mlp, experts, shared experts
