"""MoE experts: transformers' grouped_mm forward vs our fused Triton op, per shape (issue 13).

For the MoE shapes of DeepSeek-V2-Lite (64 experts x 1408, top-6, H 2048), GLM-4.7-Flash (64 x 1536,
top-4, H 2048) and DeepSeek-V3 (256 x 2048, top-8, H 7168), and T tokens in {1, 8, 64, 512, 2048}
(uniform random top-k routing, fresh bf16 inputs): device time of one call as a CUDA-graph replay
(how decode and the static pieces run) for

- `hf_grouped_mm`: transformers' `grouped_mm_experts_forward` (what the exported graph contains),
- `triton`: `autodeploy::triton_moe_experts` with the default launch config (tuning.moe_config),
- `triton[cfg]` (with `--sweep`): other launch configs, to check the defaults.

Each is checked against an fp32 computation of the same bf16 inputs first. Floor: max(bytes read
(touched experts' weights + tokens) / measured copy bandwidth, FLOPs / measured bf16 peak).

`--shared` instead times the shared expert (fuse_moe.shared_experts): the routed op plus the shared
MLP as the graph runs it unfused (cuBLAS GEMMs, a compiled silu * up, the add) against the op with
the shared expert appended as n_shared more experts every token is routed to with weight 1.

    python -m benchmarks.moe.bench_moe --out /tmp/moe [--sweep] [--grouped-mm]
    python -m benchmarks.moe.bench_moe --out /tmp/moe --shared [--tokens 1,64,2048]
    python -m benchmarks.moe.bench_moe --render docs/benchmarks/moe.json
"""

from __future__ import annotations

import argparse
import json
import platform
import sys
import time
import types
from pathlib import Path
from typing import Any, Callable

import torch

from benchmarks.lib import graph_time_ms


#: shared experts' worth of each shape (the shared MLP's intermediate size / the experts')
N_SHARED = {"v2_lite": 2, "glm_4_7_flash": 1, "deepseek_v3": 1}
SHAPES = {  # name: (experts, top_k, hidden, intermediate)
    "v2_lite": (64, 6, 2048, 1408),
    "glm_4_7_flash": (64, 4, 2048, 1536),
    "deepseek_v3": (256, 8, 7168, 2048),
}
SWEEP = [  # (block_m, up_n, up_k, down_n, down_k, warps, stages[, sorted_tma])
    (16, 64, 128, 64, 128, 4, 4), (16, 32, 128, 64, 128, 4, 4), (16, 64, 64, 128, 64, 4, 4),
    (16, 128, 64, 128, 64, 4, 3), (32, 64, 128, 64, 128, 4, 3), (64, 64, 64, 128, 64, 4, 3),
    (64, 128, 64, 128, 64, 8, 3), (128, 64, 64, 128, 64, 8, 3), (128, 128, 64, 128, 64, 8, 3),
    (128, 128, 64, 128, 64, 8, 4), (64, 128, 64, 128, 64, 4, 4), (128, 64, 128, 128, 128, 8, 3),
    (64, 64, 64, 256, 64, 8, 3), (128, 64, 64, 256, 64, 8, 3),
    # rows copied into expert order first, GEMM operands by TMA descriptor (prefill)
    (128, 64, 64, 128, 64, 8, 3, True), (128, 64, 64, 128, 64, 8, 4, True), (128, 128, 64, 128, 64, 8, 3, True),
    (128, 128, 64, 128, 64, 8, 4, True), (128, 128, 64, 256, 64, 8, 3, True), (64, 128, 64, 128, 64, 4, 4, True),
    (128, 64, 64, 256, 64, 8, 4, True), (64, 64, 64, 128, 64, 4, 4, True), (128, 128, 128, 128, 128, 8, 3, True),
    # deeper pipelines at the same shared memory (more weight bytes in flight from HBM): BLOCK_K 32 x 7-8
    # stages, or 64-wide up / 128-wide down tiles x 6 stages
    (128, 128, 32, 256, 32, 8, 8, True), (128, 128, 32, 256, 32, 8, 7, True), (128, 64, 64, 128, 64, 8, 6, True),
]


def measure_peaks() -> dict[str, float]:
    from benchmarks.lib import measure_peaks as mp

    return mp(torch.device("cuda"), False)


