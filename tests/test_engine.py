"""Generation engine behaviour: batching, limits, failures isolated per request, sampling, streaming."""

import pytest

from autodeploy_mla import optimize
from autodeploy_mla.runtime import CapacityError
from autodeploy_mla.runtime.sampling import SamplingParams
from autodeploy_mla.testing import hf_greedy_generate

BASE = ["model.device=cpu", "model.dtype=float32", "runtime.page_size=4", "runtime.max_seq_len=40",
        "runtime.max_num_tokens=10", "runtime.max_batch_size=3"]


@pytest.fixture(scope="module")
def om():
    return optimize("default", overrides=BASE + ["runtime.num_pages=12"])  # 11 usable pages = 44 slots


def test_more_prompts_than_batch_slots(om):
    prompts = [list(range(i + 1, 2 * i + 4)) for i in range(7)]  # 7 requests, 3 slots
    news = [2, 5, 3, 4, 1, 6, 2]
    eng = om.engine()
    reqs = eng.run(prompts, [SamplingParams(max_new_tokens=n) for n in news])
    assert [r.generated for r in reqs] == [hf_greedy_generate(om.eager_model, p, n) for p, n in zip(prompts, news)]
    assert max(s.num_seqs for s in eng.steps) == 3
    assert any(s.num_prefill_tokens and s.num_decode_tokens for s in eng.steps)  # mixed steps happened
    assert om.allocator.num_free == om.allocator.num_usable


def test_request_too_big_for_the_cache_fails_alone(om):
    # 11 usable pages x 4 = 44 slots; a 30+10 request needs 10 pages, two of them cannot coexist.
    prompts = [list(range(1, 31)), [7, 8, 9], list(range(2, 32))]
    reqs = om.engine().run(prompts, SamplingParams(max_new_tokens=10))
    assert all(r.finish_reason == "length" for r in reqs)  # the third waited for pages, then ran
    assert reqs[1].generated == hf_greedy_generate(om.eager_model, [7, 8, 9], 10)
    big = optimize("default", overrides=BASE + ["runtime.num_pages=5"])  # 16 slots
    reqs = big.engine().run([list(range(1, 21)), [4, 5]], SamplingParams(max_new_tokens=3))
    assert reqs[0].finish_reason == "error" and "out of cache pages" in reqs[0].error
    assert reqs[1].finish_reason == "length" and len(reqs[1].generated) == 3
    alone = big.engine().run([list(range(1, 21))], SamplingParams(max_new_tokens=3))  # the run's only request
    assert alone[0].finish_reason == "error" and "out of cache pages" in alone[0].error
    assert big.allocator.num_free == big.allocator.num_usable


def test_invalid_requests_fail_alone_before_reaching_the_model(om):
    eng = om.engine()
    with pytest.raises(CapacityError, match="over max_seq_len=40"):
        eng.add_request(list(range(35)), SamplingParams(max_new_tokens=8))
    assert not eng.has_work()  # nothing queued
    reqs = eng.run([[1, 2], list(range(35)), []], SamplingParams(max_new_tokens=8))
    assert reqs[0].finish_reason == "length" and reqs[0].generated == hf_greedy_generate(om.eager_model, [1, 2], 8)
    assert reqs[1].finish_reason == "error" and "over max_seq_len=40" in reqs[1].error and not reqs[1].generated
    assert reqs[2].finish_reason == "error" and "empty prompt" in reqs[2].error
    assert om.allocator.num_free == om.allocator.num_usable


def test_stop_tokens_and_streaming(om):
    prompt = [3, 1, 4, 1, 5, 9, 2, 6]
    ref = hf_greedy_generate(om.eager_model, prompt, 6)
    streamed = []
    eng = om.engine()
    reqs = eng.run([prompt], SamplingParams(max_new_tokens=6, stop_token_ids=(ref[2],)),
                   on_tokens=lambda new: streamed.extend(new))
    cut = ref.index(ref[2]) + 1
    assert reqs[0].generated == ref[:cut] and reqs[0].finish_reason == "stop"
    assert [t for _, t in streamed] == ref[:cut]


