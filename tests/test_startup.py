"""Start-up (issue 42, item 2): compile groups, persistent compile caches, warm-up captures, the report.

- Static pieces that are the same graph share one compiled callable (identical layers do; a dense and
  a MoE layer, or pieces that differ in a constant, a weight shape or dtype, do not), the outputs
  stay bit-identical to the flat graph in fp32, and Dynamo compiles once per group (twice with a
  one-token step, which it always specialises).
- Which static-piece inputs vary with the token count is derived exactly (not from "dims equal to T").
- The compile-cache directory: AUTODEPLOY_CACHE_DIR wins, XDG / home defaults, `off`, a variable the
  user set wins, the key changes with any version.
- Warm-up skips piecewise captures of mixed-graph buckets no step can run piecewise, and keeps them
  where a backend may decline a step; the startup report has every phase.
"""

from __future__ import annotations

import copy
import dataclasses
import itertools
import json
from pathlib import Path

import pytest
import torch

from autodeploy_mla.api import optimize
from autodeploy_mla.custom_ops import MLADims
from autodeploy_mla.custom_ops.attention.registry import DeviceInfo
from autodeploy_mla.custom_ops.triton_mla.tuning import (STATIC_MAX_EXTRA_FLOPS, max_static_bounds_extra_flops,
                                                         static_bounds_extra_flops)
from autodeploy_mla.runtime.compile_cache import (CACHE_DIR_ENV, VARS_SET_ENV, cache_key, cache_key_parts,
                                                  configure_compile_caches, custom_ops_digest)
from autodeploy_mla.runtime.piece_groups import canonicalize, group_pieces
from autodeploy_mla.runtime.piecewise import STATIC, PiecewiseRunner
from autodeploy_mla.runtime.sequence_info import StepSequence
from autodeploy_mla.testing.tiny_configs import TINY_CONFIGS

RUNTIME = {"max_batch_size": 4, "max_seq_len": 64, "max_num_tokens": 8, "page_size": 4}
# (seq_id, new tokens, cached): prefill, chunked prefill, mixed steps of 2..8 tokens
STEPS = [
    [(0, 5, 0), (1, 3, 0)],
    [(0, 1, 5), (1, 1, 3), (2, 4, 0)],
    [(0, 1, 6), (2, 2, 4)],
]
ONE_TOKEN = [[(0, 1, 7)]]


def _build(family: str, layers: int, compile: str = "none", **hf):
    cfg = copy.deepcopy(TINY_CONFIGS[family])
    cfg.update(num_hidden_layers=layers, **hf)
    return optimize(None, {"model": {"hf_config": cfg}, "runtime": RUNTIME,
                           "transforms": {"piecewise": {"enabled": True, "on_cpu": True, "compile": compile}}})


def _run(om, schedule, piecewise=True, seed=0):
    """Logits of each step of `schedule` (copies), through the split runner (or the given one), or the
    flat graph (piecewise=False)."""
    mr = om.runner
    for c in mr.caches.caches.values():
        c.zero_()
    g = torch.Generator().manual_seed(seed)
    saved = mr.piecewise
    if piecewise is not True:
        mr.piecewise = piecewise or None
    outs = []
    try:
        for step in schedule:
            om.allocator.ensure_many({sid: n + cached for sid, n, cached in step})
            seqs = [StepSequence(sid, torch.randint(0, om.vocab_size, (n,), generator=g).tolist(), cached)
                    for sid, n, cached in step]
            _, logits = mr.forward(seqs, om.allocator.pages_of)
            outs.append(logits[0, :mr.seq_info.num_tokens].clone())
    finally:
        mr.piecewise = saved
        for sid in {s for step in schedule for s, _, _ in step}:
            om.allocator.free(sid)
    return outs


# ----------------------------------------------------------------------------- compile groups
@pytest.fixture(scope="module")
def v3_dense2():
    """Tiny DeepSeek-V3, 4 layers, the first two dense: static pieces 0 (embedding + layer 0 pre-attention),
    2 and 4 (a dense tail + the next pre-attention: the same graph), 6 (the MoE tail), 8 (final norm + head)."""
    return _build("deepseek_v3", 4, "aot_eager", first_k_dense_replace=2)


