"""The Triton backend's lean eager path (issue 14, item 4).

CPU (CI): the op reads the step's host shape from its session (made once per step by `prepare`) and
shares one launch plan between a step's layers; a session whose `prepare` did not see the step
(counts differ) is not trusted; the piecewise runner calls the op's implementation directly for
eager attention pieces and greedy tokens still equal HF eager (interpreted Triton, fp32);
`BoundKernel`'s specialisation key separates everything Triton specialises on.
GPU (marked): a direct launch of each compiled kernel gives the JIT launch's bytes, and the op in a
session launches directly after its first step.
"""

from __future__ import annotations

import copy

import pytest
import torch

from autodeploy_mla.custom_ops.triton_mla import call as tcall, step_shape as tshape, session as tsession  # noqa: E402
from autodeploy_mla.api import optimize
from autodeploy_mla.custom_ops import get_backend
from autodeploy_mla.custom_ops.attention.registry import StepDescriptor, Target, direct_calls, make_session_spec
from autodeploy_mla.custom_ops.attention.mla_dims import MLADims
from autodeploy_mla.custom_ops.attention.step_context import using_sessions
from autodeploy_mla.custom_ops.triton_mla.launch import BoundKernel, _spec
from autodeploy_mla.runtime.page_allocator import PageAllocator
from autodeploy_mla.runtime.sequence_info import SequenceInfo, StepSequence
from autodeploy_mla.testing import hf_greedy_generate
from autodeploy_mla.testing.tiny_configs import TINY_CONFIGS

DIMS = MLADims(4, 16, 8, 16, 32)
PAGE = 4


def _session(device: str = "cpu", dtype=torch.float32) -> tsession.TritonMLASession:
    spec = make_session_spec([DIMS], dtype, device, Target.detect(device, PAGE), 4, 32, 16)
    return get_backend("triton").setup(spec)


def _fresh(num_pages: int):
    """A Triton session, a step's metadata and allocator, and a cache for the op and one for the
    torch reference, on the CPU."""
    info = SequenceInfo(4, 32, 64, PAGE, torch.device("cpu"))
    return (get_backend("triton"), _session(), info, PageAllocator(num_pages, PAGE, info.max_pages_per_seq),
            torch.zeros(num_pages, PAGE, DIMS.latent_dim), torch.zeros(num_pages, PAGE, DIMS.latent_dim))


def _step(info: SequenceInfo, alloc: PageAllocator, seqs: list[tuple[int, int, int]], gen: torch.Generator):
    alloc.ensure_many({sid: n + c for sid, n, c in seqs})
    info.prepare_step([StepSequence(sid, [1] * n, c) for sid, n, c in seqs], alloc.pages_of)


def _inputs(t: int, gen: torch.Generator, dtype=torch.float32, device="cpu"):
    d = DIMS
    mk = lambda *s: torch.randn(*s, generator=gen, dtype=torch.float32).to(device, dtype)  # noqa: E731
    return (mk(1, t, d.num_heads, d.qk_nope_head_dim), mk(1, t, d.num_heads, d.qk_rope_head_dim),
            mk(1, t, d.kv_lora_rank), mk(1, t, 1, d.qk_rope_head_dim),
            mk(d.num_heads * (d.qk_nope_head_dim + d.v_head_dim), d.kv_lora_rank) / 4)


def _call(be, x, info, cache):
    return be.cached_op.default(*x, *[info.get(m) for m in be.metadata], cache, None)


def _reference(x, info, cache):
    ref = get_backend("torch")
    return ref.cached_op.default(*x, *[info.get(m) for m in ref.metadata], cache, None)


# ----------------------------------------------------------------------------- CPU
def test_step_plan_made_once_and_shared_by_layers():
    """Two layers of one step share the session's plans; the next prepare clears them; outputs equal
    the torch reference in every layer."""
    gen = torch.Generator().manual_seed(0)
    be = get_backend("triton")
    sess = _session()
    info = SequenceInfo(4, 32, 64, PAGE, torch.device("cpu"))
    alloc = PageAllocator(40, PAGE, info.max_pages_per_seq)
    caches = [torch.zeros(40, PAGE, DIMS.latent_dim) for _ in range(2)]
    refs = [torch.zeros_like(c) for c in caches]

    for seqs in ([(0, 6, 0), (1, 3, 0)], [(0, 1, 6), (1, 2, 3), (2, 1, 0)], [(0, 1, 7), (1, 1, 5), (2, 1, 1)]):
        _step(info, alloc, seqs, gen)
        sess.prepare(info, StepDescriptor(info.num_tokens, info.num_tokens, len(seqs), False))
        assert sess.step is not None and sess.step.num_tok == sum(n for _, n, _ in seqs)
        assert not sess.plans
        with using_sessions({"triton": sess}):
            for layer in range(2):
                x = _inputs(info.num_tokens, gen)
                got = _call(be, x, info, caches[layer])
                want = _reference(x, info, refs[layer])
                torch.testing.assert_close(got, want, rtol=2e-4, atol=2e-4)
                if layer == 0:
                    plans_after_first = dict(sess.plans)
            assert sess.plans == plans_after_first  # the second layer made no new plan
        torch.testing.assert_close(caches[0], refs[0])


