"""`autodeploy serve` end to end on CPU: the official `openai` client (and raw httpx where the client
hides the wire) against the server started on a free port, with the tiny default model (fp32). The
engine core runs in a process of its own (as `autodeploy serve` runs it): it builds its own copy of
the model from the same config (same seed: the same weights as the `om` built here for references).

Greedy tokens through HTTP must equal `OptimizedModel.generate` (itself checked against HF eager in
test_engine); logprobs must equal log_softmax of `prefill_logits`; every test ends with every cache
page back (the engine core's page gauge on /metrics)."""

from __future__ import annotations

import asyncio
import contextlib
import json
import math
import os
import signal
import time

import httpx
import openai
import pytest
import torch
from openai import AsyncOpenAI, OpenAI

from autodeploy_mla import optimize
from autodeploy_mla.api import build_config
from autodeploy_mla.serving import bench
from autodeploy_mla.serving.server import ServerThread
from autodeploy_mla.testing.tiny_tokenizer import tiny_tokenizer

MODEL = "tiny"
RUNTIME = ["model.device=cpu", "model.dtype=float32", "runtime.page_size=4", "runtime.max_seq_len=512",
           "runtime.max_num_tokens=24", "runtime.max_batch_size=6"]
GREEDY = {"ignore_eos": True, "return_token_ids": True}


@pytest.fixture(scope="module")
def cfg():
    return build_config("default", None, RUNTIME)[0]


@pytest.fixture(scope="module")
def om(cfg):
    return optimize(None, cfg)


@pytest.fixture(scope="module")
def tok(om):
    return tiny_tokenizer(om.vocab_size)


def prompt_ids(i: int, n: int = 5) -> list[int]:
    return [2 + (7 * i + 3 * k) % 250 for k in range(n)]


def words(ids: list[int]) -> str:
    return " ".join(f"w{t}" for t in ids)


def metric(url: str, name: str) -> float:
    for line in httpx.get(f"{url}/metrics").text.splitlines():
        if line.startswith(name + " "):
            return float(line.split()[1])
    raise AssertionError(f"{name} not in /metrics")


def wait_pages_free(url: str, timeout_s: float = 15.0) -> None:
    deadline = time.monotonic() + timeout_s
    while (used := metric(url, "autodeploy_cache_pages_used")) != 0:
        assert time.monotonic() < deadline, f"{used:.0f} pages still held {timeout_s} s after the requests ended"
        time.sleep(0.05)


@pytest.fixture(scope="module")
def reference(om, tok):
    """Greedy tokens from OptimizedModel.generate in this process."""
    prompts = [prompt_ids(i) for i in range(64)]
    chat_ids = tok.apply_chat_template([{"role": "user", "content": "w9 w10 w11"}], add_generation_prompt=True,
                                       tokenize=True)
    if hasattr(chat_ids, "keys"):
        chat_ids = chat_ids["input_ids"]
    chat_ids = [int(t) for t in chat_ids]
    out = om.generate(prompts + [chat_ids], max_new_tokens=6, ignore_eos=True)
    return {"prompts": prompts, "tokens": out[:-1], "chat_prompt": chat_ids, "chat_tokens": out[-1]}


@pytest.fixture(scope="module")
def server(cfg, tok, reference):
    srv = ServerThread(cfg, tok, MODEL, drain_timeout_s=5.0)
    with srv as url:
        assert srv.client.core.is_alive() and srv.client.core.pid != os.getpid()  # its own process
        yield url
        wait_pages_free(url)
    assert srv.client.pages_leaked == 0  # the engine core's own count at its exit


@pytest.fixture(autouse=True)
def _pages_back(request):
    yield
    if "server" in request.fixturenames:
        wait_pages_free(request.getfixturevalue("server"))


def client(url: str) -> OpenAI:
    return OpenAI(base_url=f"{url}/v1", api_key="unused", max_retries=0, timeout=120)


