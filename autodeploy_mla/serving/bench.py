"""`autodeploy bench`: throughput and latency of a workload, in process or against a server.

A `Workload` is a list of requests (prompt token ids, output length, arrival time): drawn from
length distributions (`--num-requests`, `--prompt-len A:B`, `--output-len C:D`, `--request-rate`)
or read from a JSONL file (`{"prompt_token_ids": [...]}` or `{"prompt": "text"}`, `"max_tokens"`),
or one of two prefix-sharing workloads (prefix caching, docs/prefix_caching.md):

- `shared_prefix`: every request is one shared prefix (a system prompt) + its own unique tokens;
- `multi_turn`: conversations whose turn t+1 is sent when turn t has finished, with the prompt
  turn t's prompt + turn t's answer (the tokens the model generated) + a new question. A
  conversation's first turn arrives as the arrival process says; the report gives TTFT per turn
  (`per_turn`), which prefix caching keeps flat as the history grows.

The same workload runs

- in process (`run_in_process`): the generation engine stepped directly, requests added as they
  arrive; on CUDA each step is timed on the device, so the report shows the GPU's busy time and
  the host's share of the wall time (the time the GPU waited for the host);
- against a server (`run_against_server`): one streaming `/v1/completions` request per workload
  request over HTTP (token ids in, `return_token_ids`, `ignore_eos`), at most `max_concurrency` at
  a time.

Per request: TTFT (arrival to first token), TPOT ((last - first) / (tokens - 1)) and every
inter-token latency; the report gives p50/p90/p99 of each, generated tokens/s, requests/s.
Outputs always run to their length (`ignore_eos`), so runs compare.
"""

from __future__ import annotations

import asyncio
import json
import math
import random
import statistics
import time
from collections.abc import Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Callable, Optional

from ..api import OptimizedModel
from ..runtime.sampling import SamplingParams


# ----------------------------------------------------------------------------- workloads
@dataclass(frozen=True)
class BenchRequest:
    prompt: list[int]  # with `follows`: the new question only (the history comes before it)
    max_tokens: int
    arrival_s: float  # seconds after the start of the run (with `follows`: after that turn finished)
    #: the index of the previous turn of its conversation: this one is sent once that one has
    #: finished, its prompt that one's prompt + answer + `prompt`
    follows: Optional[int] = None
    turn: int = 0


def parse_range(text: str) -> tuple[int, int]:
    """'512' -> (512, 512); '256:2048' -> (256, 2048)."""
    lo, _, hi = str(text).partition(":")
    try:
        a, b = int(lo), int(hi or lo)
    except ValueError:
        raise ValueError(f"length range {text!r}: expected N or MIN:MAX (integers)") from None
    if not 1 <= a <= b:
        raise ValueError(f"length range {text!r}: need 1 <= MIN <= MAX")
    return a, b