def test_seeded_sampling_is_reproducible(om):
    p = SamplingParams(max_new_tokens=6, temperature=0.8, top_k=20, top_p=0.9, seed=123)
    a = om.generate([[1, 2, 3]], max_new_tokens=6, temperature=0.8, top_k=20, top_p=0.9, seed=123)
    b = om.engine().run([[1, 2, 3]], p)[0].generated
    assert a[0] == b


def test_overlap_gives_the_same_tokens_and_steps_fewer_waits(om):
    """Overlapped scheduling (step i+1 queued before step i's tokens are read) changes no token:
    greedy and seeded sampling equal the synchronous engine's, stop tokens included."""
    prompts = [list(range(i + 1, 2 * i + 4)) for i in range(6)]
    news = [3, 7, 1, 5, 6, 2]
    greedy = [SamplingParams(max_new_tokens=n) for n in news]
    sampled = [SamplingParams(max_new_tokens=n, temperature=0.9, top_k=30, top_p=0.95, seed=11 + i)
               for i, n in enumerate(news)]
    for params in (greedy, sampled):
        sync = om.engine()
        sync.overlap = False
        want = [r.generated for r in sync.run(prompts, params)]
        eng = om.engine()
        assert eng.overlap
        got = [r.generated for r in eng.run(prompts, params)]
        assert got == want
    assert want != [hf_greedy_generate(om.eager_model, p, n) for p, n in zip(prompts, news)]  # really sampled
    ref = hf_greedy_generate(om.eager_model, prompts[1], 7)
    req = om.engine().run([prompts[1]], SamplingParams(max_new_tokens=7, stop_token_ids=(ref[1],)))[0]
    assert req.generated == ref[:2] and req.finish_reason == "stop"
    assert om.allocator.num_free == om.allocator.num_usable


@pytest.mark.gpu
@pytest.mark.parametrize("backend", ["torch", "triton", "auto"])
def test_gpu_overlapped_engine_with_cuda_graphs(backend):
    """On CUDA in bf16 (CUDA graphs on, decode tokens fed from the previous step's device ids) the
    overlapped engine gives the synchronous engine's tokens, greedy and seeded-sampled, and with
    `time_steps` every step has a device time. (Greedy tokens equal to HF eager are checked in
    fp32 on CPU; bf16 kernels differ from eager in the last bits.)"""
    import torch

    from autodeploy_mla.testing.tiny_configs import TINY_CONFIGS

    if not torch.cuda.is_available():
        pytest.skip("needs a CUDA GPU")
    om = optimize(None, {
        "model": {"hf_config": TINY_CONFIGS["deepseek_v3"], "device": "cuda", "dtype": "bfloat16"},
        "runtime": {"page_size": 16, "max_seq_len": 64, "max_num_tokens": 32, "max_batch_size": 4},
        "transforms": {"insert_cached_mla_attention": {"backend": backend}},
    })
    om.warmup()
    cap = om.runner.piecewise.captured()
    if backend == "triton":  # mixed graphs per bucket, and their pieces for steps run piecewise
        assert cap["mixed_graph"] and set(cap["mixed_graph"]) <= set(cap["piecewise"]), cap
    prompts = [list(range(i + 1, 3 * i + 5)) for i in range(7)]
    news = [3, 9, 1, 6, 12, 2, 8]
    for params in ([SamplingParams(max_new_tokens=n, ignore_eos=True) for n in news],
                   [SamplingParams(max_new_tokens=n, temperature=0.9, top_p=0.9, seed=5 + i, ignore_eos=True)
                    for i, n in enumerate(news)]):
        want = [r.generated for r in om.engine(overlap=False).run(prompts, params)]
        om.runner.time_steps = True
        eng = om.engine(overlap=True)
        got = [r.generated for r in eng.run(prompts, params)]
        om.runner.time_steps = False
        assert got == want
        assert [len(g) for g in got] == news
        assert all(s.device_ms is not None and s.device_ms > 0 for s in eng.steps)
        assert eng.gpu_busy_ms > 0
    assert om.runner.report()["warmup"] is not None
    assert om.allocator.num_free == om.allocator.num_usable