def test_identical_layers_share_one_compiled_graph_and_compile_once(v3_dense2):
    from torch._dynamo.utils import counters

    om = v3_dense2
    pw = om.runner.piecewise
    assert [g.pieces for g in pw.split.groups] == [(0,), (2, 4), (6,), (8,)]
    assert [cg.group.pieces for cg in pw.compiled] == [(0,), (2, 4), (6,), (8,)]
    # each piece calls its group's one callable with its own weights
    members = {i: pw.eager_module.get_submodule(f"submod_{i}") for i in (2, 4)}
    assert members[2].group is members[4].group
    assert {t.data_ptr() for t in members[2].params}.isdisjoint(t.data_ptr() for t in members[4].params)

    graphs0 = counters["stats"]["unique_graphs"]
    flat = _run(om, STEPS, piecewise=False)
    got = _run(om, STEPS)
    for a, b in zip(flat, got):
        assert torch.equal(a, b), (a - b).abs().max()
    # one compile per group across token counts 8, 7, 3: dynamic in T from the first compile
    assert [cg.stats.compiles for cg in pw.compiled] == [1, 1, 1, 1]
    assert counters["stats"]["unique_graphs"] - graphs0 == 4  # Dynamo's own count agrees
    for cg in pw.compiled:  # what was named dynamic: only token dims and token-derived ints
        assert cg.stats.dynamic_sources and all(s.endswith(":1") or ":" not in s
                                                for s in cg.stats.dynamic_sources.split(","))
    # a one-token step: Dynamo specialises size 1, one more compile per group at most
    assert torch.equal(_run(om, ONE_TOKEN, piecewise=False)[0], _run(om, ONE_TOKEN)[0])
    assert all(cg.stats.compiles <= 2 for cg in pw.compiled)
    # recorded in the pass report, the pieces report and the runner summary
    rec = next(r for r in om.history if r.name == "piecewise")
    assert "5 static in 4 compile groups" in rec.summary
    assert [g["pieces"] for g in rec.details["compile_groups"]] == [[0], [2, 4], [6], [8]]
    pieces = om.report()["pieces"]
    assert [e.get("compile_group") for e in pieces if e["kind"] == STATIC] == [0, 1, 1, 2, 3]
    summary = pw.summary()["compile_groups"]
    assert [g["compiles"] for g in summary] == [cg.stats.compiles for cg in pw.compiled]


def test_token_dims_are_derived_exactly(v3_dense2):
    """Every static-piece input's token dependence is derived (export metadata, or the attention op
    run on fake tensors at two token counts), and only the token dim varies: tiny hidden/head sizes
    equal to a step's token count (8) are not mistaken for it."""
    pw = v3_dense2.runner.piecewise
    assert pw.token_dims_note == "every static piece input derived"
    for cg in pw.compiled:
        dims = cg.token_dims
        assert dims is not None and not dims.unknown
        assert dims.tensors and all(ds == (1,) for _, ds in dims.tensors)  # [1, T, ...] activations
    first = pw.compiled[0].token_dims  # piece 0 takes input_ids and position_ids, [1, T] each
    assert first.tensors == ((0, (1,)), (1, (1,)))


def test_dynamic_tokens_off_leaves_dynamism_to_dynamo(v3_dense2):
    """`dynamic_tokens: false` (A/B switch): nothing named, Dynamo specialises the first token count
    and compiles again, dynamic, at the second (Dynamo's `eager` backend: tracing only, cheap)."""
    om = v3_dense2
    runner = PiecewiseRunner(om.runner.piecewise.split, om.device, om.seq_info.max_num_tokens, compile="eager",
                             cuda_graphs=False, dynamic_tokens=False)
    _run(om, STEPS, piecewise=runner)
    assert [cg.stats.compiles for cg in runner.compiled] == [2, 2, 2, 2]
    assert all(cg.token_dims is None and cg.stats.dynamic_sources is None for cg in runner.compiled)
    assert "dynamic_tokens: false" in runner.token_dims_note