def test_usage_reports_prefix_cached_tokens(server, om):
    """A prompt sent again takes its full pages before its last token from the prefix cache:
    usage.prompt_tokens_details.cached_tokens (OpenAI's field, through the openai client, plain and
    streamed, n > 1 counted once) and the /metrics counters say so; the tokens do not change."""
    c = client(server)
    p = [2 + (11 * k + 5) % 250 for k in range(30)]  # 7 full pages before the last token (page_size 4)
    want = om.generate([p], max_new_tokens=4, ignore_eos=True)[0]
    q0, h0 = (metric(server, f"autodeploy_prefix_cache_{m}_tokens_total") for m in ("query", "hit"))
    first = c.completions.create(model=MODEL, prompt=p, max_tokens=4, temperature=0, extra_body=GREEDY)
    again = c.completions.create(model=MODEL, prompt=p, max_tokens=4, temperature=0, extra_body=GREEDY)
    assert first.choices[0].token_ids == again.choices[0].token_ids == want
    assert first.usage.prompt_tokens_details.cached_tokens == 0  # (no earlier test sends this prompt)
    assert again.usage.prompt_tokens_details.cached_tokens == 28 and again.usage.prompt_tokens == 30
    usage = None
    for ch in c.completions.create(model=MODEL, prompt=p, max_tokens=4, temperature=0, stream=True, n=2,
                                   stream_options={"include_usage": True}, extra_body=GREEDY):
        usage = ch.usage or usage
    assert usage.prompt_tokens == 30 and usage.prompt_tokens_details.cached_tokens == 28
    wait_pages_free(server)
    assert metric(server, "autodeploy_prefix_cache_query_tokens_total") - q0 == 90
    assert metric(server, "autodeploy_prefix_cache_hit_tokens_total") - h0 == 56
    assert metric(server, "autodeploy_cache_pages_cached") >= 7


def ref_logprobs(om, ids: list[int], temperature: float = 1.0) -> torch.Tensor:
    """[S-1, V] float64: row i is the distribution of token i+1 given ids[:i+1] (prefill logits)."""
    return torch.log_softmax(om.prefill_logits(ids).double() / temperature, dim=-1)[:-1]


# ----------------------------------------------------------------------------- happy paths
def test_models_health_and_metrics(server, om):
    models = client(server).models.list()
    assert [m.id for m in models.data] == [MODEL]
    card = httpx.get(f"{server}/v1/models").json()["data"][0]
    assert card["max_model_len"] == om.seq_info.max_seq_len and card["vocab_size"] == om.vocab_size
    assert httpx.get(f"{server}/health").json() == {"status": "ok"}
    text = httpx.get(f"{server}/metrics").text
    for name in ("autodeploy_requests_running", "autodeploy_requests_waiting", "autodeploy_cache_pages_used",
                 "autodeploy_cache_pages_total", "autodeploy_generation_tokens_per_second",
                 "autodeploy_time_to_first_token_seconds_bucket", "autodeploy_inter_token_latency_seconds_bucket"):
        assert name in text, name
    assert metric(server, "autodeploy_cache_pages_total") == om.allocator.num_usable


def test_completion_token_ids_and_text_match_generate(server, reference, tok):
    c = client(server)
    p, want = reference["prompts"][0], reference["tokens"][0]
    r = c.completions.create(model=MODEL, prompt=p, max_tokens=6, temperature=0, extra_body=GREEDY)
    choice = r.choices[0]
    assert choice.token_ids == want and choice.prompt_token_ids == p
    assert choice.finish_reason == "length" and choice.logprobs is None
    assert choice.text == tok.decode(want, skip_special_tokens=True)
    assert (r.usage.prompt_tokens, r.usage.completion_tokens, r.usage.total_tokens) == (5, 6, 11)
    r2 = c.completions.create(model=MODEL, prompt=words(p), max_tokens=6, temperature=0, extra_body=GREEDY)
    assert r2.choices[0].token_ids == want and r2.choices[0].text == choice.text
    # several prompts in one request: one choice each, in order
    r3 = c.completions.create(model=MODEL, prompt=reference["prompts"][:3], max_tokens=6, temperature=0,
                              extra_body=GREEDY)
    assert [ch.index for ch in r3.choices] == [0, 1, 2]
    assert [ch.token_ids for ch in r3.choices] == reference["tokens"][:3]
    assert r3.usage.prompt_tokens == 15 and r3.usage.completion_tokens == 18


def test_streaming_completion_matches_non_streaming(server, reference, tok):
    c = client(server)
    p, want = reference["prompts"][1], reference["tokens"][1]
    ids, text, finish, usage = [], "", None, None
    for ch in c.completions.create(model=MODEL, prompt=p, max_tokens=6, temperature=0, stream=True,
                                   stream_options={"include_usage": True}, extra_body=GREEDY):
        if ch.usage is not None:
            usage = ch.usage
        for choice in ch.choices:
            ids += choice.token_ids or []
            text += choice.text
            finish = choice.finish_reason or finish
    assert ids == want and finish == "length"
    assert text == tok.decode(want, skip_special_tokens=True)
    assert usage is not None and usage.completion_tokens == 6 and usage.prompt_tokens == 5