def hf_forward(w_up: torch.Tensor, w_down: torch.Tensor, top_k: int) -> Callable:
    from transformers.activations import ACT2FN
    from transformers.integrations.moe import grouped_mm_experts_forward

    mod = types.SimpleNamespace(num_experts=w_up.shape[0], has_gate=True, has_bias=False, is_transposed=False,
                                has_post_expert_norm=False, _is_expert_parallel=False, gate_up_proj=w_up,
                                down_proj=w_down, act_fn=ACT2FN["silu"])
    mod._apply_gate = lambda out: mod.act_fn(out.chunk(2, dim=-1)[0]) * out.chunk(2, dim=-1)[1]
    return lambda x, ids, w: grouped_mm_experts_forward(mod, x, ids, w)


def reference(x, ids, w, w_up, w_down) -> torch.Tensor:
    t, h = x.shape
    i = w_down.shape[2]
    out = torch.zeros(t, h, dtype=torch.float32, device=x.device)
    xf = x.float()
    for j in range(ids.shape[1]):
        for e in ids[:, j].unique().tolist():
            rows = (ids[:, j] == e).nonzero().squeeze(1)
            gu = xf[rows] @ w_up[e].float().t()
            hid = torch.nn.functional.silu(gu[:, :i]) * gu[:, i:]
            out[rows] += (hid @ w_down[e].float().t()) * w[rows, j, None].float()
    return out


def _grouped_mm(a: torch.Tensor, b: torch.Tensor, offs: torch.Tensor) -> torch.Tensor:
    fn = getattr(torch.nn.functional, "grouped_mm", None) or torch._grouped_mm
    return fn(a, b, offs=offs)