@dataclass
class Workload:
    requests: list[BenchRequest]
    description: str

    @classmethod
    def synthetic(cls, num_requests: int, prompt_len: tuple[int, int], output_len: tuple[int, int], vocab_size: int,
                  request_rate: float = math.inf, seed: int = 0) -> "Workload":
        """Uniform lengths in the ranges; token ids uniform over the vocabulary; arrivals a Poisson
        process at `request_rate` per second (inf: all at once)."""
        if num_requests < 1:
            raise ValueError(f"num_requests={num_requests}: must be >= 1")
        if not request_rate > 0:
            raise ValueError(f"request_rate={request_rate}: must be > 0 (inf: all at once)")
        rng = random.Random(seed)
        t, reqs = 0.0, []
        for _ in range(num_requests):
            n = rng.randint(*prompt_len)
            reqs.append(BenchRequest([rng.randrange(vocab_size) for _ in range(n)], rng.randint(*output_len), t))
            if math.isfinite(request_rate):
                t += rng.expovariate(request_rate)
        rate = "all at once" if math.isinf(request_rate) else f"{request_rate:g} req/s"
        return cls(reqs, f"{num_requests} requests, prompts {prompt_len[0]}-{prompt_len[1]} tokens, outputs "
                         f"{output_len[0]}-{output_len[1]} tokens, {rate}, seed {seed}")

    @classmethod
    def from_jsonl(cls, path: Path, tokenizer: Any = None, default_max_tokens: int = 128,
                   request_rate: float = math.inf, seed: int = 0) -> "Workload":
        rng = random.Random(seed)
        t, reqs = 0.0, []
        for i, line in enumerate(Path(path).read_text().splitlines()):
            if not line.strip():
                continue
            try:
                rec = json.loads(line)
            except json.JSONDecodeError as exc:
                raise ValueError(f"{path}:{i + 1}: not JSON: {exc}") from None
            if "prompt_token_ids" in rec:
                ids = [int(x) for x in rec["prompt_token_ids"]]
            elif "prompt" in rec:
                if tokenizer is None:
                    raise ValueError(f"{path}:{i + 1}: a text prompt needs a tokenizer; give prompt_token_ids")
                ids = list(tokenizer(rec["prompt"])["input_ids"])
            else:
                raise ValueError(f"{path}:{i + 1}: expected 'prompt_token_ids' or 'prompt'")
            reqs.append(BenchRequest(ids, int(rec.get("max_tokens", default_max_tokens)), t))
            if math.isfinite(request_rate):
                t += rng.expovariate(request_rate)
        if not reqs:
            raise ValueError(f"{path}: no requests")
        return cls(reqs, f"{len(reqs)} requests from {path}")

    @classmethod
    def shared_prefix(cls, num_requests: int, prefix_len: int, unique_len: tuple[int, int],
                      output_len: tuple[int, int], vocab_size: int, request_rate: float = math.inf,
                      seed: int = 0) -> "Workload":
        """One random prefix of `prefix_len` tokens (a system prompt) shared by every request, then
        `unique_len` random tokens of its own."""
        if prefix_len < 1:
            raise ValueError(f"prefix_len={prefix_len}: must be >= 1")
        base = cls.synthetic(num_requests, unique_len, output_len, vocab_size, request_rate, seed)
        rng = random.Random(seed + 1)
        prefix = [rng.randrange(vocab_size) for _ in range(prefix_len)]
        reqs = [BenchRequest(prefix + r.prompt, r.max_tokens, r.arrival_s) for r in base.requests]
        rate = "all at once" if math.isinf(request_rate) else f"{request_rate:g} req/s"
        return cls(reqs, f"{num_requests} requests sharing a {prefix_len}-token prefix + {_fmt_range(unique_len)} "
                         f"unique tokens, outputs {_fmt_range(output_len)} tokens, {rate}, seed {seed}")

    @classmethod
    def multi_turn(cls, num_conversations: int, turns: int, first_len: tuple[int, int], question_len: tuple[int, int],
                   output_len: tuple[int, int], vocab_size: int, request_rate: float = math.inf,
                   seed: int = 0) -> "Workload":
        """`num_conversations` chats of `turns` turns: the first prompt `first_len` random tokens,
        each later turn the previous prompt + its answer + a question of `question_len` tokens."""
        if num_conversations < 1 or turns < 1:
            raise ValueError(f"num_conversations={num_conversations}, turns={turns}: both must be >= 1")
        if not request_rate > 0:
            raise ValueError(f"request_rate={request_rate}: must be > 0 (inf: all at once)")
        rng = random.Random(seed)
        t, reqs = 0.0, []
        for _ in range(num_conversations):
            prev = None
            for k in range(turns):
                n = rng.randint(*(first_len if k == 0 else question_len))
                reqs.append(BenchRequest([rng.randrange(vocab_size) for _ in range(n)], rng.randint(*output_len),
                                         t if k == 0 else 0.0, follows=prev, turn=k))
                prev = len(reqs) - 1
            if math.isfinite(request_rate):
                t += rng.expovariate(request_rate)
        rate = "all at once" if math.isinf(request_rate) else f"{request_rate:g} conversations/s"
        return cls(reqs, f"{num_conversations} conversations x {turns} turns (first prompt {_fmt_range(first_len)}, "
                         f"questions {_fmt_range(question_len)}, answers {_fmt_range(output_len)} tokens; turn t+1 = "
                         f"turn t's prompt + answer + question), {rate}, seed {seed}")

    def prompt_len(self, i: int) -> int:
        """Request i's prompt length once its history is in (answers run to max_tokens: ignore_eos)."""
        r = self.requests[i]
        if r.follows is None:
            return len(r.prompt)
        return self.prompt_len(r.follows) + self.requests[r.follows].max_tokens + len(r.prompt)

    def full_prompt(self, i: int, prompts: dict[int, list[int]], answers: dict[int, list[int]]) -> list[int]:
        """Request i's prompt, given the prompts and answers of the turns it follows."""
        r = self.requests[i]
        return list(r.prompt) if r.follows is None else prompts[r.follows] + answers[r.follows] + list(r.prompt)


    def check_fits(self, max_seq_len: int, where: str) -> None:
        """Every request's prompt + output must fit the model's max_seq_len (else say which and why)."""
        for i, r in enumerate(self.requests):
            n = self.prompt_len(i)
            if n + r.max_tokens > max_seq_len:
                turn = f" (turn {r.turn} of a conversation)" if r.follows is not None else ""
                raise ValueError(f"request {i}{turn}: {n} prompt + {r.max_tokens} output tokens = "
                                 f"{n + r.max_tokens}, over max_seq_len={max_seq_len} of {where}; "
                                 "shorten --prompt-len/--output-len (or --turns) or raise runtime.max_seq_len")