def test_chat_streaming_and_not(server, reference, tok):
    c = client(server)
    msgs = [{"role": "user", "content": "w9 w10 w11"}]
    want = reference["chat_tokens"]
    r = c.chat.completions.create(model=MODEL, messages=msgs, max_tokens=6, temperature=0, extra_body=GREEDY)
    assert r.choices[0].message.role == "assistant"
    assert r.choices[0].message.content == tok.decode(want, skip_special_tokens=True)
    assert r.usage.prompt_tokens == len(reference["chat_prompt"])
    raw = r.model_dump()["choices"][0]
    assert raw["token_ids"] == want and raw["prompt_token_ids"] == reference["chat_prompt"]
    text, roles = "", set()
    for ch in c.chat.completions.create(model=MODEL, messages=msgs, max_tokens=6, temperature=0, stream=True,
                                        extra_body={"ignore_eos": True}):
        for choice in ch.choices:
            text += choice.delta.content or ""
            if choice.delta.role:
                roles.add(choice.delta.role)
    assert text == r.choices[0].message.content and roles == {"assistant"}


def test_stop_string_and_seeded_sampling(server, reference, tok):
    c = client(server)
    p, want = reference["prompts"][2], reference["tokens"][2]
    stop = f"w{want[3]}"
    r = c.completions.create(model=MODEL, prompt=p, max_tokens=6, temperature=0, stop=stop,
                             extra_body={**GREEDY})
    full = tok.decode(want, skip_special_tokens=True)
    assert r.choices[0].finish_reason == "stop" and r.choices[0].text == full[: full.find(stop)]
    assert r.choices[0].token_ids == want[: want.index(want[3]) + 1]  # up to the token that completed the stop
    kw = dict(model=MODEL, prompt=p, max_tokens=6, temperature=0.8, top_p=0.9, seed=1234,
              extra_body={**GREEDY, "top_k": 20})
    a, b = (c.completions.create(**kw).choices[0].token_ids for _ in range(2))
    assert a == b  # seeded: reproducible, whatever else is in the batch


# ----------------------------------------------------------------------------- logprobs, echo, n, penalties
def _top_ids(d: dict[str, float]) -> dict[int, float]:
    return {int(k[1:]): v for k, v in d.items()}  # the tiny tokenizer's token text is "w<id>"


def test_logprobs_and_echo_equal_log_softmax_of_prefill_logits(server, om, tok):
    c = client(server)
    p = prompt_ids(7, 9)
    r = c.completions.create(model=MODEL, prompt=p, max_tokens=5, temperature=0, logprobs=3, echo=True,
                             extra_body=GREEDY)
    ch = r.choices[0]
    full = p + ch.token_ids
    ref = ref_logprobs(om, full)
    lp = ch.logprobs
    assert lp.tokens == [tok.decode([t]) for t in full] and len(lp.token_logprobs) == len(full)
    assert lp.token_logprobs[0] is None and lp.top_logprobs[0] is None  # the first prompt token has none
    for i in range(1, len(full)):
        assert abs(lp.token_logprobs[i] - ref[i - 1, full[i]].item()) < 1e-4, i
        top = _top_ids(lp.top_logprobs[i])
        want_top = ref[i - 1].topk(3).indices.tolist()
        assert set(want_top) <= set(top) and len(top) <= 4  # the 3 most likely, plus the actual token
        for t, v in top.items():
            assert abs(v - ref[i - 1, t].item()) < 1e-4
    for i in range(len(p), len(full)):  # greedy: each generated token is the most likely one
        assert full[i] == ref[i - 1].argmax().item()
    assert ch.text == tok.decode(p, skip_special_tokens=True) + tok.decode(ch.token_ids, skip_special_tokens=True)
    assert lp.text_offset[0] == 0 and lp.text_offset == sorted(lp.text_offset)
    assert r.usage.prompt_tokens == len(p) and r.usage.completion_tokens == 5
    # lm-eval's loglikelihood request: echo, logprobs=1, max_tokens=1
    r = c.completions.create(model=MODEL, prompt=p, max_tokens=1, temperature=0, logprobs=1, echo=True)
    lp = r.choices[0].logprobs
    assert len(lp.token_logprobs) == len(p) + 1
    got = sum(lp.token_logprobs[1:len(p)])
    assert abs(got - sum(ref_logprobs(om, p)[i - 1, p[i]].item() for i in range(1, len(p)))) < 1e-3


