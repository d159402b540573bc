"""Tensor-parallel MLA (the `shard` pass) on CPU: 2 ranks over gloo, spawned with torch.multiprocessing.

Few multi-process runs, each serving several tests (process start-up and export dominate the time):
- one 2-rank run for every 2-rank probe of the suite (the sparse-attention test lives here for that
  reason): `autodeploy build` on a tiny DeepSeek-V3 (MoE) checkpoint saved with save_pretrained, so
  each rank reads only its slices with safetensors `get_slice` and rank 0 verifies against HF eager
  (the CLI's in-rank path); then `probe_rank` on a GLM-4.7-Flash-shaped model (random weights: full
  model sliced), on a model that calls torch_mla natively with the head count spelled out in its
  reshapes, and on the DeepSeek Sparse Attention families (GLM-5, DeepSeek-V3.2);
- `torchrun` running the same `autodeploy build` on the checkpoint;
- 4 ranks on the GLM model with `model.init: hashed` (each rank makes only its slices).
Each probe is compared with the single-process optimized model and (HF families) with HF eager.
The runs start in a low-priority driver process as soon as the session's tests are collected
(tests/background_runs.py), so that they overlap the single-threaded tests of the files before this one.
The GPU part (NCCL, bf16, 2 x H200) is at the end, marked `gpu`.
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import types
from pathlib import Path

import pytest
import torch
import torch.nn.functional as F
from torch import nn
from autodeploy_mla import optimize
from autodeploy_mla.api import build_config
from autodeploy_mla.cli import main
from autodeploy_mla.cli import tp as cli_tp
from autodeploy_mla.config import load_config, model_config_path
from autodeploy_mla.custom_ops import Target
from autodeploy_mla.distributed import MULTICAST_OFF_ENV, DistributedError, RankFailed, is_rank0, spawn
from autodeploy_mla.models.checkpoint import CheckpointReader, ShardSpec, read_source, source_for
from autodeploy_mla.models.factory import build_model
from autodeploy_mla.runtime.artifacts import TensorParallel
from autodeploy_mla.testing import hf_greedy_generate
from autodeploy_mla.testing.probe import ProbeJob, probe_rank
from autodeploy_mla.testing.tiny_configs import build_tiny_model
from autodeploy_mla.transforms.context import BuildContext
from autodeploy_mla.transforms.pass_manager import parse_pipeline
from autodeploy_mla.transforms.shard import ShardError
from background_runs import BackgroundRuns

RUNTIME = ["runtime.max_num_tokens=8", "runtime.page_size=4", "runtime.max_seq_len=64", "runtime.max_batch_size=4",
           "model.device=cpu", "model.dtype=float32"]
# Lengths: chunked prefill (> max_num_tokens), several pages, a 1-token prompt; decode mixes with prefill.
PROMPTS = [[5, 9, 200, 17], [3, 3, 8, 1, 90, 2, 7, 7, 7, 100, 11], [42], [7, 1, 250, 9, 9, 30, 31, 32, 33]]
NEW = 6
LOGITS_PROMPT = [11, 12, 13, 250, 14, 15, 16, 17, 18, 19]
NATIVE_PROMPTS = [[42], [1, 2, 3, 4, 5], [3, 3, 8, 1, 9, 2, 7, 7, 7, 10, 11]]
# The fused-MoE job runs its experts in Triton's interpreter (most of this file's in-process time):
# a chunked prefill over several pages mixed with a 1-token prompt, and fewer decode steps.
MOE_PROMPTS, MOE_NEW = [PROMPTS[1], PROMPTS[2]], 4
# Sparse-attention (DSA) jobs: prompts shorter and longer than the tiny configs' index_topk (6).
DSA_PROMPTS, DSA_NEW = [list(range(3, 19)), [5, 9, 200, 17], list(range(40, 61))], 6


# ----------------------------------------------------------------------------- a native-op model
class NativeMLALM(nn.Module):
    """A causal LM that calls torch_mla itself and spells N and N*Dv out in its reshapes, which the
    shard pass must rewrite (HF models use -1 there). One gated MLP."""

    N, DN, DR, DV, R, H, V = 4, 8, 4, 6, 12, 32, 64

    def __init__(self) -> None:
        super().__init__()
        n, dn, dr, dv, r, h = self.N, self.DN, self.DR, self.DV, self.R, self.H
        self.config = types.SimpleNamespace(vocab_size=self.V)
        self.emb = nn.Embedding(self.V, h)
        self.q_proj = nn.Linear(h, n * (dn + dr), bias=True)  # bias: sharded by head with the weight
        self.kv_a = nn.Linear(h, r + dr, bias=False)
        self.kv_b = nn.Parameter(torch.randn(n * (dn + dv), r) * r**-0.5)
        self.o_proj = nn.Linear(n * dv, h, bias=True)  # bias: added once (rank 0) around the all-reduce
        self.gate, self.up = nn.Linear(h, 48, bias=False), nn.Linear(h, 48, bias=False)
        self.down = nn.Linear(48, h, bias=False)
        self.head = nn.Linear(h, self.V, bias=False)

    def forward(self, input_ids, position_ids=None, use_cache=False):
        b, s = input_ids.shape
        x = self.emb(input_ids)
        q = self.q_proj(x).view(b, s, 4, 12)  # literal N and Dn+Dr
        q_nope, q_pe = q.split([self.DN, self.DR], -1)
        ckv, kpe = self.kv_a(x).split([self.R, self.DR], -1)
        kpe = kpe.view(b, s, 1, self.DR)
        out = torch.ops.autodeploy.torch_mla(q_nope, q_pe, ckv, kpe, self.kv_b, True, None, "bsnd")
        x = x + self.o_proj(out.reshape(b, s, 24))  # literal N*Dv
        x = x + self.down(F.silu(self.gate(x)) * self.up(x))
        return self.head(x)


def make_native() -> nn.Module:
    torch.manual_seed(3)
    return NativeMLALM().eval()


# ----------------------------------------------------------------------------- the multi-process runs
def _ds3_config(*extra: str):
    return load_config(model_config_path("deepseek_v3"), overrides=[*RUNTIME, *extra])


def _cli_argv(ckpt, report) -> list[str]:
    argv = ["build", "--model", str(ckpt), "--world-size", "2", "--max-new-tokens", str(NEW), "--report", str(report)]
    for p in PROMPTS:
        argv += ["--prompt-ids", ",".join(map(str, p))]
    for s in RUNTIME:
        argv += ["--set", s]
    return argv


def _jobs() -> list[ProbeJob]:
    return [
        ProbeJob("glm", "glm_4_7_flash", RUNTIME, PROMPTS, NEW, LOGITS_PROMPT,
                 sampling={"temperature": 1.0, "top_k": 50}),
        ProbeJob("glm_moe", "glm_4_7_flash", [*RUNTIME, "transforms.fuse_moe.backend=triton"], MOE_PROMPTS, MOE_NEW,
                 LOGITS_PROMPT),
        # the functional collectives (all_reduce: nccl) rather than the default autodeploy::tp_all_reduce
        ProbeJob("native", make_native, [*RUNTIME, "transforms.shard.all_reduce=nccl"], NATIVE_PROMPTS, NEW,
                 [1, 2, 3, 4, 5, 6, 7, 8, 9, 10]),
        # hashed random weights: each rank builds a skeleton and generates only its slices
        ProbeJob("glm_hashed", "glm_4_7_flash", [*RUNTIME, "model.init=hashed"], PROMPTS, NEW, LOGITS_PROMPT),
    ]


def _dsa_jobs() -> list[ProbeJob]:
    """DeepSeek Sparse Attention: GLM-5 with transformers' random weights (the full model, sliced), and
    DeepSeek-V3.2 with `model.init: hashed` (each rank exports a weightless skeleton, the pre-export
    check is skipped and says so, and generates only its slices). Compared with HF eager."""
    return [ProbeJob("dsa_glm_5", "glm_5", RUNTIME, DSA_PROMPTS, DSA_NEW),
            ProbeJob("dsa_v32_hashed", "deepseek_v32", [*RUNTIME, "model.init=hashed"], DSA_PROMPTS, DSA_NEW)]


def _run_tp(out: Path) -> tuple:
    """The one spawned 2-rank run: `autodeploy build` on the DeepSeek-V3 checkpoint (the CLI's in-rank
    path), then probes of the GLM, native and sparse-attention models. (per-rank results, the report)"""
    report = out / "tp_report.json"
    jobs = [ProbeJob("cli_ds3", None, cli_argv=_cli_argv(out / "ds3", report)), *_jobs(), *_dsa_jobs()]
    ranks = spawn(probe_rank, 2, jobs, all_results=True)
    return ranks, json.loads(report.read_text())


def _run_torchrun(out: Path) -> tuple:
    """`torchrun --nproc-per-node 2 -m autodeploy_mla.cli build` on the checkpoint: (returncode,
    stdout, stderr, the report or None)."""
    from autodeploy_mla.distributed.launch import free_port

    report = out / "torchrun_report.json"
    argv = _cli_argv(out / "ds3", report)
    argv.remove("--world-size")
    argv.remove("2")
    cmd = [sys.executable, "-m", "torch.distributed.run", "--nproc-per-node", "2", "--master-port", str(free_port()),
           "-m", "autodeploy_mla.cli", *argv]
    proc = subprocess.run(cmd, capture_output=True, text=True, timeout=600)  # at low priority
    rep = json.loads(report.read_text()) if report.is_file() else None
    return proc.returncode, proc.stdout, proc.stderr, rep


def _run_four(out: Path) -> list:
    """4 ranks on the hashed GLM job."""
    return spawn(probe_rank, 4, [next(j for j in _jobs() if j.name == "glm_hashed")], all_results=True)


# Consumption order (the file's test order): the 2-rank run, torchrun, the 4-rank run.
_RUNS = {"tp": _run_tp, "torchrun": _run_torchrun, "four": _run_four}


def _write_ds3(out: Path) -> None:
    """The background driver's prelude: the tiny DeepSeek-V3 (MoE on) checkpoint the runs read, saved
    with save_pretrained (per-expert safetensors tensors)."""
    build_model(_ds3_config().model, torch.device("cpu"), torch.float32).save_pretrained(out / "ds3")


# This file's multi-process runs (about two minutes of both cores, most of it process start-up and
# export) start in a low-priority driver process as soon as the session's tests are collected
# (tests/background_runs.py), overlapping the single-threaded tests of the files before this one.
_BACKGROUND = BackgroundRuns(__name__, _RUNS, {"tp_runs": ["tp"], "torchrun_build": ["torchrun"],
                                               "four_rank_runs": ["four"]}, prelude=_write_ds3)


start_background_runs = _BACKGROUND.select  # conftest.py calls it once the tests are collected


# ----------------------------------------------------------------------------- fixtures
@pytest.fixture(scope="module")
def ds3_ckpt():
    """The tiny DeepSeek-V3 (MoE on) checkpoint the runs read, and its HF model loaded from it."""
    path = _BACKGROUND.prelude_dir() / "ds3"
    return path, build_model(_ds3_config(f"model.path={path}", "model.hf_config=null").model, torch.device("cpu"),
                             torch.float32)


# (per-rank results, the CLI's report) of the 2-rank run (_run_tp)
tp_runs = _BACKGROUND.fixture("tp", "tp_runs")
torchrun_build = _BACKGROUND.fixture("torchrun", "torchrun_build")
four_rank_runs = _BACKGROUND.fixture("four", "four_rank_runs")


@pytest.fixture(scope="module")
def single_runs(optimized_family):
    """The same jobs in this process, without sharding (family builds shared with other files)."""
    out = {}
    for job in _jobs():
        om = optimize(job.model(), overrides=list(job.overrides)) if callable(job.model) else \
            optimized_family(job.model, job.overrides)
        out[job.name] = {
            "om": om,
            "tokens": om.generate([list(p) for p in job.prompts], max_new_tokens=job.max_new_tokens),
            "logits": om.prefill_logits(list(job.logits_prompt)),
        }
    return out


# ----------------------------------------------------------------------------- CPU tests
def test_cli_checkpoint_slices_match_single_process_and_hf(tp_runs, ds3_ckpt):
    """`autodeploy build` in 2 ranks on a DeepSeek-V3 (MoE) checkpoint: each rank reads its slices;
    rank 0 writes the report and verifies against HF eager; tokens == single-process optimized."""
    ranks, rep = tp_runs
    assert [r["cli_ds3"]["rc"] for r in ranks] == [0, 0]
    path, hf_model = ds3_ckpt
    shard = next(p for p in rep["passes"] if p["name"] == "shard")
    assert shard["enabled"] and "world 2 rank 0" in shard["summary"]
    assert "4 all-reduces" in shard["summary"]  # 2 attention + dense MLP + (routed + shared experts)
    load = next(p for p in rep["passes"] if p["name"] == "load_weights")
    assert load["enabled"] and "read from" in load["summary"] and "as this rank's slices" in load["summary"]
    assert all(lay["dims"]["num_heads"] == 2 for lay in rep["layers"])  # backend resolution saw N/2
    assert rep["verification"]["ok"] and all(v["identical"] for v in rep["verification"]["prompts"])
    tp_tokens = [v["ours"] for v in rep["verification"]["prompts"]]

    single = optimize(str(path), overrides=RUNTIME)
    assert single.generate(PROMPTS, max_new_tokens=NEW) == tp_tokens
    assert tp_tokens == [hf_greedy_generate(hf_model, p, NEW) for p in PROMPTS]


def test_plain_torchrun_builds_and_exits(torchrun_build):
    """`torchrun --nproc-per-node 2 -m autodeploy_mla.cli build`: each process starts the group from
    the torchrun environment, builds its shard, rank 0 verifies against HF eager and writes the
    report, and both processes tear the group down and exit 0."""
    returncode, stdout, stderr, rep = torchrun_build
    assert returncode == 0, stdout[-3000:] + stderr[-3000:]
    assert all(lay["dims"]["num_heads"] == 2 for lay in rep["layers"])
    assert rep["verification"]["ok"]
    assert stdout.count("verification passed") == 1  # rank 1 is quiet


def test_teardown_frees_cuda_graphs_first_and_cannot_hang(monkeypatch):
    """A captured graph holding an NCCL collective makes destroy_process_group block forever
    (pytorch#115388): shutdown resets every tracked graph first, and abandons a teardown that hangs."""
    import threading

    from autodeploy_mla.distributed import env
    from autodeploy_mla.runtime import cuda_graphs

    calls = []

    class FakeGraph:
        def reset(self):
            calls.append("reset")

    graph = FakeGraph()
    cuda_graphs.track_graph(graph)
    monkeypatch.setattr(env.dist, "is_initialized", lambda: True)
    monkeypatch.setattr(env.dist, "destroy_process_group", lambda: calls.append("destroy"))
    assert env.shutdown_distributed() is True
    assert calls == ["reset", "destroy"]
    assert cuda_graphs.release_cuda_graphs() == 0  # released graphs are forgotten

    stuck = threading.Event()
    monkeypatch.setattr(env.dist, "destroy_process_group", lambda: stuck.wait(10))
    with pytest.warns(UserWarning, match="did not finish within"):
        assert env.shutdown_distributed(timeout_s=0.2) is False
    stuck.set()


@pytest.mark.parametrize("job", ["glm", "glm_moe", "native", "glm_hashed"])
def test_two_ranks_match_single_process(tp_runs, single_runs, job):
    r0, r1 = tp_runs[0][0][job], tp_runs[0][1][job]
    ref = single_runs[job]
    assert (r0["rank"], r1["rank"], r0["world_size"]) == (0, 1, 2)
    assert r0["tokens"] == r1["tokens"] == ref["tokens"]  # ranks agree, and agree with one process
    assert torch.allclose(r0["logits"], ref["logits"], atol=1e-4, rtol=1e-4)
    assert torch.equal(r0["logits"], r1["logits"])  # all-reduce results are identical on every rank
    full_n = ref["om"].report()["layers"][0]["dims"]["num_heads"]
    assert all(lay["dims"]["num_heads"] == full_n // 2 for lay in r0["layers"])
    # transformers' random weights: full model built from the seed, then sliced; hashed: a skeleton
    assert r0["skeleton"] == (job == "glm_hashed")
    assert r0["env"] == MULTICAST_OFF_ENV  # set by the launcher in every rank
    assert r0["sampled"] == r1["sampled"]  # random sampling agrees too (same RNG state on every rank)
    # prefix caching decides the same on every rank: the same hits, the same keys in the same pages
    assert r0["prefix_cache"] == r1["prefix_cache"] and r0["prefix_cache"]["pages"]
    if job == "glm":  # its second generate (sampled) takes the first's prompt pages
        assert r0["prefix_cache"]["hit_tokens"] == r0["prefix_cache"]["cached_tokens"] == 8 + 8  # 11 and 9 tokens: 2 pages before the last token each


@pytest.mark.parametrize("job", ["glm", "glm_hashed"])
def test_glm_tokens_match_hf(tp_runs, single_runs, job):
    eager = single_runs[job]["om"].eager_model  # hashed: the full model generated in this process
    assert tp_runs[0][0][job]["tokens"] == [hf_greedy_generate(eager, p, NEW) for p in PROMPTS]


def test_sparse_tensor_parallel_two_ranks_equal_hf(tp_runs):
    """Tensor parallel over heads (2 ranks, gloo, CPU fp32) for DeepSeek Sparse Attention as for dense
    MLA: each rank holds 2 of the 4 heads of q_b/kv_b/o_proj, the indexer (and its cache) is
    replicated; greedy tokens equal HF eager's on both ranks, for prompts longer than index_topk:
    GLM-5 (shared-indexer layer; transformers' weights, full model sliced) and DeepSeek-V3.2 built
    from a skeleton (`model.init: hashed`, against HF eager on the same hashed weights)."""
    ranks = tp_runs[0]
    hashed = load_config(model_config_path("deepseek_v32"), overrides=[*RUNTIME, "model.init=hashed"])
    refs = {"dsa_glm_5": build_tiny_model("glm_5"),
            "dsa_v32_hashed": build_model(hashed.model, torch.device("cpu"), torch.float32)}
    for job, model in refs.items():
        ref = [hf_greedy_generate(model, p, DSA_NEW) for p in DSA_PROMPTS]
        r0, r1 = ranks[0][job], ranks[1][job]
        assert r0["tokens"] == r1["tokens"] == ref, job
        assert all(lay["dims"]["num_heads"] == 2 for lay in r0["layers"]), job
        assert r0["skeleton"] == (job == "dsa_v32_hashed"), job


def test_four_ranks_hashed_glm_match_single_process(four_rank_runs, single_runs):
    """World size 4 over gloo (one head per rank of the tiny GLM, a quarter of every MLP/expert),
    every rank generating its own slices of the hashed weights: tokens and logits as one process."""
    ranks = four_rank_runs
    ref = single_runs["glm_hashed"]
    for rank, res in enumerate(ranks):
        r = res["glm_hashed"]
        assert (r["rank"], r["world_size"]) == (rank, 4)
        assert r["tokens"] == ref["tokens"]
        assert torch.allclose(r["logits"], ref["logits"], atol=1e-4, rtol=1e-4)
        assert all(lay["dims"]["num_heads"] == 1 for lay in r["layers"])
        assert r["load_details"]["bytes_read"] < 0.6 * r["load_details"]["full_model_bytes"]
    assert all(torch.equal(ranks[0]["glm_hashed"]["logits"], res["glm_hashed"]["logits"]) for res in ranks[1:])


def test_hashed_init_ranks_make_only_their_slices(tp_runs, single_runs):
    """With model.init=hashed no rank holds the full model: load_weights generated this rank's
    slices (less than the full model's bytes). That they are the single process's weights, sliced,
    is what the token and logit equality of test_two_ranks_match_single_process shows."""
    full = {t: getattr_path(single_runs["glm_hashed"]["om"].gm, t) for t in tp_runs[0][0]["glm_hashed"]["weights"]}
    for rank in (0, 1):
        r = tp_runs[0][rank]["glm_hashed"]
        load = r["load_details"]
        assert load["source"] == "hashed init slices" and load["tensors"] > 0
        assert 0 < load["bytes_read"] < 0.85 * load["full_model_bytes"]
        assert all(not placeholder for _, placeholder in r["weights"].values())
        assert r["weights"].keys() == full.keys()
    assert single_runs["glm_hashed"]["om"].history[[h.name for h in single_runs["glm_hashed"]["om"].history]
                                                   .index("load_weights")].details["source"] == "model"


def test_sharded_weight_shapes_and_collectives(tp_runs, single_runs):
    ranks = tp_runs[0]
    for job in ("glm", "native"):
        full = {t: tuple(getattr_path(single_runs[job]["om"].gm, t).shape) for t in ranks[0][job]["weights"]}
        rules = ranks[0][job]["shard_details"]["rules"]
        for target, (shape, placeholder) in ranks[0][job]["weights"].items():
            assert not placeholder, target
            if ".fused_" in target:  # fuse_gemms ran after shard: rank slices of the members, concatenated
                # (gate + up: column-parallel halves; q_a + kv_a: replicated, whole)
                assert shape[1] == full[target][1] and shape[0] in (full[target][0], full[target][0] // 2), target
                assert (shape[0] < full[target][0]) == ("gate" in target), target
            elif target in rules and not rules[target]["rule"].endswith("(rank 0)"):
                d = rules[target]["dim"]
                assert shape[d] * 2 == full[target][d], target
                assert shape[:d] + shape[d + 1:] == full[target][:d] + full[target][d + 1:], target
            else:
                assert shape == full[target], target  # replicated (or a bias added by rank 0 only)
    glm = ranks[0]["glm"]
    # per layer: q_b_proj rows, kv_b_proj rows, o_proj columns by head; dense MLP + shared + routed experts
    kinds = {r["rule"] for r in glm["shard_details"]["rules"].values()}
    assert {"heads: query rows", "heads: kv_b_proj rows", "heads: o_proj columns", "mlp: column-parallel",
            "mlp: row-parallel", "experts: column-parallel", "experts: row-parallel"} <= kinds
    assert glm["all_reduces"] == 4  # one per attention block, one per MLP/MoE block
    # default all_reduce: one_shot -> autodeploy::tp_all_reduce nodes; on CPU the runner sets up no
    # symmetric buffer and the op runs the collective (gloo), as the report says
    assert glm["all_reduce_ops"] == ["autodeploy.tp_all_reduce.default"]
    assert glm["tp_all_reduce"].startswith("one_shot asked, cpu device")
    native = ranks[0]["native"]
    assert native["all_reduces"] == 2
    assert native["all_reduce_ops"] == ["_c10d_functional.all_reduce.default", "_c10d_functional.wait_tensor.default"]
    assert native["tp_all_reduce"] == "nccl"
    assert native["shard_details"]["rules"]["model.o_proj.bias"]["zero"] is False  # rank 0 adds the bias
    assert ranks[1]["native"]["shard_details"]["rules"]["model.o_proj.bias"]["zero"] is True


def getattr_path(obj, target):
    for part in target.split("."):
        obj = getattr(obj, part)
    return obj


@pytest.fixture(scope="module")
def matched_ds3(ds3_ckpt):
    """A tiny DeepSeek-V3 graph after export + match_mla (N=4), for the single-process checks."""
    cfg = load_config(model_config_path("deepseek_v3"), overrides=RUNTIME)
    pipeline = parse_pipeline(cfg.transforms)
    ctx = BuildContext(cfg, ds3_ckpt[1], torch.device("cpu"), torch.float32, Target.detect("cpu", 4))
    for info, opts in pipeline.steps:
        if info.name in ("export", "match_mla"):
            info.fn(ctx, opts)
    return ctx, pipeline


def _run_shard(matched, world=None, **opts):
    """The shard pass alone, in a context whose tensor-parallel group is `world` (None: one process)."""
    ctx, pipeline = matched
    ctx.world = world
    info = next(i for i, _ in pipeline.steps if i.name == "shard")
    return info.fn(ctx, info.options.model_validate({"enabled": True, **opts}))


def test_world_size_not_dividing_heads_is_refused(matched_ds3):
    before = matched_ds3[0].gm.code
    expected = (r"world_size=3 does not divide the attention head count of model\.layers\.0\.self_attn \(N=4\)"
                r".*valid world sizes for this model: 1, 2, 4")
    with pytest.raises(ShardError, match=expected):
        _run_shard(matched_ds3, TensorParallel(3, 0, "0"))
    assert matched_ds3[0].gm.code == before  # refused before touching the graph


def test_sharding_without_process_group_is_refused_before_building():
    """The world is resolved once, in optimize(), before any model is built or exported."""
    with pytest.raises(DistributedError, match="needs an initialised torch.distributed process group of 2 ranks.*"
                                               "--world-size 2"):
        optimize("deepseek_v3", overrides=[*RUNTIME, "transforms.shard.enabled=true",
                                           "transforms.shard.world_size=2", "transforms.shard.rank=1"])


def test_world_size_one_is_a_no_op(matched_ds3):
    before = matched_ds3[0].gm.code
    res = _run_shard(matched_ds3)
    assert "nothing to shard" in res.summary and matched_ds3[0].gm.code == before


def test_shard_options_are_validated():
    with pytest.raises(ValueError, match="rank=2 must be < world_size=2"):
        build_config(overrides=["transforms.shard.world_size=2", "transforms.shard.rank=2"])
    with pytest.raises(ValueError, match="transforms.shard.experts"):
        build_config(overrides=["transforms.shard.experts=sideways"])
    with pytest.raises(ValueError, match="one_shot_max_bytes"):
        build_config(overrides=["transforms.shard.one_shot_max_bytes=100"])  # not a multiple of 16
    with pytest.raises(ValueError, match="transforms.shard.all_reduce"):
        build_config(overrides=["transforms.shard.all_reduce=two_shot"])


def test_tp_all_reduce_workspace_only_on_cuda():
    """The runner sets up a symmetric buffer only for one-shot graphs of world > 1 on CUDA; elsewhere the
    op runs the collective and the report says why (no collective is needed to decide that)."""
    from autodeploy_mla.runtime.artifacts import TensorParallel
    from autodeploy_mla.runtime.model_runner import setup_tp_all_reduce

    cpu = torch.device("cpu")
    assert setup_tp_all_reduce(None, cpu) == (None, "")
    assert setup_tp_all_reduce(TensorParallel(2, 0, "g", 4, "nccl", 0), cpu) == (None, "nccl")
    ws, why = setup_tp_all_reduce(TensorParallel(2, 0, "g", 4, "one_shot", 1 << 19), cpu)
    assert ws is None and why.startswith("one_shot asked, cpu device")


def test_checkpoint_slices_equal_slices_of_the_full_weights(ds3_ckpt):
    """Virtual fused-expert tensors and head slices read from safetensors == slicing the loaded model."""
    path, model = ds3_ckpt
    sd = model.state_dict()
    E, two_i, H = sd["model.layers.1.mlp.experts.gate_up_proj"].shape
    i = two_i // 2
    cases = {
        "model.layers.1.mlp.experts.gate_up_proj": ShardSpec(1, ((i // 2, i), (i + i // 2, 2 * i)), "experts col"),
        "model.layers.1.mlp.experts.down_proj": ShardSpec(2, ((0, i // 2),), "experts row"),
        "model.layers.0.self_attn.kv_b_proj.weight": ShardSpec(0, ((88, 176),), "heads"),
        "model.layers.0.self_attn.o_proj.weight": ShardSpec(1, ((40, 80),), "heads"),
        "model.layers.0.mlp.down_proj.weight": ShardSpec(1, ((0, 48),), "mlp row"),
    }
    with CheckpointReader(path) as reader:
        for name, spec in cases.items():
            full = sd[name]
            got = read_source(reader, source_for(reader, name, tuple(full.shape)), spec.selection(full.dim()))
            assert torch.equal(got, spec.slice(full)), name
        whole = reader.bytes_read
        assert whole < sum(sd[n].numel() * 4 for n in cases)  # only the slices were read
        with pytest.raises(Exception, match="not in the checkpoint"):
            source_for(reader, "model.layers.0.self_attn.q_proj.weight", (160, 64))


def test_spawn_reports_the_failing_rank_and_stops_the_others():
    """Rank 1 fails while rank 0 waits in a collective: rank 0 is stopped, rank 1's error is raised."""
    with pytest.raises(RankFailed, match="rank 1: ValueError: boom on rank 1"):
        spawn(_fail_on_rank1, 2)


def _fail_on_rank1(rank: int) -> int:
    if rank == 1:
        raise ValueError("boom on rank 1")
    torch.distributed.barrier()  # never completes: rank 1 is gone
    return rank


def test_cli_launch_spawns_ranks_that_turn_sharding_on():
    """`autodeploy build --world-size 2` from a plain process spawns 2 ranks running build(args); in
    each, rank_setup turns the shard pass on; rank 0's exit code comes back. The ranks also check the
    collective helpers the shard pass and the model runner use."""
    assert cli_tp.launch(argparse.Namespace(world_size=2, device="cpu", seed=0), _fake_build) == 10
    assert cli_tp.launch(argparse.Namespace(world_size=1, device=None, seed=0), _fake_build) is None


class _Double(nn.Module):
    def forward(self, x):
        return x * 2


def _fake_build(args) -> int:
    from autodeploy_mla.distributed.env import env_info, world_group_name
    from autodeploy_mla.runtime.model_runner import rows_from_rank0
    from autodeploy_mla.transforms.shard import count_all_reduces, insert_all_reduce

    with cli_tp.rank_setup(args) as sets:
        assert sets == ["transforms.shard.enabled=true", "transforms.shard.world_size=2"], sets
    rank = env_info().rank
    if not os.environ.get("OMP_NUM_THREADS"):  # each rank gets its share of the host's cores
        assert torch.get_num_threads() == max(1, (os.cpu_count() or 1) // 2)
    gm = torch.fx.symbolic_trace(_Double())
    out = next(n for n in gm.graph.nodes if n.op == "output")
    out.args = (insert_all_reduce(gm.graph, out.args[0], world_group_name()),)
    gm.recompile()
    assert count_all_reduces(gm) == 1
    assert gm(torch.full((2,), float(rank + 1))).tolist() == [6.0, 6.0]  # 2*1 + 2*2 on both ranks
    # the one-shot op: without a symmetric buffer (CPU) it runs the collective; a declared, checked op
    from autodeploy_mla.custom_ops.tp_all_reduce import TP_ALL_REDUCE

    gm = torch.fx.symbolic_trace(_Double())
    out = next(n for n in gm.graph.nodes if n.op == "output")
    out.args = (insert_all_reduce(gm.graph, out.args[0], world_group_name(), "one_shot"),)
    gm.recompile()
    assert count_all_reduces(gm) == 1 and any(n.target is TP_ALL_REDUCE for n in gm.graph.nodes)
    x = torch.full((2,), float(rank + 1))
    assert gm(x).tolist() == [6.0, 6.0] and x.tolist() == [rank + 1.0] * 2  # input left as it was
    torch.library.opcheck(torch.ops.autodeploy.tp_all_reduce, (torch.randn(3, 4), world_group_name()))
    rows = rows_from_rank0(torch.full((3, 4), float(rank)))
    assert rows.tolist() == [[0.0] * 4] * 3  # every rank samples from rank 0's rows
    return 10 if is_rank0() else 0


# ----------------------------------------------------------------------------- GPU (2 x H200, NCCL, bf16)
GPU_RUNTIME = ["runtime.max_num_tokens=64", "runtime.page_size=64", "runtime.max_seq_len=256",
               "runtime.max_batch_size=8", "model.dtype=bfloat16"]


@pytest.mark.gpu
@pytest.mark.skipif(torch.cuda.device_count() < 2, reason="needs 2 CUDA GPUs")
def test_gpu_two_ranks_nccl_bf16():
    """2 ranks over NCCL in bf16 (default backends, piecewise CUDA graphs on): ranks agree exactly;
    logits match the single-GPU optimized model within bf16 tolerance; the first greedy token of every
    prompt equals the single GPU's unless the two candidates are a near-tie in the single GPU's own
    logits (random tiny models have them; 16-bit rounding may flip those and later tokens)."""
    jobs = [
        ProbeJob("ds3", "deepseek_v3", GPU_RUNTIME, PROMPTS, NEW, LOGITS_PROMPT),
        ProbeJob("glm", "glm_4_7_flash", GPU_RUNTIME, PROMPTS, NEW, LOGITS_PROMPT),
        ProbeJob("glm_nccl", "glm_4_7_flash", [*GPU_RUNTIME, "transforms.shard.all_reduce=nccl"], PROMPTS, NEW,
                 LOGITS_PROMPT),
    ]
    ranks = spawn(probe_rank, 2, jobs, backend="nccl", all_results=True)
    failures = []
    for job in jobs:
        r0, r1 = ranks[0][job.name], ranks[1][job.name]
        assert r0["device"] == "cuda:0" and r1["device"] == "cuda:1"
        assert r0["env"] == MULTICAST_OFF_ENV
        assert r0["tokens"] == r1["tokens"]
        assert torch.equal(r0["logits"], r1["logits"])
        assert all(lay["dims"]["num_heads"] == 2 for lay in r0["layers"])
        want = "nccl" if "nccl" in job.name else "one_shot (symmetric memory)"
        assert r0["tp_all_reduce"].startswith(want), r0["tp_all_reduce"]
        single = optimize(job.model, overrides=[*job.overrides, "model.device=cuda:0"])
        ref = single.generate(PROMPTS, max_new_tokens=NEW)
        ref_logits = single.prefill_logits(LOGITS_PROMPT).float().cpu()
        per_pos = (r0["logits"] - ref_logits).abs().amax(-1) / ref_logits.abs().max()
        rel = per_pos.max()
        prefix = [next((i for i, (a, b) in enumerate(zip(x, y)) if a != b), NEW) for x, y in zip(r0["tokens"], ref)]
        gaps, errs = [], []  # per prompt, relative to max |logit|: single-GPU logit of its own first
        # token minus that of the 2-rank first token; the 2-rank row's error against the single GPU's
        for p, ours, theirs, tp_row in zip(PROMPTS, r0["tokens"], ref, r0["first_logits"]):
            row = single.prefill_logits(p)[-1].float().cpu()
            scale = float(row.abs().max())
            errs.append(float((tp_row - row).abs().max()) / scale)
            gaps.append(float(row[theirs[0]] - row[ours[0]]) / scale)
        print(f"{job.name}: backends {[lay['backend'] for lay in r0['layers']]}, logits rel err {rel:.2e} "
              f"(per position {[f'{e:.1e}' for e in per_pos.tolist()]}), "
              f"agreeing prefix {prefix}, first-token gaps {[f'{g:.1e}' for g in gaps]} / row errors "
              f"{[f'{e:.1e}' for e in errs]} (of max |logit|)")
        if rel >= 3e-2 or max(errs) >= 3e-2:
            failures.append(f"{job.name}: logits rel err {rel:.2e}, first-token rows {errs}")
        # A flip is a near-tie only if the measured error of that row (x2: both logits move) covers the gap.
        failures += [f"{job.name} prompt {i}: first token {r0['tokens'][i][0]} vs {ref[i][0]}, gap {g:.2e}"
                     for i, (g, e) in enumerate(zip(gaps, errs)) if g > max(1e-2, 2 * e)]
        del single
    assert not failures, failures


def _one_shot_op_rank(rank: int) -> dict:
    """One rank of test_gpu_one_shot_all_reduce_op: the op with a symmetric workspace active."""
    from autodeploy_mla.custom_ops.attention.step_context import using_sessions
    from autodeploy_mla.custom_ops.tp_all_reduce import WORKSPACE, SymmAllReduceWorkspace
    from autodeploy_mla.distributed.env import world_group_name

    dev = torch.device("cuda", rank)
    group = world_group_name()
    ws = SymmAllReduceWorkspace(group, dev, 1 << 16)
    out: dict = {}
    with using_sessions({WORKSPACE: ws}):
        for dtype in (torch.bfloat16, torch.float32):
            g = torch.Generator(device=dev).manual_seed(rank)
            x = torch.randn(8, 256, device=dev, dtype=dtype, generator=g)
            before = x.clone()
            y = torch.ops.autodeploy.tp_all_reduce(x, group)
            torch.cuda.synchronize(dev)
            out[str(dtype)] = (x.cpu(), y.cpu(), torch.equal(x, before))
        calls = ws.calls
        # schema, fake tensor, autograd registration and the dispatch tests, on the one-shot path
        torch.library.opcheck(torch.ops.autodeploy.tp_all_reduce,
                              (torch.randn(4, 64, device=dev, dtype=torch.bfloat16), group))
        out["calls"] = (calls, ws.calls)
    return out


@pytest.mark.gpu
@pytest.mark.skipif(torch.cuda.device_count() < 2, reason="needs 2 CUDA GPUs")
def test_gpu_one_shot_all_reduce_op():
    """`autodeploy::tp_all_reduce` on its one-shot path (symmetric memory, 2 GPUs): the sum of both
    ranks' inputs in bf16 and fp32 (within one rounding of the fp32 sum), inputs untouched, the path
    taken (workspace call count), and `torch.library.opcheck` passing on it."""
    ranks = spawn(_one_shot_op_rank, 2, backend="nccl", all_results=True)
    for dtype in (torch.bfloat16, torch.float32):
        xs = [r[str(dtype)][0] for r in ranks]
        want = (xs[0].float() + xs[1].float())
        for r in ranks:
            x, y, untouched = r[str(dtype)]
            assert untouched and y.dtype == dtype
            tol = 1e-6 if dtype == torch.float32 else 8e-3
            assert (y.float() - want).abs().max() <= tol * want.abs().max(), dtype
        assert torch.equal(ranks[0][str(dtype)][1], ranks[1][str(dtype)][1])  # both ranks hold the same sum
    for r in ranks:
        before, after = r["calls"]
        assert before == 2 and after > before, r["calls"]


@pytest.mark.gpu
@pytest.mark.skipif(torch.cuda.device_count() < 2, reason="needs 2 CUDA GPUs")
def test_gpu_cli_world_size_2(tmp_path):
    report = tmp_path / "r.json"
    rc = main(["build", "--world-size", "2", "--max-new-tokens", "4", "--report", str(report),
               "--set", "runtime.max_num_tokens=64", "--set", "runtime.max_seq_len=256"])
    assert rc == 0
    rep = json.loads(report.read_text())
    assert rep["device"].startswith("cuda") and rep["verification"]["ok"]


def test_multicast_off_variables_are_forced():
    """The launcher's multicast-off variables are forced, not defaulted (a user's =1 is overridden)."""
    from autodeploy_mla.distributed.env import disable_multicast_env

    env = {"NCCL_NVLS_ENABLE": "1"}
    disable_multicast_env(env)
    assert env == MULTICAST_OFF_ENV