def test_session_not_trusted_for_a_step_it_did_not_prepare():
    """A session prepared for another step (other batch counts) is not used for this call: the op
    reads the host metadata itself and keeps nothing in the session's step plans."""
    gen = torch.Generator().manual_seed(1)
    be, sess, info, alloc, cache, ref = _fresh(40)
    _step(info, alloc, [(0, 5, 0)], gen)
    sess.prepare(info, StepDescriptor(5, 5, 1, False))
    _step(info, alloc, [(0, 1, 5), (1, 4, 0)], gen)  # no prepare for this step
    x = _inputs(info.num_tokens, gen)
    with using_sessions({"triton": sess}):
        got = _call(be, x, info, cache)
    torch.testing.assert_close(got, _reference(x, info, ref), rtol=2e-4, atol=2e-4)
    assert not sess.plans


def test_session_not_trusted_when_only_the_prefix_differs():
    """Same batch counts and max lengths as the prepared step, another cached prefix (which sizes
    the expanded prefill's history buffer): the op must not use the prepared step's sizes."""
    gen = torch.Generator().manual_seed(2)
    be, sess, info, alloc, cache, ref = _fresh(60)
    _step(info, alloc, [(0, 4, 10), (1, 4, 20)], gen)
    sess.prepare(info, StepDescriptor(8, 8, 2, False))
    prepared = sess.step
    _step(info, alloc, [(0, 4, 14), (1, 4, 20)], gen)  # same counts and max lengths, prefix 34 (was 30)
    assert sess.step.key == tshape.StepShape.from_host(info.get("batch_info_host"), info.get("max_seq_info_host"),
                                                    info.get("cu_seqlen_host"), info.get("input_pos_host")).key
    x = _inputs(info.num_tokens, gen)
    with using_sessions({"triton": sess}):
        got = _call(be, x, info, cache)
    torch.testing.assert_close(got, _reference(x, info, ref), rtol=2e-4, atol=2e-4)
    assert sess.step is prepared and not sess.plans


def test_per_model_tables_are_bounded():
    table: dict = {}
    for i in range(10):
        tcall.per_model(table, (i,), lambda: object(), 4)
        assert len(table) <= 4
    assert tcall.per_model(None, (0,), lambda: 7, 4) == 7


def test_direct_launch_passes_pointers_scalars_then_constexprs(monkeypatch):
    """The direct path (normally GPU only) with a fake kernel: the first launch of a specialisation
    goes through the JIT and is kept; the next one with the same key calls the compiled kernel's
    launcher with (grid, stream, function, metadata, no hooks, *pointers, *scalars, *constexprs); a
    pointer of another alignment is a new specialisation (JIT again)."""
    from autodeploy_mla.custom_ops.triton_mla import launch as L

    monkeypatch.setenv("TRITON_INTERPRET", "0")
    monkeypatch.setattr(L, "_on_cuda", lambda ptrs: True)
    monkeypatch.setattr(torch._C, "_cuda_getDevice", lambda: 0, raising=False)
    monkeypatch.setattr(torch._C, "_cuda_getCurrentRawStream", lambda dev: 1234, raising=False)

    class Param:
        def __init__(self, name, const):
            self.name, self.is_constexpr, self.default = name, const, __import__("inspect").Parameter.empty

    runs: list[tuple] = []

    class Compiled:
        function, packed_metadata = "fn", "meta"

        def run(self, *a):
            runs.append(a)

    jit: list[tuple] = []

    class Fake:
        params = [Param("X", False), Param("Y", False), Param("n", False), Param("s", False), Param("B", True),
                  Param("C", True)]

        def __getitem__(self, grid):
            def launch(*a, **k):
                jit.append((grid, a, k))
                return Compiled()
            return launch

    bk = L.BoundKernel(Fake(), {"C": 3, "B": 2, "num_warps": 4})
    assert bk.direct
    x, y = torch.zeros(32), torch.zeros(32)
    bk.launch((5, 2), (x, y), (7, 0.5))
    assert len(jit) == 1 and not runs
    bk.launch((5, 2), (x, y), (7, 0.5))
    assert len(jit) == 1 and runs == [(5, 2, 1, 1234, "fn", "meta", None, None, None, x, y, 7, 0.5, 2, 3)]
    bk.launch((6,), (x[1:], y), (7, 0.5))  # 4-byte offset: another specialisation
    assert len(jit) == 2 and bk.direct_launches == 1 and bk.jit_launches == 2