def test_logprobs_streaming_sampled_and_chat(server, om):
    c = client(server)
    p = prompt_ids(8, 6)
    ids, lps = [], []
    for chunk in c.completions.create(model=MODEL, prompt=p, max_tokens=5, temperature=0.7, seed=3, logprobs=2,
                                      stream=True, extra_body=GREEDY):
        for ch in chunk.choices:
            ids += ch.token_ids or []
            if ch.logprobs is not None:
                lps += ch.logprobs.token_logprobs
    assert len(ids) == 5 == len(lps)
    ref = ref_logprobs(om, p + ids, temperature=0.7)  # the distribution the tokens were drawn from
    for k, t in enumerate(ids):
        assert abs(lps[k] - ref[len(p) - 1 + k, t].item()) < 1e-4
    # chat: logprobs + top_logprobs
    r = c.chat.completions.create(model=MODEL, messages=[{"role": "user", "content": "w5 w6"}], max_tokens=4,
                                  temperature=0, logprobs=True, top_logprobs=2, extra_body=GREEDY)
    raw = r.model_dump()["choices"][0]
    ref = ref_logprobs(om, raw["prompt_token_ids"] + raw["token_ids"])
    content = r.choices[0].logprobs.content
    assert len(content) == 4
    for k, (entry, t) in enumerate(zip(content, raw["token_ids"])):
        row = ref[len(raw["prompt_token_ids"]) - 1 + k]
        assert entry.token == f"w{t}" and abs(entry.logprob - row[t].item()) < 1e-4
        assert [int(e.token[1:]) for e in entry.top_logprobs] == row.topk(2).indices.tolist()
        assert entry.top_logprobs[0].token == entry.token  # greedy: the top-1 is the chosen token


def test_n_choices_seeded_and_greedy(server, reference):
    c = client(server)
    p = reference["prompts"][5]
    kw = dict(model=MODEL, prompt=p, max_tokens=6, temperature=0.9, seed=7, n=3, extra_body=GREEDY)
    a = [ch.token_ids for ch in c.completions.create(**kw).choices]
    b = [ch.token_ids for ch in c.completions.create(**kw).choices]
    assert a == b and len(a) == 3  # seeded n = 3: reproducible
    assert len({tuple(x) for x in a}) > 1  # and the choices are not copies of each other
    r = c.completions.create(model=MODEL, prompt=p, max_tokens=6, temperature=0, n=3, extra_body=GREEDY)
    assert [ch.index for ch in r.choices] == [0, 1, 2]
    assert [ch.token_ids for ch in r.choices] == [reference["tokens"][5]] * 3
    assert r.usage.prompt_tokens == len(p) and r.usage.completion_tokens == 18
    # streaming n = 2: each choice's chunks carry its index
    got: dict[int, list[int]] = {0: [], 1: []}
    for chunk in c.completions.create(model=MODEL, prompt=p, max_tokens=6, temperature=0, n=2, stream=True,
                                      extra_body=GREEDY):
        for ch in chunk.choices:
            got[ch.index] += ch.token_ids or []
    assert got == {0: reference["tokens"][5], 1: reference["tokens"][5]}


def _penalised(row: torch.Tensor, prompt: list[int], gen: list[int], rep: float, freq: float, pres: float,
               bias: dict[int, float]) -> torch.Tensor:
    """The reference: HF's repetition penalty over prompt + generated tokens, OpenAI's frequency and
    presence penalties over generated tokens, then the logit bias."""
    x = row.clone().double()
    for t in set(prompt + gen):
        x[t] = x[t] / rep if x[t] > 0 else x[t] * rep
    for t in set(gen):
        x[t] -= freq * gen.count(t) + pres
    for t, b in bias.items():
        x[t] += b
    return x


@pytest.mark.parametrize("rep,freq,pres,bias", [(1.0, 1.5, 0.0, {}), (1.0, 0.0, 1.2, {}), (3.0, 0.0, 0.0, {}),
                                                (1.0, 0.0, 0.0, {"7": 8.0, "9": -100.0})])
def test_penalties_and_logit_bias_against_a_reference(server, om, rep, freq, pres, bias):
    p = prompt_ids(11, 6)
    r = client(server).completions.create(model=MODEL, prompt=p, max_tokens=24, temperature=0,
                                          presence_penalty=pres, frequency_penalty=freq, logit_bias=bias,
                                          extra_body={**GREEDY, "repetition_penalty": rep})
    got = r.choices[0].token_ids
    gen: list[int] = []
    for _ in range(24):  # long enough that greedy repeats tokens (and the penalties matter)
        row = om.prefill_logits(p + gen)[-1]
        gen.append(int(_penalised(row, p, gen, rep, freq, pres, {int(k): v for k, v in bias.items()}).argmax()))
    assert got == gen
    plain = client(server).completions.create(model=MODEL, prompt=p, max_tokens=24, temperature=0,
                                              extra_body=GREEDY).choices[0].token_ids
    assert got != plain  # the penalty changed something


