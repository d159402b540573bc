"""Piecewise split + runner (issue 6).

CPU: splitting changes nothing (split vs flat graph over mixed prefill/decode steps, bit-identical),
every registered cached op is a split point (by op identity, not by name), L MLA layers give
S D S D ... S pieces, generation through the split model equals HF eager greedy, bucket padding.
GPU (marked): CUDA-graph replay vs eager across steps of changing composition, unseen buckets,
the whole-graph decode graph, capture failure fallback.
"""

from __future__ import annotations

import copy

import pytest
import torch

from autodeploy_mla.api import build_config, optimize
from autodeploy_mla.custom_ops import Target, all_backends, cached_ops, get_backend
from autodeploy_mla.testing.tiny_configs import TINY_CONFIGS
from autodeploy_mla.runtime.cuda_graphs import BORROW, BORROW_OWNED, OWNED, CapturedGraph
from autodeploy_mla.runtime.piecewise import DYNAMIC, STATIC, PiecewiseRunner, _mutation_reason, bucket_for, resolve_buckets
from autodeploy_mla.runtime.sequence_info import SequenceInfo, StepSequence
from autodeploy_mla.testing import hf_greedy_generate
from autodeploy_mla.transforms.piecewise import PiecewiseError, split_graph, split_point_ops

RUNTIME = {"max_batch_size": 4, "max_seq_len": 64, "max_num_tokens": 8, "page_size": 4}


def _hf(layers: int) -> dict:
    cfg = copy.deepcopy(TINY_CONFIGS["deepseek_v3"])
    cfg["num_hidden_layers"] = layers
    return cfg


def build(layers: int = 4, device: str = "cpu", dtype: str = "float32", runtime=None, **piecewise):
    pw = {"enabled": True, "on_cpu": True, **piecewise}
    return optimize(None, {
        "model": {"hf_config": _hf(layers), "device": device, "dtype": dtype},
        "runtime": {**RUNTIME, **(runtime or {})},
        "transforms": {"piecewise": pw},
    })


@pytest.fixture(scope="module")
def om4():
    return build(4)


# Steps of (seq_id, new tokens, tokens already cached): prefill, chunked prefill, mixed, decode,
# sequences finishing and new ones arriving.
SCHEDULE = [
    [(0, 5, 0), (1, 3, 0)],
    [(0, 1, 5), (1, 1, 3), (2, 6, 0)],
    [(0, 1, 6), (1, 1, 4), (2, 2, 6), (3, 4, 0)],
    [(0, 1, 7), (1, 1, 5), (2, 1, 8), (3, 1, 4)],
    [(1, 1, 6), (2, 1, 9), (3, 1, 5)],
    [(2, 1, 10), (3, 1, 6), (4, 5, 0)],
    [(2, 1, 11), (4, 1, 5)],
]


def kinds(split):
    return [p.kind for p in split.pieces]


def run_steps(om, piecewise, schedule=SCHEDULE, seed=0):
    """Drive the model runner through `schedule` on fresh caches with `piecewise` as its step runner
    (None: the flat graph, unpadded); returns logits [T, V] per step (copies)."""
    mr = om.runner
    for c in mr.caches.caches.values():
        c.zero_()
    g = torch.Generator().manual_seed(seed)
    vocab = om.vocab_size
    alloc = om.allocator
    outs = []
    saved, mr.piecewise = mr.piecewise, piecewise
    try:
        for step in schedule:
            alloc.ensure_many({sid: n + cached for sid, n, cached in step})
            seqs = [StepSequence(sid, torch.randint(0, vocab, (n,), generator=g).tolist(), cached)
                    for sid, n, cached in step]
            _, logits = mr.forward(seqs, alloc.pages_of)
            t = mr.seq_info.num_tokens
            outs.append(logits[0, :t].float().clone())
    finally:
        mr.piecewise = saved
        for sid in {s for step in schedule for s, _, _ in step}:
            alloc.free(sid)
    return outs


# ----------------------------------------------------------------------------- CPU
def test_split_equals_flat_graph_over_mixed_steps(om4):
    pw = om4.runner.piecewise
    assert isinstance(pw, PiecewiseRunner)
    flat = run_steps(om4, None)
    split = run_steps(om4, pw)
    for a, b in zip(flat, split):
        assert torch.equal(a, b), (a - b).abs().max()
    assert pw.stats["eager"] == len(SCHEDULE)  # CPU: no graphs, every piece eager