def test_piecewise_runner_calls_the_op_directly_and_tokens_equal_hf():
    cfg = copy.deepcopy(TINY_CONFIGS["deepseek_v3"])
    cfg["num_hidden_layers"] = 2
    om = optimize(None, {
        "model": {"hf_config": cfg, "device": "cpu", "dtype": "float32"},
        "runtime": {"max_batch_size": 4, "max_seq_len": 64, "max_num_tokens": 16, "page_size": 4},
        "transforms": {"piecewise": {"enabled": True, "on_cpu": True},
                       "insert_cached_mla_attention": {"backend": "triton"}},
    })
    pw = om.runner.piecewise
    dyn = [p.name for p in pw.split.pieces if p.kind == "dynamic"]
    assert pw.direct_pieces == dyn and pw.summary()["direct_call_pieces"] == 2
    direct = set(direct_calls().values())
    for name in dyn:
        run = pw.eager_module.get_submodule(name)
        assert any(n.target in direct for n in run.graph.nodes if n.op == "call_function")
        # the split graph itself keeps the registered op (reports, re-tracing)
        src = pw.split.module.get_submodule(name)
        assert not any(n.target in direct for n in src.graph.nodes if n.op == "call_function")
    prompts = [[5, 6, 7, 8, 9], [3, 4], [9, 8, 7, 6, 5, 4, 3, 2, 1, 11, 12]]
    got = om.generate(prompts, max_new_tokens=5)
    for p, g in zip(prompts, got):
        assert g == hf_greedy_generate(om.eager_model, p, 5)
    stats = om.runner.sessions["triton"].stats()
    assert stats["step_plans"] >= 1 and stats["bound_kernels"] >= 3


def test_every_contract_backend_offers_its_implementation_as_direct_call():
    """Backends whose op is defined through op_contract hand the runtime the very function the
    dispatcher calls: same name, and (torch reference on CPU) the same output and cache write."""
    from autodeploy_mla.custom_ops import all_backends

    named = {b.name: b for b in all_backends().values() if b.direct_call is not None}
    assert {"torch", "triton", "flashinfer_mla", "flashinfer_trtllm_mla", "flashinfer_mla_sparse"} <= set(named)
    for b in named.values():
        assert b.direct_call.__name__ == b.cached_op.default.name().split("::")[-1]
    gen = torch.Generator().manual_seed(5)
    info = SequenceInfo(4, 32, 64, PAGE, torch.device("cpu"))
    alloc = PageAllocator(40, PAGE, info.max_pages_per_seq)
    _step(info, alloc, [(0, 5, 0), (1, 3, 0)], gen)
    x = _inputs(info.num_tokens, gen)
    be = named["torch"]
    caches = [torch.zeros(40, PAGE, DIMS.latent_dim) for _ in range(2)]
    via_op = _call(be, x, info, caches[0])
    direct = be.direct_call(*x, *[info.get(m) for m in be.metadata], caches[1], None)
    assert torch.equal(via_op, direct) and torch.equal(caches[0], caches[1])


def test_unspecialised_parameters_do_not_split_the_key(monkeypatch):
    """A parameter the kernel declares `do_not_specialize` (the per-step bases) keeps one direct
    launch across values of another divisibility (Triton compiles no variant for them); a
    specialised one still separates them."""
    from autodeploy_mla.custom_ops.triton_mla import launch as L

    monkeypatch.setenv("TRITON_INTERPRET", "0")
    monkeypatch.setattr(L, "_on_cuda", lambda ptrs: True)
    monkeypatch.setattr(torch._C, "_cuda_getDevice", lambda: 0, raising=False)
    monkeypatch.setattr(torch._C, "_cuda_getCurrentRawStream", lambda dev: 1, raising=False)

    class Param:
        def __init__(self, name, const, nospec=False):
            self.name, self.is_constexpr, self.do_not_specialize = name, const, nospec
            self.default = __import__("inspect").Parameter.empty

    class Compiled:
        function, packed_metadata = "fn", "meta"

        def run(self, *a):
            pass

    jit: list[tuple] = []

    class Fake:
        params = [Param("X", False), Param("base", False, nospec=True), Param("n", False), Param("B", True)]

        def __getitem__(self, grid):
            def launch(*a, **k):
                jit.append(a)
                return Compiled()
            return launch

    bk = L.BoundKernel(Fake(), {"B": 2})
    x = torch.zeros(32)
    for base in (0, 5, 16, 1, 33):  # every divisibility class of the unspecialised base
        bk.launch((1,), (x,), (base, 7))
    assert len(jit) == 1 and bk.direct_launches == 4
    bk.launch((1,), (x,), (3, 16))  # the specialised `n` becomes a multiple of 16: a new variant
    assert len(jit) == 2
    bk.launch((1,), (x,), (2 ** 40, 7))  # 64-bit base: Triton types it i64, another variant
    assert len(jit) == 3