def test_concurrent_streaming_clients(server, reference):
    async def one(ac: AsyncOpenAI, i: int) -> list[int]:
        ids = []
        stream = await ac.completions.create(model=MODEL, prompt=reference["prompts"][i], max_tokens=6,
                                             temperature=0, stream=True, extra_body=GREEDY)
        async for ch in stream:
            for choice in ch.choices:
                ids += choice.token_ids or []
        return ids

    async def main(n: int) -> list[list[int]]:
        ac = AsyncOpenAI(base_url=f"{server}/v1", api_key="unused", max_retries=0, timeout=300)
        try:
            return await asyncio.gather(*(one(ac, i) for i in range(n)))
        finally:
            await ac.close()

    for n in (32, 64):
        got = asyncio.run(main(n))
        assert got == reference["tokens"][:n]  # none lost, none mixed up, each equal to generate()
        wait_pages_free(server)


def test_client_dropped_mid_stream_frees_its_pages(server):
    # long enough to be running still when the client leaves (the engine core does ~1k steps/s here)
    body = {"model": MODEL, "prompt": prompt_ids(40), "max_tokens": 500, "temperature": 0, "stream": True,
            "ignore_eos": True, "return_token_ids": True}
    with httpx.Client(timeout=30) as h:
        with h.stream("POST", f"{server}/v1/completions", json=body) as resp:
            assert resp.status_code == 200
            seen = 0
            for line in resp.iter_lines():
                if line.startswith("data: ") and json.loads(line[6:]).get("choices", [{}])[0].get("token_ids"):
                    seen += 1
                if seen == 2:  # still reading: the request runs and holds pages
                    assert metric(server, "autodeploy_cache_pages_used") > 0
                    break  # leaving the iterator closes the connection (httpcore)
    wait_pages_free(server)  # closing the connection cancelled it
    r = client(server).completions.create(model=MODEL, prompt=prompt_ids(41), max_tokens=2, temperature=0,
                                          extra_body=GREEDY)
    assert len(r.choices[0].token_ids) == 2


# ----------------------------------------------------------------------------- bad requests
def _error(resp: httpx.Response, status: int, *fragments: str) -> dict:
    assert resp.status_code == status, resp.text
    err = resp.json()["error"]
    assert set(err) >= {"message", "type", "param", "code"}
    for f in fragments:
        assert f in err["message"], err["message"]
    assert "Value error" not in err["message"]
    return err


def test_bad_requests_get_4xx_and_disturb_no_other_request(server, reference):
    long_body = {"model": MODEL, "prompt": reference["prompts"][3], "max_tokens": 30, "temperature": 0,
                 "stream": True, "ignore_eos": True, "return_token_ids": True}
    m = {"model": MODEL}

    async def main() -> tuple[list[int], list[httpx.Response]]:
        async with httpx.AsyncClient(base_url=server, timeout=60) as h:
            async def stream() -> list[int]:
                ids = []
                async with h.stream("POST", "/v1/completions", json=long_body) as resp:
                    async for line in resp.aiter_lines():
                        if line.startswith("data: ") and line != "data: [DONE]":
                            for ch in json.loads(line[6:])["choices"]:
                                ids += ch.get("token_ids") or []
                return ids

            task = asyncio.create_task(stream())
            await asyncio.sleep(0.05)
            post = lambda body, **kw: h.post("/v1/completions", content=json.dumps(body),  # noqa: E731
                                              headers={"content-type": "application/json"}, **kw)
            bad = [
                await h.post("/v1/completions", content=b"{not json", headers={"content-type": "application/json"}),
                await post(["a list"]),
                await post({"model": "nope", "prompt": [5]}),
                await post(m),
                await post({**m, "prompt": [5], "temperature": -1}),
                await post({**m, "prompt": [5], "top_p": 0}),
                await post({**m, "prompt": [5], "n": 0}),
                await post({**m, "prompt": [5], "max_tokens": 0}),
                await post({**m, "prompt": [2 + i % 200 for i in range(600)], "max_tokens": 4}),
                await post({**m, "prompt": [5, 300], "max_tokens": 4}),
                await post({**m, "prompt": [5], "max_tokens": 600}),
                await h.post("/v1/chat/completions", json={**m, "messages": []}),
                await post({**m, "prompt": [True, False]}),
                await post({**m, "prompt": [5], "max_tokens": "4"}),
                await post({**m, "prompt": [5], "temperature": math.nan}),
                await post({**m, "prompt": 5}),
                await post({**m, "prompt": [5], "stop_token_ids": [300]}),
                await post({**m, "prompt": [5], "logit_bias": {"abc": 1}}),
                await post({**m, "prompt": [5], "logit_bias": {"300": 1}}),
                await post({**m, "prompt": [5], "logprobs": 21}),
                await post({**m, "prompt": [5], "presence_penalty": 3}),
                await post({**m, "prompt": [5], "repetition_penalty": 0}),
                await post({**m, "prompt": [5], "best_of": 2}),
                await h.post("/v1/chat/completions", json={**m, "messages": [{"role": "user", "content": "w5"}],
                                                           "top_logprobs": 2}),
            ]
            return await task, bad

    ids, bad = asyncio.run(main())
    _error(bad[0], 400, "malformed JSON")
    _error(bad[1], 400, "JSON object")
    assert _error(bad[2], 404, "'nope'")["code"] == "model_not_found"
    assert _error(bad[3], 400, "prompt")["param"] == "prompt"
    assert _error(bad[4], 400, "temperature")["param"] == "temperature"
    _error(bad[5], 400, "top_p")
    _error(bad[6], 400, "n:")
    _error(bad[7], 400, "max_tokens")
    _error(bad[8], 400, "512")  # 600 prompt tokens against max_seq_len 512
    _error(bad[9], 400, "300")  # a token id outside the vocabulary
    _error(bad[10], 400, "512")  # prompt + max_tokens over max_seq_len
    _error(bad[11], 400, "messages")
    _error(bad[12], 400, "prompt", "token ids")  # booleans are not token ids
    _error(bad[13], 400, "max_tokens", "integer")  # "4" is not an integer
    assert _error(bad[14], 400, "temperature", "finite")["param"] == "temperature"
    _error(bad[15], 400, "prompt: must be a string, a list of strings, a list of token ids", "got a value of type int")
    assert _error(bad[16], 400, "stop_token_ids", "300")["param"] == "stop_token_ids"
    _error(bad[17], 400, "logit_bias", "'abc'")
    _error(bad[18], 400, "logit_bias", "300")
    _error(bad[19], 400, "logprobs")
    _error(bad[20], 400, "presence_penalty")
    _error(bad[21], 400, "repetition_penalty")
    _error(bad[22], 400, "best_of")
    _error(bad[23], 400, "top_logprobs needs logprobs")
    assert len(ids) == 30  # the stream ran to the end meanwhile
    assert ids[:6] == reference["tokens"][3]