def test_moe_layers_share_and_differing_pieces_do_not():
    """DeepSeek-V2 tiny, 5 layers (layer 0 dense, 1-4 MoE): the first MoE tail computes the routing
    sizes the later ones receive (a different graph), the middle MoE tails share, and the one before
    the last, which does not hand the rotary table on, joins them returning the leading outputs."""
    om = _build("deepseek_v2", 5)
    split = om.runner.piecewise.split
    groups = split.groups
    assert [g.pieces for g in groups] == [(0,), (2,), (4,), (6, 8), (10,)]
    shared = groups[3]
    n_out = len(next(n for n in split.canonical[6].gm.graph.nodes if n.op == "output").args[0])
    assert shared.keep(6) is None and shared.keep(8) == n_out - 1
    assert shared.to_dict()["keeps_first_outputs"] == {"8": n_out - 1}
    sub8 = split.module.get_submodule("submod_8")
    rep = split.canonical[6]
    member = split.canonical[8]
    assert member.key == rep.key and member.outputs == rep.outputs[:-1]
    assert len(sub8.graph.find_nodes(op="output")[0].args[0]) == n_out - 1
    # compiled (Dynamo's `eager` backend: tracing only, cheap), the trimmed member gives the flat graph's logits
    runner = PiecewiseRunner(split, om.device, om.seq_info.max_num_tokens, compile="eager", cuda_graphs=False)
    flat = _run(om, STEPS[:2], piecewise=False)
    got = _run(om, STEPS[:2], piecewise=runner)
    assert all(torch.equal(a, b) for a, b in zip(flat, got))
    assert [cg.stats.compiles for cg in runner.compiled] == [1] * 5


def _graph(eps: float = 1e-6, weight=None, extra_output: bool = False, op=torch.ops.aten.mul.Tensor):
    """A tiny static piece: rms-norm-like ops on x with one weight attribute."""
    g = torch.fx.Graph()
    x = g.placeholder("x")
    w = g.get_attr("w")
    sq = g.call_function(torch.ops.aten.pow.Tensor_Scalar, (x, 2))
    m = g.call_function(torch.ops.aten.mean.dim, (sq, [-1], True))
    r = g.call_function(torch.ops.aten.rsqrt.default, (g.call_function(torch.ops.aten.add.Tensor, (m, eps)),))
    y = g.call_function(op, (g.call_function(torch.ops.aten.mul.Tensor, (x, r)), w))
    g.output((y, sq) if extra_output else (y,))
    root = torch.nn.Module()
    root.register_parameter("w", torch.nn.Parameter(torch.randn(8) if weight is None else weight))
    return torch.fx.GraphModule(root, g)


def test_canonical_key_separates_pieces_that_differ():
    base = [_graph(), _graph()]
    differ = [
        _graph(eps=1e-5),                                   # a constant
        _graph(weight=torch.randn(16)),                      # a weight shape
        _graph(weight=torch.randn(8, dtype=torch.float64)),  # a weight dtype
        _graph(op=torch.ops.aten.add.Tensor),                # an op
    ]
    prefix = [_graph(extra_output=True)]  # same body, one more output: the others return its first
    pieces = list(enumerate(canonicalize(gm) for gm in [*base, *differ, *prefix]))
    groups = group_pieces(pieces)
    assert [g.pieces for g in groups] == [(6, 0, 1), (2,), (3,), (4,), (5,)]
    assert groups[0].keep(6) is None and groups[0].keep(0) == 1
    # weights are explicit inputs: the canonical graph computes the piece with any member's weights
    x = torch.randn(3, 8)
    for gm in base:
        cp = canonicalize(gm)
        assert [n.target for n in cp.gm.graph.nodes if n.op == "placeholder"] == ["x0", "w0"]
        assert torch.equal(cp.gm(x, *cp.params)[0], gm(x)[0])
        assert cp.params[0] is gm.w  # the piece's own tensor, not a copy
    # an attribute that is not a tensor (or a submodule) is keyed by identity: never shared
    a, b = _graph(), _graph()
    for gm in (a, b):
        gm.add_submodule("act", torch.nn.SiLU())
        out = next(n for n in gm.graph.nodes if n.op == "output")
        with gm.graph.inserting_before(out):
            act = gm.graph.call_module("act", (out.args[0][0],))
        out.args = ((act,),)
        gm.recompile()
    assert len(group_pieces(list(enumerate(canonicalize(gm) for gm in (a, b))))) == 2