@pytest.mark.parametrize("layers", [1, 4])
def test_pieces_alternate_static_dynamic(layers, om4):
    om = om4 if layers == 4 else build(layers)
    split = om.runner.piecewise.split
    assert kinds(split) == [STATIC, DYNAMIC] * layers + [STATIC]
    dyn = [p for p in split.pieces if p.kind == DYNAMIC]
    assert [p.backends for p in dyn] == [["torch"]] * layers
    assert [p.nodes for p in dyn] == [1] * layers
    # the report api.py shows: one entry per piece, nothing captured on CPU
    rep = om.report()["pieces"]
    assert [(e["index"], e["kind"]) for e in rep] == [(p.index, p.kind) for p in split.pieces]
    assert all(e["captured"] == {"piecewise": [], "decode_graph": [], "mixed_graph": []} for e in rep)
    # the torch reference op reads host sizes: no whole-graph decode graph with it
    assert not split.decode_graph_safe and "torch" in split.decode_graph_reason


def test_generation_token_identical_to_hf_eager(om4):
    prompts = [[5, 6, 7], [3, 4], [9, 8, 7, 6, 5, 4, 3, 2, 1, 11, 12], [42]]
    got = om4.generate(prompts, max_new_tokens=7)
    assert om4.runner.piecewise.stats["eager"] > 0
    for p, g in zip(prompts, got):
        assert g == hf_greedy_generate(om4.eager_model, p, 7)


def test_padded_buckets_keep_generation_identical(om4, monkeypatch):
    """Token buckets (what CUDA graphs use) pad steps: dummy decode seqs / ignored tokens are harmless."""
    prompts = [[5, 6, 7], [3, 4], [9, 8, 7, 6, 5, 4, 3, 2, 1, 11, 12]]
    monkeypatch.setattr(PiecewiseRunner, "capture_buckets", property(lambda self: (2, 4, 8)))
    padded = []
    orig = om4.runner.prepare

    def spy(*a, **k):
        out = orig(*a, **k)
        padded.append(om4.seq_info.num_padded_tokens - om4.seq_info.num_tokens)
        return out

    monkeypatch.setattr(om4.runner, "prepare", spy)
    got = om4.generate(prompts, max_new_tokens=5)
    assert any(padded)  # some steps really were padded
    for p, g in zip(prompts, got):
        assert g == hf_greedy_generate(om4.eager_model, p, 5)


def _graph_with(op, n_args: int) -> torch.fx.GraphModule:
    g = torch.fx.Graph()
    xs = [g.placeholder(f"a{i}") for i in range(n_args)]
    pre = g.call_function(torch.ops.aten.add.Tensor, (xs[0], 1.0))
    out = g.call_function(op, (pre, *xs[1:]))
    post = g.call_function(torch.ops.aten.mul.Tensor, (out, 2.0))
    g.output((post,))
    return torch.fx.GraphModule(torch.nn.Module(), g)


@pytest.mark.parametrize("name", sorted(all_backends()))
def test_every_registered_cached_op_is_a_split_point(name):
    """Fails when a backend's cached op would not be split at (e.g. is_dynamic turned off)."""
    be = get_backend(name)
    assert be.is_dynamic, f"backend {name!r}: a cached MLA op must be a piecewise split point"
    op = be.cached_op.default
    assert op in cached_ops() and op in split_point_ops()
    split = split_graph(_graph_with(op, len(op._schema.arguments)))
    assert kinds(split) == [STATIC, DYNAMIC, STATIC]
    assert split.pieces[1].ops == [str(op)] and split.pieces[1].backends == [name]
    assert split.decode_graph_safe == be.decode_graph_safe
    assert split.mixed_graph_safe == be.mixed_graph_safe


def test_split_points_are_found_by_identity_not_name():
    @torch.library.custom_op("autodeploy_test::lookalike_mla_with_cache", mutates_args=())
    def lookalike(x: torch.Tensor) -> torch.Tensor:
        return x.clone()

    op = torch.ops.autodeploy_test.lookalike_mla_with_cache.default
    assert op not in split_point_ops()
    with pytest.raises(PiecewiseError, match="no cached attention op"):
        split_graph(_graph_with(op, 1))