def test_specialisation_key_separates_what_triton_specialises():
    t = torch.zeros(64, dtype=torch.float16)
    assert _spec(t) != _spec(t[1:])  # 16-byte alignment
    assert _spec(t) != _spec(t.float())  # dtype
    assert len({_spec(1), _spec(16), _spec(17), _spec(2 ** 40)}) == 4  # ==1, %16, plain, 64-bit
    assert _spec(True) != _spec(False) and _spec(None) is None
    assert _spec(0.5) == _spec(2.0)  # floats are not specialised


def test_launch_hooks_keep_the_jit_path(monkeypatch):
    """A profiler's launch hook (Triton's HookChain, empty by default) needs the JIT path's metadata."""
    import triton

    from autodeploy_mla.custom_ops.triton_mla.launch import _launch_hooks_active

    chain = getattr(getattr(triton, "knobs", None), "runtime", None)
    if chain is None or not hasattr(chain.launch_enter_hook, "calls"):
        pytest.skip("this Triton keeps launch hooks as plain attributes")
    assert not _launch_hooks_active()
    monkeypatch.setattr(chain.launch_enter_hook, "calls", [print])
    assert _launch_hooks_active()


def test_bound_kernel_stays_on_the_jit_path_in_the_interpreter():
    from autodeploy_mla.custom_ops.triton_mla import kernels as K

    bk = BoundKernel(K.split_reduce_kernel, dict(R=8, BLOCK_R=16))
    assert not bk.direct  # TRITON_INTERPRET=1 (conftest): nothing compiled to call
    n, s, r = 2, 3, 8
    acc = torch.randn(1, n, s, r)
    lse = torch.randn(1, n, s)
    out = torch.empty(n, 1, r)
    bk.launch((1, n), (acc, lse, out, torch.zeros(1, dtype=torch.int32)), (0, 0, s, *acc.stride()[:3], *lse.stride()[:2], out.stride(0), out.stride(1)))
    w = torch.softmax(lse * 0.6931471805599453, dim=-1)  # base-2 lse
    torch.testing.assert_close(out[:, 0], (w[0, :, :, None] * acc[0]).sum(1), rtol=1e-5, atol=1e-5)
    assert bk.jit_launches == 1 and bk.direct_launches == 0


# ----------------------------------------------------------------------------- GPU
@pytest.mark.gpu
def test_gpu_direct_launches_equal_jit_launches():
    """Decode and mixed steps through a session (direct launches from the second step on) give the
    same bytes as the same op without a session (Triton's JIT launcher), and the direct path is used."""
    if not torch.cuda.is_available():
        pytest.skip("needs a CUDA GPU")
    import os

    if os.environ.get("TRITON_INTERPRET") == "1":
        pytest.skip("interpreter")

    gen = torch.Generator().manual_seed(3)
    be = get_backend("triton")
    dims = MLADims(16, 128, 64, 128, 512)
    spec = make_session_spec([dims], torch.bfloat16, "cuda", Target.detect("cuda", 64), 8, 256, 64)
    sess = be.setup(spec)
    info = SequenceInfo(8, 256, 4096, 64, torch.device("cuda"))
    alloc = PageAllocator(200, 64, info.max_pages_per_seq)
    c_direct = torch.randn(200, 64, dims.latent_dim, generator=gen).to("cuda", torch.bfloat16)
    c_jit = c_direct.clone()
    for step, seqs in enumerate(([(i, 1, 300 + 97 * i) for i in range(6)],
                                 [(i, 1, 301 + 97 * i) for i in range(6)],
                                 [(0, 1, 302), (1, 1, 398), (6, 40, 0), (7, 17, 100)])):
        alloc.ensure_many({sid: n + c for sid, n, c in seqs})
        info.prepare_step([StepSequence(sid, [1] * n, c) for sid, n, c in seqs], alloc.pages_of)
        sess.prepare(info, StepDescriptor(info.num_tokens, info.num_tokens, len(seqs), step < 2))
        t = info.num_tokens
        x = [torch.randn(*s, generator=gen).to("cuda", torch.bfloat16) for s in
             ((1, t, 16, 128), (1, t, 16, 64), (1, t, 512), (1, t, 1, 64), (16 * 256, 512))]
        x[4] = x[4] / 8
        for _ in range(2):  # the first call of a variant compiles through the JIT; the second is direct
            with using_sessions({"triton": sess}):
                a = _call(be, x, info, c_direct)
            b = _call(be, x, info, c_jit)
            torch.cuda.synchronize()
            assert torch.equal(a, b) and torch.equal(c_direct, c_jit)
    assert sess.stats()["direct_launches"] > 0