# ----------------------------------------------------------------------------- compile caches
def test_cache_dir_resolution(tmp_path):
    cpu = torch.device("cpu")
    env = {"HOME": str(tmp_path / "home")}
    c = configure_compile_caches(cpu, env)
    root = tmp_path / "home" / ".cache" / "autodeploy-mla"
    assert c.root == str(root) and c.root_source == "home"
    base = root / c.key
    assert env["TORCHINDUCTOR_CACHE_DIR"] == str(base / f"inductor-{custom_ops_digest()}")
    assert env["TRITON_CACHE_DIR"] == str(base / "triton")
    assert set(env[VARS_SET_ENV].split(",")) >= {"TORCHINDUCTOR_CACHE_DIR", "TRITON_CACHE_DIR"}
    assert c.setting("inductor").source == "autodeploy" and c.fx_graph_cache and c.autograd_cache
    fi = c.setting("flashinfer")
    if c.key_parts["flashinfer"] == "none":
        assert fi.source == "not installed" and "FLASHINFER_WORKSPACE_BASE" not in env
    else:
        assert env["FLASHINFER_WORKSPACE_BASE"] == str(base / "flashinfer") or fi.source == "fixed at import"
    # a second build in the same process keeps its own settings, and says so
    again = configure_compile_caches(cpu, env)
    assert again.setting("inductor").source == "autodeploy (already set)"
    # XDG, then AUTODEPLOY_CACHE_DIR, win over the home default
    assert configure_compile_caches(cpu, {"XDG_CACHE_HOME": str(tmp_path / "x")}).root == str(tmp_path / "x" /
                                                                                              "autodeploy-mla")
    env2 = {"XDG_CACHE_HOME": str(tmp_path / "x"), CACHE_DIR_ENV: str(tmp_path / "mine")}
    assert configure_compile_caches(cpu, env2).root == str(tmp_path / "mine")
    # a variable the user set wins and is reported as theirs
    env3 = {CACHE_DIR_ENV: str(tmp_path / "mine"), "TRITON_CACHE_DIR": "/somewhere/triton"}
    c3 = configure_compile_caches(cpu, env3)
    assert env3["TRITON_CACHE_DIR"] == "/somewhere/triton" and c3.setting("triton").source == "user"
    assert "TRITON_CACHE_DIR" not in env3[VARS_SET_ENV]
    # off: nothing set
    for off in ("off", "OFF", "0", "none"):
        env4 = {CACHE_DIR_ENV: off, "HOME": str(tmp_path)}
        c4 = configure_compile_caches(cpu, env4)
        assert not c4.enabled and set(env4) == {CACHE_DIR_ENV, "HOME"} and "off" in c4.summary()
    json.dumps(c.to_dict())


def test_cache_key_changes_with_every_version():
    dev = DeviceInfo("cuda", (9, 0), "NVIDIA H200", 132)
    base = cache_key(cache_key_parts(dev))
    assert "sm90" in base and "NVIDIA_H200" in base and "/" not in base
    for part in ("torch", "triton", "flashinfer", "transformers", "cuda", "python"):
        assert cache_key(cache_key_parts(dev, {part: "9.9.9-other"})) != base, part
    assert cache_key(cache_key_parts(DeviceInfo("cuda", (10, 0), "NVIDIA B200", 148))) != base
    assert cache_key(cache_key_parts(DeviceInfo("cpu"))) != base


def test_custom_ops_digest_follows_the_sources(tmp_path):
    (tmp_path / "a.py").write_text("x = 1\n")
    (tmp_path / "sub").mkdir()
    (tmp_path / "sub" / "b.py").write_text("y = 2\n")
    d0 = custom_ops_digest(tmp_path)
    assert d0 == custom_ops_digest(tmp_path)
    (tmp_path / "sub" / "b.py").write_text("y = 3\n")
    assert custom_ops_digest(tmp_path) != d0