def _fmt_range(r: tuple[int, int]) -> str:
    return str(r[0]) if r[0] == r[1] else f"{r[0]}-{r[1]}"


def server_model_card(url: str) -> dict[str, Any]:
    """The first entry of the server's /v1/models (id, max_model_len, vocab_size when it says)."""
    import httpx

    try:
        resp = httpx.get(f"{url.rstrip('/')}/v1/models", timeout=10.0)
        resp.raise_for_status()
        return resp.json()["data"][0]
    except (httpx.HTTPError, KeyError, IndexError, ValueError) as exc:
        raise ValueError(f"--url {url}: no OpenAI-compatible server answers there ({type(exc).__name__}: {exc})") from None


# ----------------------------------------------------------------------------- results
@dataclass
class RequestTiming:
    arrival: float
    token_times: list[float] = field(default_factory=list)
    error: Optional[str] = None
    turn: int = 0
    cached_tokens: Optional[int] = None  # prompt tokens the server took from its prefix cache

    @property
    def ttft(self) -> Optional[float]:
        return self.token_times[0] - self.arrival if self.token_times else None

    @property
    def tpot(self) -> Optional[float]:
        n = len(self.token_times)
        return (self.token_times[-1] - self.token_times[0]) / (n - 1) if n > 1 else None

    def itls(self) -> list[float]:
        return [b - a for a, b in zip(self.token_times, self.token_times[1:])]


def percentiles(xs: Sequence[float]) -> dict[str, Optional[float]]:
    if not xs:
        return {"p50": None, "p90": None, "p99": None, "mean": None}
    s = sorted(xs)

    def at(q: float) -> float:
        return s[min(len(s) - 1, max(0, math.ceil(q * len(s)) - 1))]

    return {"p50": at(0.5), "p90": at(0.9), "p99": at(0.99), "mean": statistics.fmean(s)}