def test_sym_sizes_cross_pieces(om4):
    """sym_size ints computed in piece 0 feed later pieces as plain ints (split_module passes them)."""
    top = om4.runner.piecewise.split.module
    sub0 = top.get_submodule("submod_0")
    syms = [n for n in sub0.graph.nodes if n.target is torch.ops.aten.sym_size.int]
    assert syms
    out_node = next(n for n in sub0.graph.nodes if n.op == "output")
    outs = out_node.args[0] if isinstance(out_node.args[0], (tuple, list)) else [out_node.args[0]]
    assert any(o in syms for o in outs)


def test_parameters_live_in_pieces_not_in_arguments(om4):
    top = om4.runner.piecewise.split.module
    assert not [n for n in top.graph.nodes if n.op == "get_attr"]
    for p in om4.runner.piecewise.split.pieces:
        if p.kind == STATIC:
            assert len(p.arg_sources) < 10


def test_compiled_pieces_match(om4):
    """compile: aot_eager on CPU exercises the torch.compile plumbing (inductor is the GPU choice)."""
    runner = PiecewiseRunner(om4.runner.piecewise.split, om4.device, om4.seq_info.max_num_tokens, compile="aot_eager",
                             cuda_graphs=False)
    flat = run_steps(om4, None, SCHEDULE[:3])
    comp = run_steps(om4, runner, SCHEDULE[:3])
    for a, b in zip(flat, comp):
        torch.testing.assert_close(a, b, rtol=1e-5, atol=1e-5)


def test_compiled_pieces_drop_export_asserts(om4):
    """The canonical form a compile group compiles drops export's `_assert_tensor_metadata` checks
    (inductor re-checks them against its own dtype inference) and computes the same values."""
    from autodeploy_mla.runtime.piece_groups import canonicalize

    sub = om4.runner.piecewise.split.module.get_submodule("submod_0")
    asserts = [n for n in sub.graph.nodes if n.target is torch.ops.aten._assert_tensor_metadata.default]
    canon = canonicalize(sub)
    assert asserts and not [n for n in canon.gm.graph.nodes
                            if n.target is torch.ops.aten._assert_tensor_metadata.default]
    assert len(list(sub.graph.nodes)) == len(list(canon.gm.graph.nodes)) + len(asserts)  # a copy: sub keeps them
    ids, pos = torch.randint(0, 100, (1, 5)), torch.arange(5)[None]
    for a, b in zip(sub(ids, pos), canon.gm(ids, pos, *canon.params)):
        assert a == b if not isinstance(a, torch.Tensor) else torch.equal(a, b)


def test_skipped_on_cpu_unless_asked():
    om = optimize(None, {"model": {"hf_config": _hf(1)}, "runtime": RUNTIME,
                         "transforms": {"piecewise": {"enabled": True}}})
    rec = next(r for r in om.history if r.name == "piecewise")
    assert "skipped" in rec.summary
    assert om.runner.piecewise is None and om.report()["pieces"] is None


def test_config_errors():
    with pytest.raises(ValueError, match="valid options"):
        build_config(None, {"transforms": {"piecewise": {"bucket": [1]}}})
    with pytest.raises(ValueError, match="compile"):
        build_config(None, {"transforms": {"piecewise": {"compile": "max"}}})
    with pytest.raises(ValueError, match="positive"):
        build_config(None, {"transforms": {"piecewise": {"buckets": [0, 4]}}})
    with pytest.raises(ValueError, match="piecewise needs transforms.insert_cached_mla_attention"):
        build_config(None, {"transforms": {"insert_cached_mla_attention": {"enabled": False}}})
    with pytest.raises(ValueError, match="max_num_tokens=8"):
        resolve_buckets([4, 16], 8, 4)
    assert resolve_buckets("auto", 8, 4) == [1, 2, 4, 8]
    assert resolve_buckets("auto", 1024, 48) == [1, 2, 4, 8, 16, 32, 48, 64, 128, 256, 512, 1024]
    assert resolve_buckets("auto", 8192, 64)[-3:] == [512, 1024, 2048]  # capped at AUTO_BUCKET_LIMIT


