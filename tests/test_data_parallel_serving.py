"""`autodeploy serve --world-size 2` on CPU (gloo, fp32): one engine-core process per data-parallel
rank (`RankedCores`), each with its own cache and requests, stepping in lock-step; the API process
sends each request to the least-loaded rank and reads both ranks' step messages. Greedy tokens
through HTTP (the `openai` client) must equal one process's `generate` on the same tiny model; every
page comes back; a rank that dies makes the server answer 503 and fail every open request."""

from __future__ import annotations

import asyncio
import os
import signal
import time

import httpx
import pytest
from openai import AsyncOpenAI, OpenAI

from autodeploy_mla.api import build_config
from autodeploy_mla.cli import main
from autodeploy_mla.serving.core_client import FAILED, STOPPED, RankedCores, data_parallel_configs
from autodeploy_mla.serving.server import ServerThread

FAMILY = "glm_4_7_flash"
RUNTIME = ["runtime.max_num_tokens=8", "runtime.page_size=4", "runtime.max_seq_len=64", "runtime.max_batch_size=4",
           "model.device=cpu", "model.dtype=float32"]
DP = ["transforms.shard.attention=data", "transforms.shard.experts=expert", "transforms.shard.mlp=replicate"]
# a chunked prefill (> max_num_tokens), a 1-token prompt, uneven lengths
PROMPTS = [[5, 9, 200, 17], [3, 3, 8, 1, 90, 2, 7, 7, 7, 100, 11], [42], [8, 1, 2, 3, 4, 5, 6, 7, 9], [77, 6],
           [12, 13, 14]]
NEW = 5
GREEDY = {"ignore_eos": True, "return_token_ids": True}


@pytest.fixture(scope="module")
def reference(optimized_family) -> list[list[int]]:
    """One process's greedy tokens (the shard options are inert at world size 1; the same build as
    test_data_parallel_attention's reference, made once per session)."""
    return optimized_family(FAMILY, [*RUNTIME, *DP]).generate([list(p) for p in PROMPTS], max_new_tokens=NEW)


def _configs(world: int = 2) -> list:
    return data_parallel_configs(build_config(FAMILY, None, [*RUNTIME, *DP])[0], world)


def _pages_used(url: str) -> float:
    for line in httpx.get(f"{url}/metrics").text.splitlines():
        if line.startswith("autodeploy_cache_pages_used "):
            return float(line.split()[1])
    raise AssertionError("autodeploy_cache_pages_used not in /metrics")


def _wait_pages_free(url: str, timeout_s: float = 20.0) -> None:
    deadline = time.monotonic() + timeout_s
    while (used := _pages_used(url)) != 0:
        assert time.monotonic() < deadline, f"{used:.0f} pages still held {timeout_s} s after the requests ended"
        time.sleep(0.05)


async def _all(url: str, prompts: list[list[int]]) -> list[list[int]]:
    async with AsyncOpenAI(base_url=f"{url}/v1", api_key="unused", max_retries=0, timeout=120) as c:
        outs = await asyncio.gather(*(c.completions.create(model="tiny", prompt=p, max_tokens=NEW, temperature=0,
                                                           extra_body=GREEDY) for p in prompts))
    return [o.choices[0].token_ids for o in outs]


def test_two_ranks_serve_one_process_tokens(reference):
    srv = ServerThread(RankedCores(_configs()), None, "tiny", drain_timeout_s=5.0)
    with srv as url:
        core = srv.client.core
        assert core.ranks == 2 and all(p is not None and p != os.getpid() for p in core.pids)
        assert srv.client.info.pages_total > 0  # both ranks' pages
        got = asyncio.run(_all(url, PROMPTS))
        assert got == reference
        assert all(n > 0 for n in srv.client.rank_requests), srv.client.rank_requests  # both ranks served
        _wait_pages_free(url)
        # a stream closed after its first tokens: the abort reaches the rank that runs it
        c = OpenAI(base_url=f"{url}/v1", api_key="unused", max_retries=0, timeout=120)
        stream = c.completions.create(model="tiny", prompt=PROMPTS[1], max_tokens=40, temperature=0, stream=True,
                                      extra_body=GREEDY)
        for i, _ in enumerate(stream):
            if i == 1:
                break
        stream.close()
        _wait_pages_free(url)
        assert all(v == 0 for v in srv.client.rank_load)  # every request's cost returned
        # idle ranks keep meeting; a request after a pause is served at once
        time.sleep(0.3)
        assert asyncio.run(_all(url, PROMPTS[:1])) == reference[:1]
    assert srv.client.state == STOPPED and srv.client.pages_leaked == 0  # both ranks stopped, nothing held


def test_a_dead_rank_fails_the_server():
    """Rank 1 killed while the ranks start (rank 0 then waits for it in vain): the server fails at
    once (503, the rank named), and stopping it stops rank 0 too. (A rank lost while serving breaks
    the others' next agreement: gloo reports the lost peer, the core exits with CoreFailed, and the
    same 503 follows; a build per rank made that case cost ~15 s more here, so it is not repeated.)"""
    srv = ServerThread(RankedCores(_configs()), None, "tiny", wait_ready=False, failure_grace_s=30.0)
    with srv as url:
        core = srv.client.core
        os.kill(core.pids[1], signal.SIGKILL)
        deadline = time.monotonic() + 30
        while srv.client.state != FAILED:
            assert time.monotonic() < deadline, "the server did not notice the dead rank"
            time.sleep(0.05)
        assert "rank 1 of 2" in srv.client.error and "signal 9" in srv.client.error, srv.client.error
        assert httpx.get(f"{url}/health").status_code == 503
    assert not core.is_alive()  # rank 0 is stopped too


def test_world_size_needs_data_parallel_attention(capsys):
    """Refused before any process starts, naming the setting (tensor-parallel serving is not built)."""
    assert main(["serve", "--world-size", "2", "--model", FAMILY, "--device", "cpu", "--port", "0"]) == 2
    out = capsys.readouterr().out
    assert "--world-size 2" in out and "transforms.shard.attention=data" in out and "'tensor'" in out, out
    with pytest.raises(ValueError, match="transforms.shard.attention=data"):
        data_parallel_configs(build_config(FAMILY, None, RUNTIME)[0], 2)
    cfgs = _configs(3)
    assert [c.transforms["shard"]["world_size"] for c in cfgs] == [3, 3, 3]
    assert all(c.transforms["shard"]["enabled"] for c in cfgs)