def test_openai_client_raises_typed_errors(server):
    c = client(server)
    with pytest.raises(openai.NotFoundError):
        c.completions.create(model="other", prompt=[5], max_tokens=1)
    with pytest.raises(openai.BadRequestError) as exc:
        c.completions.create(model=MODEL, prompt=[5], max_tokens=1, logprobs=50)
    assert "logprobs" in str(exc.value)


# ----------------------------------------------------------------------------- bench against the server
def test_bench_in_process_and_against_the_server(server, om, tmp_path):
    wl = bench.Workload.synthetic(6, (3, 9), (2, 5), om.vocab_size, seed=3)
    local = bench.run_in_process(om, wl)
    assert local["failed"] == 0 and local["generated_tokens"] == sum(r.max_tokens for r in wl.requests)
    remote = bench.run_against_server(server, wl, max_concurrency=2, model=MODEL)
    assert remote["failed"] == 0 and remote["generated_tokens"] == local["generated_tokens"]
    for r in (local, remote):
        for key in ("ttft_ms", "tpot_ms", "itl_ms"):
            assert r[key]["p50"] is not None and r[key]["p50"] <= r[key]["p99"]
    paths = bench.write_results([local, remote], tmp_path, {"command": "test"})
    saved = json.loads(paths[0].read_text())
    assert [r["mode"] for r in saved["runs"]] == ["in-process", "server"]
    # multi-turn: each turn's prompt is the previous prompt + its answer + a question; TTFT per turn
    chat = bench.Workload.multi_turn(2, 3, (9, 9), (3, 3), (4, 4), om.vocab_size, seed=5)
    remote = bench.run_against_server(server, chat, max_concurrency=2, model=MODEL)
    assert remote["failed"] == 0 and sorted(remote["per_turn"]) == ["0", "1", "2"]
    assert remote["cached_tokens"] >= 2 * (8 + 16)  # turn t takes turn t-1's full prompt pages (9, 16 tokens)


def test_cli_bench_against_url(server, tmp_path, capsys):
    from autodeploy_mla.cli import main

    small = ["--num-requests", "3", "--prompt-len", "4:8", "--output-len", "3"]
    assert main(["bench", "--url", server, *small, "--max-concurrency", "2", "--out", str(tmp_path / "b")]) == 0
    run = json.loads((tmp_path / "b" / "bench.json").read_text())["runs"][0]
    assert run["failed"] == 0 and run["generated_tokens"] == 9 and run["model"] == MODEL
    assert "TTFT" in capsys.readouterr().out