def test_yaml_off_switches_graph_modes_off(tmp_path):
    """YAML 1.1 reads a bare `off` as false: `mixed_graph: off` in a config file or an override must
    still mean "off" (and `on` the default "auto")."""
    cfg_file = tmp_path / "c.yaml"
    cfg_file.write_text("transforms:\n  piecewise: {mixed_graph: off, decode_graph: on}\n")
    for cfg, pipe in (build_config("deepseek_v2", cfg_file),
                      build_config("deepseek_v2", overrides=["transforms.piecewise.mixed_graph=off",
                                                             "transforms.piecewise.decode_graph=on"])):
        opts = pipe.options("piecewise")
        assert (opts.mixed_graph, opts.decode_graph) == ("off", "auto")
    with pytest.raises(ValueError, match="mixed_graph"):
        build_config(None, {"transforms": {"piecewise": {"mixed_graph": "never"}}})


def test_steps_pad_to_buckets():
    info = SequenceInfo(max_batch_size=6, max_num_tokens=16, max_seq_len=32, page_size=4)
    pages = {i: [1 + 2 * i, 2 + 2 * i] for i in range(8)}
    buckets = (1, 2, 4, 8, 16)

    def step(seqs, bks=buckets):
        pad = bucket_for(bks, sum(len(s.token_ids) for s in seqs), all(s.is_decode for s in seqs), 6, 16)
        info.prepare_step(seqs, pages.get, pad_to=pad)

    # decode-only, 3 seqs -> bucket 4 <= max_batch_size: one dummy decode sequence
    step([StepSequence(i, [7], 3) for i in range(3)])
    assert info.num_padded_tokens == 4 and info.num_decode_seqs == 4 and info.num_tokens == 3
    assert info.get("seq_len_with_cache_host")[3] == 1 and info.get("cache_loc_host")[3] == 0
    # decode-only, 5 seqs: 8 > max_batch_size 6 -> padded with ignored tokens, not dummy seqs
    step([StepSequence(i, [7], 3) for i in range(5)])
    assert info.num_padded_tokens == 8 and info.num_decode_seqs == 5
    # mixed: 5 + 1 tokens -> 8, ignored padding
    step([StepSequence(0, [1] * 5, 0), StepSequence(1, [2], 3)])
    assert info.num_padded_tokens == 8 and info.get("batch_info_host").tolist() == [1, 5, 1]
    # no bucket fits -> unpadded; an explicit pad_to is taken as it is
    step([StepSequence(0, [1] * 5, 0)], (2, 4))
    assert info.num_padded_tokens == 5
    info.prepare_step([StepSequence(0, [1] * 3, 0)], pages.get, pad_to=7)
    assert info.num_padded_tokens == 7


def test_warmup_runs_the_largest_steps_first(monkeypatch):
    """torch.compile fixes a dynamic token count's kernel sizes and autotuning at the second count a
    piece sees: warm-up goes from the largest bucket down, so that count is a large one."""
    from autodeploy_mla.runtime.model_runner import ModelRunner

    om = build(1)
    seen = []
    monkeypatch.setattr(ModelRunner, "capture_buckets", property(lambda self: (1, 2, 4, 8)))
    monkeypatch.setattr(ModelRunner, "_warm_step", lambda self, kind, n: seen.append((kind, n)))
    om.runner.warmup_report = None
    report = om.runner.warmup()
    assert [n for _, n in seen] == sorted((n for _, n in seen), reverse=True) and seen[0][1] == 8, seen
    assert ("decode", 4) in seen and ("decode", 8) not in seen  # decode only up to max_batch_size
    assert report["steps"][:2] == ["prefill:8", "decode:4"], report


def test_captured_graph_binding_rules():
    """bind(): borrowed graph inputs must be the same tensor; owned buffers take a copy; scalars must match."""
    inp, owned_out, mine = torch.randn(4), torch.randn(3), torch.randn(2)
    cap = CapturedGraph(None, [(0, inp, BORROW), (1, owned_out, BORROW_OWNED), (2, mine, OWNED)], [(3, 8)], None, [],
                        "t")
    new = torch.randn(2)
    assert cap.bind([inp, owned_out, new, 8]) and torch.equal(mine, new)
    other = torch.randn(3)
    assert cap.bind([inp, other, new, 8]) and torch.equal(owned_out, other)
    assert not cap.bind([inp.clone(), owned_out, new, 8])  # foreign address changed: run eagerly
    assert not cap.bind([inp, owned_out, new, 9])  # a captured size differs
    assert not cap.bind([inp, owned_out, torch.randn(5), 8])  # shape differs