# ----------------------------------------------------------------------------- captures
def test_static_bounds_bound_is_exact_and_covers_multi_sequence_steps():
    """max_static_bounds_extra_flops equals the brute-force maximum over every step of up to n new
    prefill tokens, any split over sequences, any prefix (small sizes, real-model head dims)."""
    dims = MLADims(16, 128, 64, 128, 512)
    seq_len = 10
    for n in (1, 2, 4):
        best = 0.0  # no prefill part at all
        for k in range(1, n + 1):
            for ts in itertools.product(range(1, n + 1), repeat=k):
                if sum(ts) > n:
                    continue
                for ps in itertools.product(*[range(0, seq_len - t + 1) for t in ts]):
                    pairs = sum(t * p + t * (t + 1) // 2 for t, p in zip(ts, ps))
                    best = max(best, static_bounds_extra_flops(dims, sum(ts), sum(ps), pairs))
        assert max_static_bounds_extra_flops(dims, n, seq_len) == pytest.approx(best), n
    # DeepSeek-V2-Lite dims at max_seq_len 4096: chunks of 128+ tokens on long prefixes cost more absorbed
    assert max_static_bounds_extra_flops(dims, 64, 4096) <= STATIC_MAX_EXTRA_FLOPS
    assert max_static_bounds_extra_flops(dims, 128, 4096) > STATIC_MAX_EXTRA_FLOPS


def test_triton_session_says_which_buckets_it_may_decline():
    pytest.importorskip("triton")
    from autodeploy_mla.custom_ops import Target, get_backend
    from autodeploy_mla.custom_ops.attention.registry import SessionSpec
    from autodeploy_mla.custom_ops.triton_mla import TritonPolicy

    dims = MLADims(16, 128, 64, 128, 512)
    spec = SessionSpec((dims,), torch.bfloat16, torch.device("cpu"), Target.detect("cpu", 64), 8, 256, 64,
                       (torch.bfloat16,), (0,))
    be = get_backend("triton")
    auto = be.setup(spec, TritonPolicy())
    assert not auto.may_decline_static_bounds(64, 4096) and auto.may_decline_static_bounds(128, 4096)
    assert not auto.may_decline_static_bounds(256, 512)  # short sequences: no long-prefix chunk exists
    assert not be.setup(spec, TritonPolicy(prefill_mode="absorb")).may_decline_static_bounds(256, 4096)
    assert be.setup(spec, TritonPolicy(prefill_mode="expand")).may_decline_static_bounds(1, 4096)


def test_warmup_captures_pieces_of_mixed_buckets_only_where_a_step_can_run_them(monkeypatch):
    """A mixed-graph bucket's pieces are warmed (captured) only where some session may decline one
    of its steps; decode and prefill steps of every bucket are warmed as before."""
    from autodeploy_mla.custom_ops.attention.registry import BackendSession
    from autodeploy_mla.runtime.model_runner import ModelRunner

    om = _build("deepseek_v3", 1)
    mr = om.runner
    seen = []
    monkeypatch.setattr(ModelRunner, "capture_buckets", property(lambda self: (1, 2, 4, 8)))
    monkeypatch.setattr(ModelRunner, "_warm_step", lambda self, kind, n, mixed_graph=True: seen.append(
        ("piecewise" if not mixed_graph else kind, n)))
    monkeypatch.setattr(mr.piecewise, "mixed_graph_max_tokens", 4)

    class Declines(BackendSession):  # declines steps of 4+ tokens (long-prefix chunks)
        def may_decline_static_bounds(self, num_tokens, max_seq_len):
            return num_tokens >= 4

    monkeypatch.setitem(mr.sessions, "test", Declines(None))
    mr.warmup_report = None
    rep = mr.warmup()
    assert ("piecewise", 4) in seen and ("piecewise", 2) not in seen and ("piecewise", 1) not in seen
    assert ("piecewise", 8) not in seen  # above mixed_graph_max_tokens its prefill step runs piecewise anyway
    assert [k for k in rep["not_needed"]] == ["piecewise:2", "piecewise:1"]
    assert {("decode", 4), ("decode", 2), ("decode", 1), ("prefill", 8), ("prefill", 1)} <= set(seen)
    assert set(rep["step_seconds"]) == {f"{k}:{n}" for k, n in seen}
    assert mr.piecewise.mixed_graph_max_tokens == 4  # the warm-up describes steps; it never flips the config


# ----------------------------------------------------------------------------- the report
def test_startup_report_has_every_phase(v3_dense2):
    om = v3_dense2
    om.warmup()
    st = om.startup()
    d = om.report()["startup"]
    assert d == json.loads(json.dumps(d))  # plain data: the server logs it as it is
    assert set(d) == {"caches", "load", "passes", "runner", "compile", "capture", "warmup", "total_seconds"}
    assert d["load"]["what"] == "config (random weights)" and d["load"]["seconds"] > 0
    assert set(d["passes"]["per_pass"]) == {r.name for r in om.history if r.enabled}
    assert d["compile"]["backend"] == "aot_eager" and d["compile"]["groups"] == 4 and d["compile"]["pieces"] == 5
    assert d["compile"]["compiles"] == sum(g["compiles"] for g in d["compile"]["per_group"])
    assert set(d["capture"]["count"]) == {"decode_graph", "mixed_graph", "piecewise"}  # CPU: none captured
    assert d["warmup"]["seconds"] is not None and d["caches"]["key"]
    assert st.total_seconds == pytest.approx(st.load_seconds + st.passes_seconds + st.runner_seconds +
                                             st.warmup_seconds)
    lines = st.lines()
    assert any(line.startswith("compile (aot_eager): 5 static pieces in 4 groups") for line in lines)
    assert any(line.startswith("warm-up") for line in lines) and any("compile caches" in line for line in lines)
    assert not any("more than 2 compiles" in line for line in lines)
    worse = dataclasses.replace(st, compile=dataclasses.replace(
        st.compile, per_group=({"group": 1, "pieces": [2, 4], "compiles": 5},)))
    assert any("more than 2 compiles in group(s) 1 (pieces [2, 4]: 5)" in line for line in worse.lines())
    assert Path(d["caches"]["root"]).name == "autodeploy-mla" or d["caches"]["root_source"] == CACHE_DIR_ENV


# ----------------------------------------------------------------------------- GPU
@pytest.mark.gpu
def test_gpu_inductor_groups_compile_at_most_twice_and_requests_pay_no_capture():
    """On CUDA with Inductor: the grouped pieces compile at most twice per group over a whole warm-up
    (dynamic in T, plus T = 1), replay correctly, and generation after the warm-up neither compiles nor
    captures (every step's graph was captured by the warm-up)."""
    cfg = copy.deepcopy(TINY_CONFIGS["deepseek_v3"])
    cfg.update(num_hidden_layers=4, first_k_dense_replace=2)
    om = optimize(None, {
        "model": {"hf_config": cfg, "device": "cuda", "dtype": "bfloat16"},
        "runtime": {"max_batch_size": 8, "max_seq_len": 64, "max_num_tokens": 16, "page_size": 4, "num_pages": 64},
        "transforms": {"piecewise": {"enabled": True, "compile": "inductor", "buckets": [1, 2, 4, 8, 16]}},
    })
    om.warmup()
    st = om.startup()
    assert st.compile.groups == 4 and all(g["compiles"] <= 2 for g in st.compile.per_group), st.compile
    assert st.capture.total > 0 and not any(st.capture.failed.values()), st.capture
    assert not om.runner.piecewise.failures
    compiles, captures = st.compile.compiles, st.capture.total
    prompts = [[5, 6, 7], [3, 4], [9, 8, 7, 6, 5, 4, 3, 2, 1, 11, 12], [42]]
    got = om.generate(prompts, max_new_tokens=8)
    after = om.startup()
    assert (after.compile.compiles, after.capture.total) == (compiles, captures), after.to_dict()
    om.runner.piecewise = None  # the flat graph, eager: the same greedy tokens at least at the first step
    ref = om.generate(prompts, max_new_tokens=8)
    assert [g[0] for g in got] == [r[0] for r in ref]