def summarize(timings: Sequence[RequestTiming], wall_s: float, extra: Optional[dict[str, Any]] = None) -> dict[str, Any]:
    ok = [t for t in timings if t.error is None]
    gen = sum(len(t.token_times) for t in ok)
    ms = 1e3
    out = {
        "requests": len(timings),
        "failed": len(timings) - len(ok),
        "errors": sorted({t.error for t in timings if t.error})[:5],
        "generated_tokens": gen,
        "wall_s": wall_s,
        "tokens_per_s": gen / wall_s if wall_s > 0 else None,
        "requests_per_s": len(ok) / wall_s if wall_s > 0 else None,
        "ttft_ms": {k: (v * ms if v is not None else None) for k, v in
                    percentiles([t.ttft for t in ok if t.ttft is not None]).items()},
        "tpot_ms": {k: (v * ms if v is not None else None) for k, v in
                    percentiles([t.tpot for t in ok if t.tpot is not None]).items()},
        "itl_ms": {k: (v * ms if v is not None else None) for k, v in
                   percentiles([x for t in ok for x in t.itls()]).items()},
    }
    turns = sorted({t.turn for t in timings})
    if len(turns) > 1:  # multi-turn: TTFT per turn (prefix caching keeps it flat as the history grows)
        out["per_turn"] = {
            str(k): {"requests": sum(t.turn == k for t in ok),
                     "ttft_ms": {q: (v * ms if v is not None else None) for q, v in
                                 percentiles([t.ttft for t in ok if t.turn == k and t.ttft is not None]).items()}}
            for k in turns}
    cached = [t.cached_tokens for t in ok if t.cached_tokens is not None]
    if cached:
        out["cached_tokens"] = sum(cached)
    out.update(extra or {})
    return out


# ----------------------------------------------------------------------------- drivers
def run_in_process(om: OptimizedModel, workload: Workload, progress: Optional[Callable[[int], None]] = None,
                   time_steps: bool = True, overlap: Optional[bool] = None) -> dict[str, Any]:
    """Step the engine directly, adding each request when its arrival time has come.
    `overlap`: the engine's host/GPU overlap (default: the model's runtime.overlap)."""
    om.warmup()
    runner = om.runner
    runner.time_steps = time_steps
    eng = om.engine(overlap)
    reqs = workload.requests
    followers: dict[int, list[int]] = {}
    for i, r in enumerate(reqs):
        if r.follows is not None:
            followers.setdefault(r.follows, []).append(i)
    # (arrival, index) of the requests that may be sent; a later turn joins when its previous one ends
    pending = sorted((r.arrival_s, i) for i, r in enumerate(reqs) if r.follows is None)
    prompts: dict[int, list[int]] = {}
    answers: dict[int, list[int]] = {}
    timing: dict[int, RequestTiming] = {}
    by_rid: dict[int, int] = {}
    ended: list[Any] = []
    eng.on_finish = ended.append
    t0 = time.perf_counter()

    def finished(i: int, r: Any, now_s: float) -> None:
        answers[i] = list(r.generated)
        if r.finish_reason == "error":
            timing[i].error = r.error
            return
        timing[i].cached_tokens = r.cached_tokens
        for j in followers.get(i, ()):
            pending.append((now_s + reqs[j].arrival_s, j))
        pending.sort()

    try:
        while pending or eng.has_work():
            now = time.perf_counter() - t0
            while pending and pending[0][0] <= now:
                at, i = pending.pop(0)
                req = reqs[i]
                prompts[i] = workload.full_prompt(i, prompts, answers)
                timing[i] = RequestTiming(t0 + at, turn=req.turn)
                try:
                    rid = eng.add_request(prompts[i], SamplingParams(max_new_tokens=req.max_tokens, ignore_eos=True))
                except ValueError as exc:
                    timing[i].error = str(exc)
                    continue
                by_rid[rid] = i
            if not eng.has_work():
                if pending:
                    time.sleep(min(0.001, max(0.0, pending[0][0] - now)))
                continue
            new = eng.step()
            t = time.perf_counter()
            for rid, _ in new:
                timing[by_rid[rid]].token_times.append(t)
            for r in ended:
                finished(by_rid[r.id], r, t - t0)
            if progress is not None and ended:
                progress(len(ended))
            ended.clear()
        eng.drain()
        if om.device.type == "cuda":
            import torch

            torch.cuda.synchronize(om.device)
    finally:
        runner.time_steps = False
    wall = time.perf_counter() - t0
    for rid, i in by_rid.items():
        r = eng.done.get(rid)
        if r is not None and r.finish_reason == "error":
            timing[i].error = r.error
    extra: dict[str, Any] = {"steps": len(eng.steps), "mode": "in-process", "overlap": eng.overlap,
                             "prefix_caching": eng.prefix_caching, "prefix_query_tokens": eng.prefix_queries,
                             "prefix_hit_tokens": eng.prefix_hits}
    if time_steps and om.device.type == "cuda":
        busy = eng.gpu_busy_ms / 1e3
        extra.update(gpu_busy_s=busy, host_share=max(0.0, 1.0 - busy / wall), steps_by_kind=step_breakdown(eng.steps))
    return summarize([timing[i] for i in sorted(timing)], wall, extra)