def test_pieces_writing_their_inputs_are_not_captured():
    g = torch.fx.Graph()
    x = g.placeholder("x")
    v = g.call_function(torch.ops.aten.view.default, (x, [-1]))
    g.call_function(torch.ops.aten.add_.Tensor, (v, 1.0))
    g.output((x,))
    assert "writes into input x" in _mutation_reason(torch.fx.GraphModule(torch.nn.Module(), g))
    g2 = torch.fx.Graph()
    y = g2.placeholder("y")
    z = g2.call_function(torch.ops.aten.mul.Tensor, (y, 2.0))
    g2.call_function(torch.ops.aten.add_.Tensor, (z, 1.0))
    g2.output((z,))
    assert _mutation_reason(torch.fx.GraphModule(torch.nn.Module(), g2)) is None


# ----------------------------------------------------------------------------- GPU
def _triton_ok() -> bool:
    if "triton" not in all_backends():
        return False
    from autodeploy_mla.custom_ops.attention.mla_dims import MLADims

    c = TINY_CONFIGS["deepseek_v3"]
    dims = MLADims(c["num_attention_heads"], c["qk_nope_head_dim"], c["qk_rope_head_dim"], c["v_head_dim"],
                   c["kv_lora_rank"])
    return bool(get_backend("triton").check(dims, torch.bfloat16, Target.detect("cuda", 4)))


def _rel(a: torch.Tensor, b: torch.Tensor) -> float:
    return float((a - b).norm() / b.norm().clamp_min(1e-30))


GPU_RUNTIME = {"max_batch_size": 8, "max_seq_len": 64, "max_num_tokens": 16, "page_size": 4, "num_pages": 64}
GPU_SCHEDULE = SCHEDULE + [
    [(5, 1, 0), (6, 2, 0), (7, 3, 0)],
    [(2, 1, 12), (4, 1, 6), (5, 1, 1), (6, 1, 2), (7, 1, 3)],
    [(2, 1, 13), (4, 1, 7), (5, 1, 2), (6, 1, 3), (7, 1, 4)],
    [(2, 1, 14), (4, 1, 8), (5, 1, 3)],
    [(2, 1, 15), (4, 1, 9), (5, 1, 4)],
]


@pytest.mark.gpu
@pytest.mark.parametrize("backend,mixed", [("torch", "auto"), ("triton", "off"), ("triton", "auto")])
def test_gpu_cuda_graph_replay_matches_eager(backend, mixed):
    """Replays (second pass) run graphs captured on other batches of the same token count: for the
    mixed graphs (triton, mixed auto) that is prefill / chunked / mixed steps of other compositions."""
    if backend == "triton" and not _triton_ok():
        pytest.skip("triton backend not registered or its check() refuses these dims")
    om = optimize(None, {
        "model": {"hf_config": _hf(3), "device": "cuda", "dtype": "bfloat16"},
        "runtime": GPU_RUNTIME,
        "transforms": {"insert_cached_mla_attention": {"backend": backend},
                       "piecewise": {"enabled": True, "buckets": [1, 2, 4, 8, 16], "mixed_graph": mixed}},
    })
    runner = om.runner.piecewise
    assert isinstance(runner, PiecewiseRunner) and runner.use_graphs
    ref = run_steps(om, None, GPU_SCHEDULE, seed=1)  # flat graph, unpadded, eager
    for rep in range(2):  # first pass captures, second pass replays only
        got = run_steps(om, runner, GPU_SCHEDULE, seed=1)
        for k, (a, b) in enumerate(zip(got, ref)):
            assert torch.isfinite(a).all()
            assert _rel(a, b) < 2e-2, (rep, k, _rel(a, b))
    st = runner.summary()
    assert not st["failures"], st
    if backend == "triton" and runner.split.decode_graph_safe:
        assert st["stats"].get("decode_graph", 0) > 0 and st["captured"]["decode_graph"], st
    if backend == "torch":
        assert not st["captured"]["decode_graph"] and not st["captured"]["mixed_graph"]
    if backend == "triton" and mixed == "auto":
        # every non-decode step is padded to a bucket <= 16 and replays a mixed graph
        assert st["stats"].get("mixed_graph", 0) > 0 and st["stats"].get("piecewise", 0) == 0, st
        assert st["captured"]["mixed_graph"], st
    else:
        assert st["stats"].get("piecewise", 0) > 0 and st["captured"]["piecewise"], st
        pieces = om.report()["pieces"]
        assert any(e["captured"]["piecewise"] for e in pieces if e["kind"] == STATIC)


