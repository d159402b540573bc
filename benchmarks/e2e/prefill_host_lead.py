"""Is a queued prefill step waiting for the host, or for its kernels? (issue 13)

Builds one of e2e_roofline.py's model configs with fewer layers (bf16, random weights, the default
passes), warms it up, then launches fresh prefills of `--tokens` tokens back to back as the engine
queues a run of prompts (`ModelRunner.launch` without waiting), twice:

- `queued`: as the engine does; the host prepares step i+1 while the GPU runs step i;
- `ahead`: the same after a long device sleep is queued first, so every kernel of the first steps is
  queued before the GPU reaches it (the host can lead by about one step: a launch waits for the
  previous step's plan copy).

For each it prints the host time of every launch and the device time of every step (CUDA events).
If `ahead` steps are shorter than `queued` ones, the difference is device time spent waiting for the
host; what is left is kernels. Then a cProfile of three launches (host time by function).

H200, 2026-11-26: GLM-4.7-Flash, 8 layers, 2048 tokens: queued 6.97-7.00 ms per step, ahead
6.79-6.82 ms, host 4.0-4.5 ms per launch (docs/benchmarks/e2e_roofline.md, fourth session).

    python -m benchmarks.e2e.prefill_host_lead --model glm_4_7_flash --layers 8
"""

from __future__ import annotations

import argparse
import copy
import cProfile
import io
import pstats
import sys
import time

import torch

from benchmarks.lib import MODELS, StepSequence, build_model


def build(model: str, layers: int, tokens: int, variant: str):
    base = MODELS[model]()
    cfg = {**copy.deepcopy(base), "num_hidden_layers": layers}
    if "mlp_layer_types" in base:
        cfg["mlp_layer_types"] = base["mlp_layer_types"][:layers]
    MODELS[model] = lambda: cfg
    args = argparse.Namespace(batches=[], contexts=[], chunks=[tokens], quick=False, warmup=3, steps=10,
                              device="cuda")
    return build_model(model, variant, args)


def run(om, tokens: int, steps: int, sleep_ms: float) -> tuple[list[float], list[float], float]:
    """Host ms per launch, device ms per step, GPU ms per step from the first step's end to the last's."""
    r = om.runner
    ids = torch.randint(2, om.vocab_size, (tokens,)).tolist()

    def launch():
        r.allocator.ensure(0, tokens)
        try:
            return r.launch([StepSequence(0, ids, 0)], r.allocator.pages_of, {})
        finally:
            r.allocator.free(0)

    torch.cuda.synchronize()
    if sleep_ms:
        torch.cuda._sleep(int(1.7e9 * sleep_ms / 1e3))  # ~1.7 GHz SM clock: roughly sleep_ms
    host, launched = [], []
    for _ in range(steps):
        t = time.perf_counter()
        launched.append(launch())
        host.append((time.perf_counter() - t) * 1e3)
    for s in launched:
        r.collect(s)
    return host, [s.device_ms() for s in launched], launched[0].done.elapsed_time(launched[-1].done) / (steps - 1)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--model", default="glm_4_7_flash", choices=sorted(MODELS))
    ap.add_argument("--layers", type=int, default=8)
    ap.add_argument("--tokens", type=int, default=2048)
    ap.add_argument("--variant", default="inductor+moe+gemms+gate")
    ap.add_argument("--steps", type=int, default=6)
    ap.add_argument("--sleep-ms", type=float, default=60.0)
    args = ap.parse_args()
    if not torch.cuda.is_available():
        sys.exit("prefill_host_lead.py needs a CUDA GPU")
    om = build(args.model, args.layers, args.tokens, args.variant)
    t = time.perf_counter()
    om.warmup()
    print(f"{args.model}, {args.layers} layers, {args.tokens}-token prefills; warm-up {time.perf_counter() - t:.0f} s")
    om.runner.time_steps = True
    for name, sleep in (("queued", 0.0), ("queued", 0.0), ("ahead", args.sleep_ms), ("ahead", args.sleep_ms)):
        host, dev, span = run(om, args.tokens, args.steps, sleep)
        print(f"{name:6s}: host ms/launch {[round(h, 2) for h in host]}  device ms/step "
              f"{[round(d, 2) for d in dev]}  span {span:.2f} ms/step")
    pr = cProfile.Profile()
    pr.enable()
    run(om, args.tokens, 3, 0.0)
    pr.disable()
    out = io.StringIO()
    pstats.Stats(pr, stream=out).sort_stats("cumulative").print_stats(40)
    print(out.getvalue())


if __name__ == "__main__":
    main()