def step_breakdown(steps: Sequence[Any]) -> dict[str, dict[str, float]]:
    """Count and device seconds of steps with prefill tokens vs decode-only steps."""
    out = {"prefill": {"steps": 0, "device_s": 0.0, "tokens": 0}, "decode": {"steps": 0, "device_s": 0.0, "tokens": 0}}
    for s in steps:
        k = out["prefill" if s.num_prefill_tokens else "decode"]
        k["steps"] += 1
        k["device_s"] += (s.device_ms or 0.0) / 1e3
        k["tokens"] += s.num_prefill_tokens + s.num_decode_tokens
    return out


async def _one_stream(client: Any, url: str, model: str, req: BenchRequest, prompt: list[int], start: float,
                      sem: asyncio.Semaphore, timing: RequestTiming, answer: list[int]) -> None:
    """Stream one request (sent at perf_counter time `start`); its token ids go to `answer`."""
    await asyncio.sleep(max(0.0, start - time.perf_counter()))
    async with sem:
        timing.arrival = time.perf_counter()
        body = {"model": model, "prompt": prompt, "max_tokens": req.max_tokens, "temperature": 0.0,
                "stream": True, "ignore_eos": True, "return_token_ids": True,
                "stream_options": {"include_usage": True}}
        try:
            async with client.stream("POST", f"{url}/v1/completions", json=body) as resp:
                if resp.status_code != 200:
                    timing.error = f"HTTP {resp.status_code}: {(await resp.aread())[:200]!r}"
                    return
                async for line in resp.aiter_lines():
                    if not line.startswith("data: ") or line == "data: [DONE]":
                        continue
                    chunk = json.loads(line[6:])
                    if "error" in chunk:
                        timing.error = chunk["error"].get("message", "error")
                        return
                    usage = chunk.get("usage") or {}
                    if usage.get("prompt_tokens_details"):
                        timing.cached_tokens = usage["prompt_tokens_details"].get("cached_tokens")
                    ids = [t for c in chunk.get("choices", []) for t in (c.get("token_ids") or [])]
                    now = time.perf_counter()
                    timing.token_times.extend([now] * len(ids))
                    answer.extend(ids)
        except Exception as exc:  # noqa: BLE001 - one failed request must not stop the run
            timing.error = f"{type(exc).__name__}: {exc}"


async def _run_server(url: str, model: Optional[str], workload: Workload, max_concurrency: int,
                      progress: Optional[Callable[[int], None]]) -> dict[str, Any]:
    import httpx

    url = url.rstrip("/")
    limits = httpx.Limits(max_connections=max_concurrency + 4, max_keepalive_connections=max_concurrency + 4)
    async with httpx.AsyncClient(timeout=httpx.Timeout(600.0), limits=limits) as client:
        if model is None:
            model = (await client.get(f"{url}/v1/models")).json()["data"][0]["id"]
        sem = asyncio.Semaphore(max_concurrency)
        reqs = workload.requests
        timings = [RequestTiming(0.0, turn=r.turn) for r in reqs]
        prompts: dict[int, list[int]] = {}
        answers: dict[int, list[int]] = {i: [] for i in range(len(reqs))}
        nexts = {r.follows: i for i, r in enumerate(reqs) if r.follows is not None}
        t0 = time.perf_counter()

        async def run(i: int, start: float) -> None:
            """Request i, then the turns that follow it (a conversation runs its turns in order)."""
            while True:
                prompts[i] = workload.full_prompt(i, prompts, answers)
                await _one_stream(client, url, model, reqs[i], prompts[i], start, sem, timings[i], answers[i])
                if progress is not None:
                    progress(1)
                j = nexts.get(i)
                if j is None or timings[i].error is not None:
                    return
                i, start = j, time.perf_counter() + reqs[j].arrival_s

        await asyncio.gather(*(run(i, t0 + r.arrival_s) for i, r in enumerate(reqs) if r.follows is None))
        wall = time.perf_counter() - t0
    return summarize(timings, wall, {"mode": "server", "url": url, "model": model, "max_concurrency": max_concurrency})