@pytest.mark.gpu
def test_gpu_unseen_bucket_runs_eagerly():
    om = optimize(None, {
        "model": {"hf_config": _hf(2), "device": "cuda", "dtype": "bfloat16"},
        "runtime": GPU_RUNTIME,
        "transforms": {"piecewise": {"enabled": True, "buckets": [2, 4], "decode_graph": "off", "mixed_graph": "off"}},
    })
    sched = [[(0, 7, 0)], [(0, 1, 7), (1, 3, 0)], [(0, 1, 8), (1, 1, 3)], [(0, 5, 9), (1, 6, 4)]]
    ref = run_steps(om, None, sched, seed=2)
    got = run_steps(om, om.runner.piecewise, sched, seed=2)
    for a, b in zip(got, ref):
        assert _rel(a, b) < 2e-2
    st = om.runner.piecewise.summary()
    assert st["stats"]["eager"] == 2 and st["stats"]["piecewise"] == 2, st  # 7 and 11 tokens: no bucket
    assert st["captured"]["piecewise"] == [2, 4]


@pytest.mark.gpu
def test_gpu_inductor_compiled_pieces_replay_correctly():
    om = optimize(None, {
        "model": {"hf_config": _hf(2), "device": "cuda", "dtype": "bfloat16"},
        "runtime": GPU_RUNTIME,
        "transforms": {"piecewise": {"enabled": True, "compile": "inductor", "buckets": [4, 8]}},
    })
    sched = GPU_SCHEDULE[:5]
    ref = run_steps(om, None, sched, seed=3)
    got = run_steps(om, om.runner.piecewise, sched, seed=3)
    for k, (a, b) in enumerate(zip(got, ref)):
        assert _rel(a, b) < 2e-2, (k, _rel(a, b))
    st = om.runner.piecewise.summary()
    assert st["captured"]["piecewise"] or st["captured"]["decode_graph"] or st["captured"]["mixed_graph"], st
    assert not st["failures"], st


class _Syncs(torch.nn.Module):
    """Wraps a piece and reads a device value on the host first: not capturable."""

    def __init__(self, fn):
        super().__init__()
        self.fn = fn

    def forward(self, *args):
        float(next(a for a in args if isinstance(a, torch.Tensor)).float().sum())  # host sync
        return self.fn(*args)


@pytest.mark.gpu
def test_gpu_capture_failure_falls_back_to_eager_and_generation_is_unchanged():
    om = optimize(None, {
        "model": {"hf_config": _hf(3), "device": "cuda", "dtype": "bfloat16"},
        "runtime": GPU_RUNTIME,
        "transforms": {"piecewise": {"enabled": True, "mixed_graph": "off"}},  # the steps must run piecewise
    })
    runner = om.runner.piecewise
    runner.static_pieces[1].fn = _Syncs(runner.static_pieces[1].fn)  # e.g. a host-syncing MoE fallback
    prompts = [[5, 6, 7], [3, 4], [9, 8, 7, 6, 5, 4, 3, 2, 1, 11, 12], [42]]
    got = om.generate(prompts, max_new_tokens=8)
    st = runner.summary()
    assert any("piece 2" in k for k in st["failures"]), st  # static piece #1 is piece index 2
    assert st["stats"].get("piecewise", 0) > 0, st
    om.runner.piecewise = None  # flat graph, eager, unpadded
    assert om.generate(prompts, max_new_tokens=8) == got


def _fa3_calls(runner) -> int:
    """FA3 prefill calls of the runner's Triton sessions (its own, or a FlashInfer backend's fallback)."""
    from autodeploy_mla.custom_ops.triton_mla import TritonMLASession

    sessions = list(runner.sessions.values())
    sessions += [f for s in runner.sessions.values() for f in getattr(s, "fallback_sessions", {}).values()]
    return sum(s.fa3.calls for s in sessions if isinstance(s, TritonMLASession) and s.fa3 is not None)