# ----------------------------------------------------------------------------- thread core, start-up, failure, shutdown
def test_thread_core_over_a_built_model(om, reference):
    """`ServerThread(om)`: the same server over a model built already, its engine core in a thread."""
    srv = ServerThread(om, None, MODEL)
    with srv as url:
        h = httpx.Client(base_url=url, timeout=30)
        _error(h.post("/v1/completions", json={"model": MODEL, "prompt": "w5 w6"}), 400, "token ids")
        _error(h.post("/v1/chat/completions", json={"model": MODEL, "messages": [{"role": "user", "content": "x"}]}),
               400, "chat template")
        _error(h.post("/v1/completions", json={"model": MODEL, "prompt": [5], "stop": "x"}), 400, "stop_token_ids")
        r = h.post("/v1/completions", json={"model": MODEL, "prompt": reference["prompts"][4], "max_tokens": 6,
                                            "temperature": 0, **GREEDY}).json()
        assert r["choices"][0]["token_ids"] == reference["tokens"][4] and r["choices"][0]["text"] == ""
        h.close()
    assert srv.client.pages_leaked == 0 and om.allocator.num_free == om.allocator.num_usable


def test_health_while_starting_then_engine_killed_gives_503_and_exit_code(cfg):
    srv = ServerThread(cfg, None, MODEL, wait_ready=False, failure_grace_s=1.0)
    url = srv.start()
    first = httpx.get(f"{url}/health")
    assert first.status_code == 503 and first.json()["status"] == "starting"
    _error(httpx.post(f"{url}/v1/completions", json={"model": MODEL, "prompt": [5]}), 503, "starting")
    assert srv.client.state == "starting"
    deadline = time.monotonic() + 300
    while httpx.get(f"{url}/health").status_code != 200:
        assert time.monotonic() < deadline and srv.client.state != "failed", srv.client.error
        time.sleep(0.1)
    body = {"model": MODEL, "prompt": prompt_ids(60), "max_tokens": 500, "temperature": 0, "stream": True,
            "ignore_eos": True, "return_token_ids": True}
    events = []
    with httpx.Client(timeout=30) as h, h.stream("POST", f"{url}/v1/completions", json=body) as resp:
        for line in resp.iter_lines():
            if line.startswith("data: "):
                events.append(line)
            if len(events) == 2:
                os.kill(srv.client.core.pid, signal.SIGKILL)  # the engine process dies mid-stream
    assert "error" in json.loads(events[-1][6:]) and "signal 9" in events[-1]  # the stream ends with an error
    bad = httpx.post(f"{url}/v1/completions", json={"model": MODEL, "prompt": [5]})
    if bad.status_code != 0:  # the server may already be going down: then the connection is refused
        _error(bad, 503, "engine")
        assert httpx.get(f"{url}/health").status_code == 503
    srv._thread.join(30)  # it stops on its own, with a failure exit code
    assert not srv._thread.is_alive() and srv.server.exit_code == 1


def test_shutdown_cancels_running_requests(cfg):
    srv = ServerThread(cfg, None, MODEL, drain_timeout_s=0.0)
    url = srv.start()
    body = {"model": MODEL, "prompt": prompt_ids(50), "max_tokens": 500, "temperature": 0, "stream": True,
            "ignore_eos": True, "return_token_ids": True}
    lines = []
    with httpx.Client(timeout=30) as h, h.stream("POST", f"{url}/v1/completions", json=body) as resp:
        for line in resp.iter_lines():
            lines.append(line)
            if sum(ln.startswith("data: ") for ln in lines) == 3:
                srv.stop()
    assert srv._thread is not None and not srv._thread.is_alive()
    data = [json.loads(ln[6:]) for ln in lines if ln.startswith("data: {")]
    assert len(data) < 500  # cut short, not run to the end
    assert "error" in data[-1] and "shutting down" in data[-1]["error"]["message"]
    assert srv.client.pages_leaked == 0 and not srv.client.core.is_alive()


# ----------------------------------------------------------------------------- the CLI
def test_cli_serve_and_bench_refuse_bad_flags(capsys):
    import socket

    from autodeploy_mla.cli import main

    assert main(["serve", "--port", "70000"]) == 2
    assert "--port 70000" in capsys.readouterr().out
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        s.listen()
        assert main(["serve", "--port", str(s.getsockname()[1])]) == 2
        assert "cannot listen there" in capsys.readouterr().out
    assert main(["serve", "--drain-timeout", "-1", "--port", "0"]) == 2
    assert "--drain-timeout -1" in capsys.readouterr().out
    assert main(["bench", "--request-rate", "0"]) == 2
    assert "--request-rate 0" in capsys.readouterr().out
    assert main(["bench", "--prompt-len", "40", "--output-len", "20", "--set", "runtime.max_seq_len=48"]) == 2
    assert "48" in capsys.readouterr().out  # refused before the build
    assert main(["bench", "--dataset", "/nonexistent.jsonl"]) == 2
    assert "no such file" in capsys.readouterr().out