def grouped_mm_candidates(x, ids, w, w_up, w_down) -> list[tuple[str, Callable]]:
    """torch's grouped GEMM (CUTLASS on SM90) for the expert products, to compare with the Triton
    kernels (issue 13 prefill): `torch_grouped_mm` = the whole computation in torch ops (rows sorted by
    expert with a stable argsort, per-expert row offsets without padding, two grouped GEMMs with
    silu(gate) * up between them, weights, scatter back, sum over top-k); `grouped_mm_gemms` = only the
    two grouped GEMMs and the activation, on rows already in expert order (the part a Triton layout +
    gather would feed)."""
    t, k = ids.shape
    e, i = w_up.shape[0], w_down.shape[2]
    w_up_t, w_down_t = w_up.transpose(-2, -1), w_down.transpose(-2, -1)

    def layout():
        flat = ids.reshape(-1)
        order = torch.argsort(flat, stable=True)
        counts = torch.zeros(e, dtype=torch.int64, device=x.device).scatter_add_(0, flat, torch.ones_like(flat))
        return order, counts.cumsum(0).to(torch.int32)

    def act_gemms(xs, offs):
        hid = _grouped_mm(xs, w_up_t, offs)
        return _grouped_mm(torch.nn.functional.silu(hid[:, :i]) * hid[:, i:], w_down_t, offs)

    def whole():
        order, offs = layout()
        y = act_gemms(x[order // k], offs) * w.reshape(-1)[order, None]
        out = torch.empty_like(y).index_copy_(0, order, y)
        return out.view(t, k, -1).float().sum(1).to(x.dtype)

    order, offs = layout()
    xs = x[order // k]
    return [("torch_grouped_mm", whole), ("grouped_mm_gemms", lambda: act_gemms(xs, offs))]


def bench_shape(name: str, tokens: list[int], sweep: bool, peaks: dict[str, float],
                grouped: bool = False, configs: list[int] | None = None) -> list[dict[str, Any]]:
    from benchmarks.lib import MoEConfig, fused_moe, moe_config

    e, k, h, i = SHAPES[name]
    dev = torch.device("cuda")
    g = torch.Generator(device=dev).manual_seed(0)
    w_up = (torch.randn(e, 2 * i, h, device=dev, generator=g) / h ** 0.5).to(torch.bfloat16)
    w_down = (torch.randn(e, h, i, device=dev, generator=g) / i ** 0.5).to(torch.bfloat16)
    hf = hf_forward(w_up, w_down, k)
    rows = []
    expert_bytes = 3 * h * i * 2
    for t in tokens:
        x = torch.randn(t, h, device=dev, generator=g).to(torch.bfloat16)
        scores = torch.rand(t, e, device=dev, generator=g)
        w, ids = torch.topk(scores.softmax(-1), k)
        touched = int(ids.unique().numel())
        floor_ms = max((touched * expert_bytes + 2 * t * h * 2) / (peaks["copy_gb_s"] * 1e9),
                       2 * t * k * 3 * h * i / (peaks["matmul_tflops"] * 1e12)) * 1e3
        ref = reference(x, ids, w, w_up, w_down)
        scale = ref.abs().max().item()
        row: dict[str, Any] = {"shape": name, "experts": e, "top_k": k, "hidden": h, "inter": i, "tokens": t,
                               "touched": touched, "floor_ms": floor_ms, "variants": {}}
        cands: list[tuple[str, Callable]] = [("hf_grouped_mm", lambda: hf(x, ids, w))]
        default = moe_config(t * k, e, h, i, torch.bfloat16, True)
        cands.append(("triton", lambda: fused_moe(x, ids, w, w_up, w_down)))
        gemms_only: set[str] = set()
        grouped_names: list[str] = []
        if grouped:
            gm = grouped_mm_candidates(x, ids, w, w_up, w_down)
            cands += gm
            grouped_names = [n for n, _ in gm]
            gemms_only.add(gm[1][0])
        if sweep:
            for c in (SWEEP if configs is None else [SWEEP[j] for j in configs]):
                cfg = MoEConfig(*c)
                if cfg == default:
                    continue
                cands.append((f"triton{list(c)}", lambda cfg=cfg: fused_moe(x, ids, w, w_up, w_down, config=cfg)))
        for vname, fn in cands:
            try:
                out = fn().float()
                # the GEMMs-only candidate returns per-slot rows, not the op's output: no error to check
                err = float("nan") if vname in gemms_only else (out - ref).abs().max().item() / max(scale, 1e-6)
                ms = graph_time_ms(fn)
                row["variants"][vname] = {"ms": ms, "rel_err": err, "x_floor": ms / floor_ms}
            except Exception as exc:  # noqa: BLE001 - a config may not compile; record it
                row["variants"][vname] = {"error": f"{type(exc).__name__}: {str(exc)[:200]}"}
        row["default_config"] = list(default.__dict__.values())
        best = min(((v["ms"], n) for n, v in row["variants"].items() if "ms" in v and n not in gemms_only),
                   default=(None, None))
        for vn in grouped_names:
            v = row["variants"].get(vn, {})
            print(f"[{name}] T={t}: {vn} {v.get('ms', v.get('error'))} (err {v.get('rel_err')})", flush=True)
        row["best"] = best[1]
        hfms = row["variants"].get("hf_grouped_mm", {}).get("ms")
        tms = row["variants"].get("triton", {}).get("ms")
        print(f"[{name}] T={t}: floor {floor_ms:.3f} ms, hf {hfms}, triton {tms} "
              f"(err {row['variants'].get('triton', {}).get('rel_err')}), best {best}", flush=True)
        rows.append(row)
    return rows


def bench_shared(name: str, tokens: list[int]) -> list[dict[str, Any]]:
    """The shared expert as n_shared more experts of the fused op vs the routed op + the shared MLP."""
    from benchmarks.lib import fused_moe

    e, k, h, i = SHAPES[name]
    s = N_SHARED[name]
    dev = torch.device("cuda")
    g = torch.Generator(device=dev).manual_seed(0)
    w_up = (torch.randn(e + s, 2 * i, h, device=dev, generator=g) / h ** 0.5).to(torch.bfloat16)
    w_down = (torch.randn(e + s, h, i, device=dev, generator=g) / i ** 0.5).to(torch.bfloat16)
    # the shared MLP as the model holds it after fuse_gemms: [gate; up] of s * i rows each, down [H, s * i]
    gu_w = torch.cat([w_up[e:, :i].reshape(s * i, h), w_up[e:, i:].reshape(s * i, h)]).contiguous()
    down_w = torch.cat([w_down[e + j] for j in range(s)], 1).contiguous()
    routed_up, routed_down = w_up[:e], w_down[:e]

    @torch.compile(dynamic=False)
    def act(gu: torch.Tensor) -> torch.Tensor:
        gate, up = gu.split(s * i, -1)
        return torch.nn.functional.silu(gate) * up

    rows = []
    for t in tokens:
        x = torch.randn(t, h, device=dev, generator=g).to(torch.bfloat16)
        w, ids = torch.topk(torch.rand(t, e, device=dev, generator=g).softmax(-1), k)
        w = w.to(torch.bfloat16)
        ids_ext = torch.cat([ids, torch.arange(e, e + s, device=dev).expand(t, s)], 1).contiguous()
        w_ext = torch.cat([w, torch.ones(t, s, device=dev, dtype=w.dtype)], 1).contiguous()

        def separate() -> torch.Tensor:
            return fused_moe(x, ids, w, routed_up, routed_down) + torch.mm(act(torch.mm(x, gu_w.t())), down_w.t())

        def as_experts() -> torch.Tensor:
            return fused_moe(x, ids_ext, w_ext, w_up, w_down)

        a, b = separate().float(), as_experts().float()
        row = {"shape": name, "tokens": t, "n_shared": s, "shared_mib": 3 * h * i * s * 2 / 2 ** 20,
               "routed_ms": graph_time_ms(lambda: fused_moe(x, ids, w, routed_up, routed_down)),
               "separate_ms": graph_time_ms(separate), "as_experts_ms": graph_time_ms(as_experts),
               "rel_diff": (a - b).abs().max().item() / a.abs().max().item()}
        print(f"[{name}] T={t}: routed {row['routed_ms']:.4f}, + shared MLP {row['separate_ms']:.4f}, shared as "
              f"expert(s) {row['as_experts_ms']:.4f} ms ({row['as_experts_ms'] / row['separate_ms']:.3f}x), "
              f"rel diff {row['rel_diff']:.1e}", flush=True)
        rows.append(row)
    return rows


def render_shared(path: Path) -> None:
    data = json.loads(path.read_text())
    meta = data["meta"]
    lines = ["# The shared expert in the fused MoE op (fuse_moe.shared_experts)", "",
             f"Machine: {meta['gpu']}, torch {meta['torch']}, triton {meta.get('triton')}.", "",
             f"Command: `{meta['command']}`", "",
             "ms per call, CUDA-graph replay. routed: the fused op over the routed experts alone; + shared MLP: "
             "that plus the shared MLP as the unfused graph runs it (cuBLAS [gate; up] GEMM, a compiled silu * up, "
             "cuBLAS down GEMM, the add); as expert(s): the op with the shared MLP appended as n_shared more "
             "experts every token is routed to with weight 1. rel diff: max |difference| / max |output|.", "",
             "| shape | shared MiB | T | routed ms | + shared MLP ms | as expert(s) ms | ratio | rel diff |",
             "|---|---:|---:|---:|---:|---:|---:|---:|"]
    for r in data["rows"]:
        lines.append(f"| {r['shape']} | {r['shared_mib']:.0f} | {r['tokens']} | {r['routed_ms']:.4f} | "
                     f"{r['separate_ms']:.4f} | {r['as_experts_ms']:.4f} | "
                     f"{r['as_experts_ms'] / r['separate_ms']:.3f}x | {r['rel_diff']:.1e} |")
    path.with_suffix(".md").write_text("\n".join(lines) + "\n")


def render(path: Path) -> None:
    data = json.loads(path.read_text())
    meta = data["meta"]
    lines = ["# MoE experts: transformers grouped_mm vs fused Triton (device time per call, CUDA-graph replay)", "",
             f"Machine: {meta['gpu']}, torch {meta['torch']}, triton {meta.get('triton')}. Peaks: copy "
             f"{meta['peaks']['copy_gb_s']:.0f} GB/s, bf16 matmul {meta['peaks']['matmul_tflops']:.0f} TFLOP/s.", "",
             f"Command: `{meta['command']}`", "",
             "Floor = max(touched experts' weights + tokens / copy bandwidth, FLOPs / bf16 peak). rel err: max |out - "
             "fp32 reference| / max |reference| (bf16 inputs).", "",
             "| shape | T | experts touched | floor ms | hf grouped_mm ms | triton ms | triton x floor | speed-up | "
             "rel err | best config |",
             "|---|---:|---:|---:|---:|---:|---:|---:|---:|---|"]
    for r in data["rows"]:
        v = r["variants"]
        hf = v.get("hf_grouped_mm", {}).get("ms")
        tr = v.get("triton", {}).get("ms")
        sp = f"{hf / tr:.2f}x" if hf and tr else "-"
        best = r.get("best")
        bms = v.get(best, {}).get("ms") if best else None
        lines.append(f"| {r['shape']} | {r['tokens']} | {r['touched']} | {r['floor_ms']:.3f} | "
                     f"{hf if hf is None else f'{hf:.3f}'} | {tr if tr is None else f'{tr:.3f}'} | "
                     f"{tr / r['floor_ms'] if tr else float('nan'):.2f} | {sp} | "
                     f"{v.get('triton', {}).get('rel_err', float('nan')):.1e} | {best} ({bms if bms is None else f'{bms:.3f}'}) |")
    md = path.with_suffix(".md")
    md.write_text("\n".join(lines) + "\n")
    try:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt

        fig, axes = plt.subplots(1, len(SHAPES), figsize=(5 * len(SHAPES), 4))
        for ax, name in zip(axes, SHAPES):
            rs = [r for r in data["rows"] if r["shape"] == name]
            if not rs:
                continue
            ts = [r["tokens"] for r in rs]
            for vn, style in (("hf_grouped_mm", "o-"), ("triton", "s-")):
                ax.plot(ts, [r["variants"].get(vn, {}).get("ms", float("nan")) / r["floor_ms"] for r in rs], style,
                        label=vn)
            ax.set_xscale("log", base=2)
            ax.set_title(name)
            ax.set_xlabel("tokens")
            ax.set_ylabel("x floor")
            ax.axhline(1.0, color="gray", lw=0.5)
            ax.legend()
        fig.tight_layout()
        fig.savefig(path.with_suffix(".png"), dpi=110)
    except ImportError:
        pass


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--out", type=Path)
    ap.add_argument("--render", type=Path)
    ap.add_argument("--shapes", default=",".join(SHAPES))
    ap.add_argument("--tokens", default="1,8,64,512,2048")
    ap.add_argument("--sweep", action="store_true")
    ap.add_argument("--configs", help="with --sweep: only these SWEEP indices (comma-separated, negative from the "
                    "end); each config compiles its own kernels, so a full sweep takes minutes per shape")
    ap.add_argument("--grouped-mm", action="store_true", help="add torch's grouped GEMM (whole op, GEMMs only)")
    ap.add_argument("--shared", action="store_true", help="time the shared expert as expert(s) of the op instead")
    args = ap.parse_args()
    if args.render:
        if "shared" in json.loads(args.render.read_text()).get("meta", {}).get("mode", ""):
            render_shared(args.render)
        else:
            render(args.render)
        return
    import triton
    import transformers

    configs = [int(j) for j in args.configs.split(",")] if args.configs else None
    if configs is not None:
        bad = [j for j in configs if not -len(SWEEP) <= j < len(SWEEP)]
        if bad:
            ap.error(f"--configs {bad}: SWEEP has {len(SWEEP)} configs (indices {-len(SWEEP)}..{len(SWEEP) - 1})")
    args.out.mkdir(parents=True, exist_ok=True)
    peaks = measure_peaks()
    meta = {"command": "python " + " ".join(sys.argv), "gpu": torch.cuda.get_device_name(), "torch": torch.__version__,
            "triton": triton.__version__, "transformers": transformers.__version__, "python": platform.python_version(),
            "peaks": peaks}
    data: dict[str, Any] = {"meta": meta, "rows": []}
    if args.shared:
        meta["mode"] = "shared"
        out = args.out / "moe_shared.json"
        for name in args.shapes.split(","):
            data["rows"] += bench_shared(name, [int(t) for t in args.tokens.split(",")])
            out.write_text(json.dumps(data, indent=1))
        render_shared(out)
        print(out.with_suffix(".md").read_text())
        return
    out = args.out / "moe.json"
    t0 = time.perf_counter()
    for name in args.shapes.split(","):
        data["rows"] += bench_shape(name, [int(t) for t in args.tokens.split(",")], args.sweep, peaks,
                                    args.grouped_mm, configs)
        meta["total_s"] = time.perf_counter() - t0
        out.write_text(json.dumps(data, indent=1))
        torch.cuda.empty_cache()
    render(out)
    print(out.with_suffix(".md").read_text())


if __name__ == "__main__":
    main()