@pytest.mark.gpu
@pytest.mark.parametrize("tokens", [300, 1100])
@pytest.mark.parametrize("backend", ["flashinfer_mla", "triton"])
def test_gpu_queued_prefill_steps_never_wait_for_the_device(backend, tokens):
    """Piecewise prefill steps (eager attention op between graph pieces) queued back to back make
    no synchronising CUDA call: the host prepares and launches step i+1 while the GPU runs step i
    (torch's sync debug mode raises on any). Real MLA dims (R 512, Dr 64, N 16); 300-token steps,
    above the mixed-graph limit, so every layer runs the eager op; 1100-token steps take FlashInfer's
    FA3 for the expanded attention where it is installed (tuning.FA3_PREFILL_MIN_TOKENS), whose plan
    must not wait for the device either."""
    if backend not in all_backends():
        pytest.skip(f"{backend} not registered")
    over = ["model.device=cuda", "model.dtype=bfloat16", "runtime.page_size=64", "runtime.max_seq_len=2048",
            "runtime.max_batch_size=4", f"runtime.max_num_tokens={512 if tokens < 512 else 2048}",
            "model.hf_config.kv_lora_rank=512",
            "model.hf_config.qk_rope_head_dim=64", "model.hf_config.qk_nope_head_dim=128",
            "model.hf_config.v_head_dim=128", "model.hf_config.num_attention_heads=16",
            "model.hf_config.num_key_value_heads=16", "model.hf_config.hidden_size=512",
            "model.hf_config.num_hidden_layers=3", "model.hf_config.max_position_embeddings=2048",
            f"transforms.insert_cached_mla_attention.backend={backend}"]
    try:
        om = optimize("deepseek_v2", overrides=over)
    except Exception as e:  # noqa: BLE001 - e.g. FlashInfer not installed on this GPU host
        pytest.skip(f"{backend} cannot build here: {e}")
    om.warmup()
    r = om.runner
    ids = [2 + (7 * i) % (om.vocab_size - 2) for i in range(tokens)]
    for check in (False, True):  # the first round compiles / plans for the first time
        launched = []
        if check:
            torch.cuda.set_sync_debug_mode("error")
        try:
            for _ in range(3):
                r.allocator.ensure(0, len(ids))
                launched.append(r.launch([StepSequence(0, ids, 0)], r.allocator.pages_of, {}))
                r.allocator.free(0)
        finally:
            torch.cuda.set_sync_debug_mode(0)
            got = [r.collect(s) for s in launched]
        assert len(got) == 3 and got[0] == got[1] == got[2]  # same prompt, same pages: same greedy pick
    assert r.piecewise.stats["piecewise"] + r.piecewise.stats["eager"] >= 6  # never a whole-step graph
    from autodeploy_mla.custom_ops import MLADims
    from autodeploy_mla.custom_ops.triton_mla import tuning
    from autodeploy_mla.custom_ops.flashinfer.fa3_prefill import fa3_unavailable

    dims = MLADims(16, 128, 64, 128, 512)  # the model's heads, as set above
    handed = backend == "triton" or any(getattr(s, "fallback_steps", 0) for s in r.sessions.values())
    if handed and tokens >= tuning.FA3_PREFILL_MIN_TOKENS and \
            not fa3_unavailable(dims, torch.bfloat16, torch.device("cuda")):
        assert _fa3_calls(r) > 0, "the long steps should have taken FA3 (and been checked for syncs)"


def test_bucket_steps_run_each_static_piece_with_the_descriptors_bucket(om4):
    """The runner runs the mode the model runner's descriptor names; its static pieces get the step's
    bucket from that bucket's graph module (no reference back to the runner). On CPU: graphs forced
    on, every capture declined (the piece then runs eagerly), so the per-bucket plumbing runs."""
    pw0 = om4.runner.piecewise
    runner = PiecewiseRunner(pw0.split, om4.device, om4.seq_info.max_num_tokens, cuda_graphs=False,
                             buckets=(8, 16))
    runner.use_graphs, runner._bucket_set = True, frozenset(runner.buckets)
    asked = []

    def no_capture(piece, bucket, args):
        asked.append((piece.index, bucket))
        return None

    for sp in runner.static_pieces:
        sp.capture = no_capture
    flat = run_steps(om4, None)
    got = run_steps(om4, runner)
    for a, b in zip(flat, got):
        torch.testing.assert_close(a, b, rtol=1e-5, atol=1e-5)
    assert runner.stats["piecewise"] == len(SCHEDULE) and not runner.stats["eager"]
    assert {b for _, b in asked} <= {8, 16} and {i for i, _ in asked} == {sp.index for sp in runner.static_pieces}
    assert set(runner._bucket_modules) == {b for _, b in asked}