def run_against_server(url: str, workload: Workload, max_concurrency: int = 64, model: Optional[str] = None,
                       progress: Optional[Callable[[int], None]] = None) -> dict[str, Any]:
    """Stream every request of `workload` from the server at `url` (at most `max_concurrency` at once)."""
    if max_concurrency < 1:
        raise ValueError(f"max_concurrency={max_concurrency}: must be >= 1")
    return asyncio.run(_run_server(url, model, workload, max_concurrency, progress))


# ----------------------------------------------------------------------------- reports
def write_results(results: list[dict[str, Any]], out_dir: Path, meta: dict[str, Any]) -> list[Path]:
    """JSON (everything) and, when matplotlib is there, a plot of latency percentiles per run."""
    out_dir.mkdir(parents=True, exist_ok=True)
    paths = [out_dir / "bench.json"]
    paths[0].write_text(json.dumps({"meta": meta, "runs": results}, indent=2, default=str))
    try:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:
        return paths
    fig, axes = plt.subplots(1, 3, figsize=(14, 4))
    labels = [r.get("label", str(i)) for i, r in enumerate(results)]
    for ax, key, title in zip(axes, ("ttft_ms", "tpot_ms", "itl_ms"), ("TTFT", "TPOT", "inter-token latency")):
        for j, p in enumerate(("p50", "p90", "p99")):
            vals = [(r[key][p] or 0.0) for r in results]
            ax.bar([i + (j - 1) * 0.27 for i in range(len(results))], vals, width=0.27, label=p)
        ax.set_xticks(range(len(results)), labels, rotation=20, ha="right", fontsize=8)
        ax.set_title(f"{title} (ms)")
        ax.legend()
    fig.tight_layout()
    paths.append(out_dir / "bench.png")
    fig.savefig(paths[-1], dpi=120)
    plt.close(fig)
    return paths


def result_table(results: list[dict[str, Any]]) -> list[str]:
    def f(x: Any, nd: int = 1) -> str:
        return "-" if x is None else f"{x:.{nd}f}"

    lines = ["| run | requests | tokens/s | TTFT p50/p90/p99 ms | TPOT p50/p90/p99 ms | ITL p50/p99 ms | host share |",
             "|---|---:|---:|---|---|---|---:|"]
    per_turn = [r for r in results if r.get("per_turn")]
    for r in results:
        t, p, i = r["ttft_ms"], r["tpot_ms"], r["itl_ms"]
        host = r.get("host_share")
        lines.append(
            f"| {r.get('label', '')} | {r['requests'] - r['failed']}/{r['requests']} | {f(r['tokens_per_s'])} | "
            f"{f(t['p50'])} / {f(t['p90'])} / {f(t['p99'])} | {f(p['p50'], 2)} / {f(p['p90'], 2)} / {f(p['p99'], 2)} | "
            f"{f(i['p50'], 2)} / {f(i['p99'], 2)} | {'-' if host is None else f'{100 * host:.1f}%'} |")
    if per_turn:
        turns = sorted({int(k) for r in per_turn for k in r["per_turn"]})
        lines += ["", "| run | " + " | ".join(f"turn {k} TTFT p50 ms" for k in turns) + " |",
                  "|---|" + "---:|" * len(turns)]
        for r in per_turn:
            cells = [f(r["per_turn"].get(str(k), {}).get("ttft_ms", {}).get("p50")) for k in turns]
            lines.append(f"| {r.get('label', '')} | " + " | ".join(cells) + " |")
    return lines


__all__ = ["BenchRequest", "Workload", "parse_range", "run_in_process", "run_against_server", "summarize",
           "write_results", "result_table", "server_model_card"]