@contextlib.contextmanager
def _serve_cli(name: str):
    """`autodeploy serve` in a subprocess (as users start it) until it answers GET /health 200;
    yields (process, url); the process is killed at the end if it is still running."""
    import subprocess
    import sys

    from autodeploy_mla.serving.server import _free_port

    port = _free_port("127.0.0.1")
    proc = subprocess.Popen([sys.executable, "-m", "autodeploy_mla.cli", "serve", "--device", "cpu", "--dtype",
                             "float32", "--port", str(port), "--served-model-name", name, "--log-level", "warning"],
                            stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
    url = f"http://127.0.0.1:{port}"
    try:
        deadline = time.monotonic() + 240
        while True:
            assert proc.poll() is None, proc.stdout.read()
            assert time.monotonic() < deadline, "the server did not come up"
            try:
                if httpx.get(f"{url}/health", timeout=1).status_code == 200:
                    break
            except httpx.TransportError:
                pass
            time.sleep(0.25)
        yield proc, url
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.wait()


def test_cli_serve_process_answers_and_stops_on_ctrl_c():
    """`autodeploy serve` as users run it: a subprocess (and its engine-core process), a client, then SIGINT."""
    with _serve_cli("tiny-cli") as (proc, url):
        r = client(url).completions.create(model="tiny-cli", prompt=[5, 6, 7], max_tokens=3, temperature=0,
                                           extra_body=GREEDY)
        assert len(r.choices[0].token_ids) == 3
        proc.send_signal(signal.SIGINT)
        assert proc.wait(timeout=60) == 0
        out = proc.stdout.read()
        assert "listening on" in out and "ready after" in out and "server stopped" in out and "Traceback" not in out
        assert "pass export" in out and "start-up:" in out  # the engine core's progress, in the server log


def test_cli_serve_exits_non_zero_when_the_engine_process_dies():
    with _serve_cli("tiny-cli") as (proc, url):
        kids = [int(x) for x in open(f"/proc/{proc.pid}/task/{proc.pid}/children").read().split()]
        assert kids, "no engine-core process"
        for k in kids:
            os.kill(k, signal.SIGKILL)
        assert proc.wait(timeout=60) == 1
        out = proc.stdout.read()
        assert "engine" in out and "signal 9" in out


@pytest.mark.gpu
def test_gpu_server_concurrent_streams():
    """On CUDA (bf16, CUDA graphs, overlapped engine, backend auto), the engine core in its own
    process: 16 concurrent streaming clients get the tokens the in-process engine gives (most of
    them: bf16 results may depend on the batch a request shared), logprobs come back finite, and
    every page comes back."""
    if not torch.cuda.is_available():
        pytest.skip("needs a CUDA GPU")
    from autodeploy_mla.testing.tiny_configs import TINY_CONFIGS

    gcfg = build_config(None, {"model": {"hf_config": TINY_CONFIGS["deepseek_v3"], "device": "cuda",
                                         "dtype": "bfloat16"},
                               "runtime": {"page_size": 16, "max_seq_len": 64, "max_num_tokens": 64,
                                           "max_batch_size": 8}})[0]
    prompts = [prompt_ids(i, 3 + i % 9) for i in range(16)]
    gom = optimize(None, gcfg)
    want = gom.generate(prompts, max_new_tokens=8, ignore_eos=True)
    del gom
    torch.cuda.empty_cache()

    async def one(ac: AsyncOpenAI, i: int) -> list[int]:
        ids = []
        async for ch in await ac.completions.create(model=MODEL, prompt=prompts[i], max_tokens=8, temperature=0,
                                                    stream=True, extra_body=GREEDY):
            ids += ch.choices[0].token_ids or [] if ch.choices else []
        return ids

    async def main(url: str) -> list[list[int]]:
        ac = AsyncOpenAI(base_url=f"{url}/v1", api_key="unused", max_retries=0, timeout=120)
        try:
            return await asyncio.gather(*(one(ac, i) for i in range(16)))
        finally:
            await ac.close()

    with ServerThread(gcfg, None, MODEL) as url:
        got = asyncio.run(main(url))
        r = client(url).completions.create(model=MODEL, prompt=prompts[0], max_tokens=4, temperature=0, logprobs=2,
                                           echo=True, n=2, extra_body=GREEDY)
        assert all(math.isfinite(v) for ch in r.choices for v in ch.logprobs.token_logprobs[1:])
        wait_pages_free(url)
    assert [len(g) for g in got] == [8] * 16 and all(0 <= t < 2**31 for g in got for t in g)
    same = sum(g == w for g, w in zip(got, want))
    assert same >= 12, f"only {same} of 16 streams equal the in-process tokens"
