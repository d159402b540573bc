"""An HTTP load generator for OpenAI-compatible servers, written independently of autodeploy_mla
(it imports nothing from the package): the official `openai` client, streaming completions,
token-id prompts with `return_token_ids`, a fixed number of requests in flight.

Token-id prompts go in `extra_body` (see `_one`). The client work (SSE parsing, the openai
client's pydantic models) is spread over `workers`
processes, each an asyncio loop with its share of the concurrency, so that at 64 streams the
generator is not the bottleneck it would be in one Python process. Requests are taken from one
shared counter, so the concurrency is global. Times are `time.monotonic()` (one clock for every
process on a Linux machine).

    from loadgen import run_load
    res = run_load("http://127.0.0.1:8000", "default", prompts, max_tokens=128, concurrency=64, workers=4)
    res["summary"]["tokens_per_s"], res["requests"][i]["token_ids"]
"""

from __future__ import annotations

import asyncio
import multiprocessing as mp
import time
from typing import Any, Optional, Sequence


def _percentiles(xs: Sequence[float]) -> dict[str, Optional[float]]:
    if not xs:
        return {"p50": None, "p90": None, "p99": None, "mean": None}
    s = sorted(xs)

    def at(q: float) -> float:
        k = (len(s) - 1) * q
        lo = int(k)
        hi = min(lo + 1, len(s) - 1)
        return s[lo] + (s[hi] - s[lo]) * (k - lo)

    return {"p50": at(0.5), "p90": at(0.9), "p99": at(0.99), "mean": sum(s) / len(s)}


async def _one(client: Any, model: str, prompt: list[int], max_tokens: int, extra: dict[str, Any]) -> dict[str, Any]:
    rec: dict[str, Any] = {"start": time.monotonic(), "chunk_times": [], "token_ids": [], "error": None}
    try:
        # The prompt rides in extra_body: passed as `prompt`, the client's parameter transform walks the
        # list element by element (~28 ms for 1150 ids on a loaded 2-core host, 3 ms this way), so
        # at 8 requests per client process the requests would leave over ~0.25 s instead of ~25 ms.
        stream = await client.completions.create(model=model, prompt=[0], max_tokens=max_tokens, temperature=0,
                                                 stream=True, extra_body={"prompt": prompt, "return_token_ids": True,
                                                                          "ignore_eos": True, **extra})
        async for chunk in stream:
            now = time.monotonic()
            for choice in chunk.choices:
                ids = getattr(choice, "token_ids", None) or (choice.model_extra or {}).get("token_ids") or []
                if ids:
                    rec["token_ids"].extend(ids)
                    rec["chunk_times"].append((now, len(ids)))
    except Exception as exc:  # noqa: BLE001 - recorded per request
        rec["error"] = f"{type(exc).__name__}: {exc}"
    rec["end"] = time.monotonic()
    return rec


def _worker(url: str, model: str, prompts: list[list[int]], max_tokens: list[int], concurrency: int,
            counter: Any, start: Any, out: Any, extra: dict[str, Any], timeout_s: float) -> None:
    from openai import AsyncOpenAI

    async def main() -> list[tuple[int, dict[str, Any]]]:
        client = AsyncOpenAI(base_url=f"{url}/v1", api_key="-", max_retries=0, timeout=timeout_s)
        done: list[tuple[int, dict[str, Any]]] = []

        async def lane() -> None:
            while True:
                with counter.get_lock():
                    i = counter.value
                    counter.value += 1
                if i >= len(prompts):
                    return
                done.append((i, await _one(client, model, prompts[i], max_tokens[i], extra)))

        start.wait()
        try:
            await asyncio.gather(*(lane() for _ in range(concurrency)))
        finally:
            await client.close()
        return done

    out.put(asyncio.run(main()))


def run_load(url: str, model: str, prompts: Sequence[Sequence[int]], max_tokens: int | Sequence[int],
             concurrency: int, workers: int = 4, extra_body: Optional[dict[str, Any]] = None,
             timeout_s: float = 600.0) -> dict[str, Any]:
    """Send every prompt (greedy, ignore_eos, streaming) with at most `concurrency` in flight, from
    `workers` client processes; returns {"summary": ..., "requests": [...] in prompt order}."""
    prompts = [list(map(int, p)) for p in prompts]
    mts = [int(max_tokens)] * len(prompts) if isinstance(max_tokens, int) else [int(m) for m in max_tokens]
    workers = max(1, min(workers, concurrency))
    lanes = [concurrency // workers + (1 if w < concurrency % workers else 0) for w in range(workers)]
    ctx = mp.get_context("spawn")
    counter, start, out = ctx.Value("i", 0), ctx.Event(), ctx.Queue()
    procs = [ctx.Process(target=_worker, args=(url, model, prompts, mts, n, counter, start, out, extra_body or {},
                                               timeout_s), daemon=True) for n in lanes]
    for p in procs:
        p.start()
    time.sleep(2.0)  # let every worker import the client before the clock starts
    t0 = time.monotonic()
    start.set()
    results: list[tuple[int, dict[str, Any]]] = []
    for _ in procs:
        results.extend(out.get(timeout=timeout_s + 60))
    for p in procs:
        p.join(timeout=30)
    reqs = [r for _, r in sorted(results, key=lambda x: x[0])]
    timeline = [[round(r["start"] - t0, 4), round(r["chunk_times"][0][0] - t0, 4) if r["chunk_times"] else None,
                 round(r["end"] - t0, 4), len(r["token_ids"])] for r in reqs]
    return {"summary": summarize(reqs, t0, concurrency, workers), "requests": reqs,
            "timeline": timeline}  # per request: sent, first token, last token (s after the start), tokens


def summarize(reqs: list[dict[str, Any]], t0: float, concurrency: int, workers: int) -> dict[str, Any]:
    ok = [r for r in reqs if r["error"] is None]
    end = max((r["end"] for r in reqs), default=t0)
    gen = sum(len(r["token_ids"]) for r in ok)
    ttft = [r["chunk_times"][0][0] - r["start"] for r in ok if r["chunk_times"]]
    tpot = [(r["chunk_times"][-1][0] - r["chunk_times"][0][0]) / (len(r["token_ids"]) - 1)
            for r in ok if len(r["token_ids"]) > 1]
    itl = [b[0] - a[0] for r in ok for a, b in zip(r["chunk_times"], r["chunk_times"][1:])]
    ms = lambda d: {k: (None if v is None else v * 1e3) for k, v in d.items()}  # noqa: E731
    return {
        "requests": len(reqs), "failed": len(reqs) - len(ok),
        "errors": sorted({r["error"] for r in reqs if r["error"]})[:5],
        "concurrency": concurrency, "client_workers": workers,
        "generated_tokens": gen, "wall_s": end - t0, "tokens_per_s": gen / (end - t0) if end > t0 else None,
        "ttft_ms": ms(_percentiles(ttft)), "tpot_ms": ms(_percentiles(tpot)), "itl_ms": ms(_percentiles(itl)),
    }
