"""Few-row dense GEMMs of decode: cuBLAS (`F.linear`) against the skinny Triton kernel (issue 13).

For the dense linears of a model config at batch-1..16 decode (after fuse_gemms: the fused query +
latent projection, q_b_proj, o_proj, the shared and the dense MLP's gate|up and down, lm_head;
shapes derived from the config), device time of one call as it runs in a decode CUDA graph: several
calls captured back to back, each on its own copy of the weight so that, as in the model, every
call reads its weight from HBM and not from L2. Floor: bytes (weight + x + y) over the measured copy
bandwidth. Every variant is checked against an fp64 product of the same bf16 inputs first.

Variants: `cublas` (F.linear), `skinny` (the shipped config rule), with `--sweep` the SWEEP configs
plain, `+pf` (each program asks L2 for its whole weight slice first) and `+pf+pdl` (also launched
with programmatic dependent launch: a kernel starts fetching its weights while the previous one
finishes). `... +ew` variants put a small elementwise kernel (not PDL-aware, as most of a decode
step's neighbours are) before every GEMM; compare them with `cublas+ew`.

    python -m benchmarks.kernels.bench_skinny_gemm --out /tmp/skinny [--models v2_lite,glm_4_7_flash] [--rows 1,2,4,8,16]
    python -m benchmarks.kernels.bench_skinny_gemm --render docs/benchmarks/skinny_gemm.json
"""

from __future__ import annotations

import argparse
import json
import platform
import sys
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Callable, Optional

import torch
import triton
import triton.language as tl


from benchmarks.lib import (
    GLM_47_FLASH,
    V2_LITE,
    graph_time_ms,
    v3_4layer,
)

# ----------------------------------------------------------------------------- the kernel
# A diagnostic kernel, not the package's: cuBLAS is within ~1 us of its best config on every shape
# that matters (docs/benchmarks/skinny_gemm.md), so the model keeps F.linear.
#: the most rows of x the kernel is for: beyond it the weight read stops dominating (8 rows x 2 flops
#: per weight byte pair is still far below the H200's ~170 flops/byte ridge, but cuBLAS's own
#: tensor-core tiles start to fill)
MAX_ROWS = 16


@dataclass(frozen=True)
class SkinnyConfig:
    block_n: int  # output features per program
    block_k: int  # reduction columns per loop step
    use_dot: bool = False  # tensor cores with the rows padded to 16 (else CUDA-core fma)
    num_warps: int = 4
    num_stages: int = 3
    prefetch: bool = False  # ask L2 for the program's whole weight slice first: every byte in flight at once
    pdl: bool = False  # programmatic dependent launch: weights fetched before the previous kernel ends


@triton.jit
def skinny_gemm_kernel(x_ptr, w_ptr, b_ptr, y_ptr, M, N, K, stride_xm, stride_wn, stride_ym,
                       HAS_BIAS: tl.constexpr, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr,
                       BLOCK_K: tl.constexpr, USE_DOT: tl.constexpr, EVEN_K: tl.constexpr,
                       DOT_PRECISION: tl.constexpr, PREFETCH: tl.constexpr, PDL: tl.constexpr,
                       PF_LINES: tl.constexpr = 32):
    """One program: BLOCK_N output features of every row, the whole reduction (no split: no partial
    sums to merge, deterministic).

    With PDL the kernel lets the next kernel launch at once and touches nothing the previous kernel
    writes (x) before `gdc_wait`; the weights, which no kernel writes, are requested before it."""
    pid = tl.program_id(0)
    rn = pid * BLOCK_N + tl.arange(0, BLOCK_N)
    rm = tl.arange(0, BLOCK_M)
    rk = tl.arange(0, BLOCK_K)
    n_ok = rn < N
    m_ok = rm < M
    if PDL:
        tl.extra.cuda.gdc_launch_dependents()
    if PREFETCH:  # one 128-byte line per address: 64 bf16 (32 fp32)
        per_line: tl.constexpr = 1024 // w_ptr.dtype.element_ty.primitive_bitwidth
        rows = w_ptr + tl.minimum(rn, N - 1)[:, None].to(tl.int64) * stride_wn
        for k0 in range(0, K, per_line * PF_LINES):
            kk = tl.minimum(k0 + tl.arange(0, PF_LINES) * per_line, K - 1)
            tl.inline_asm_elementwise("prefetch.global.L2 [$1]; mov.u32 $0, 0;", "=r,l", [rows + kk[None, :]],
                                      dtype=tl.int32, is_pure=False, pack=1)
    if PDL:
        tl.extra.cuda.gdc_wait()
    w_ptrs = w_ptr + rn[:, None].to(tl.int64) * stride_wn + rk[None, :]
    x_ptrs = x_ptr + rm[:, None] * stride_xm + rk[None, :]
    if USE_DOT:
        acc = tl.zeros((BLOCK_M, BLOCK_N), tl.float32)
    else:
        acc3 = tl.zeros((BLOCK_M, BLOCK_N, BLOCK_K), tl.float32)
    for k0 in range(0, K, BLOCK_K):
        if EVEN_K:
            w = tl.load(w_ptrs, mask=n_ok[:, None], other=0.0)
            x = tl.load(x_ptrs, mask=m_ok[:, None], other=0.0)
        else:
            k_ok = (k0 + rk) < K
            w = tl.load(w_ptrs, mask=n_ok[:, None] & k_ok[None, :], other=0.0)
            x = tl.load(x_ptrs, mask=m_ok[:, None] & k_ok[None, :], other=0.0)
        if USE_DOT:
            acc = tl.dot(x, tl.trans(w), acc, input_precision=DOT_PRECISION)
        else:
            acc3 += x.to(tl.float32)[:, None, :] * w.to(tl.float32)[None, :, :]
        w_ptrs += BLOCK_K
        x_ptrs += BLOCK_K
    if not USE_DOT:
        acc = tl.sum(acc3, axis=2)
    if HAS_BIAS:
        acc += tl.load(b_ptr + rn, mask=n_ok, other=0.0).to(tl.float32)[None, :]
    y_ptrs = y_ptr + rm[:, None] * stride_ym + rn[None, :]
    tl.store(y_ptrs, acc.to(y_ptr.dtype.element_ty), mask=m_ok[:, None] & n_ok[None, :])


def skinny_config(rows: int, n: int, k: int, compiled: bool = True) -> SkinnyConfig:
    """The launch config for `rows` rows against an [n, k] weight."""
    if not compiled:  # TRITON_INTERPRET=1: small tiles keep the interpreter quick
        return SkinnyConfig(block_n=16, block_k=32, use_dot=rows > 4, num_warps=1, num_stages=1)
    if rows <= 2:
        return SkinnyConfig(block_n=8, block_k=256)
    if rows <= 4:
        return SkinnyConfig(block_n=8, block_k=128)
    return SkinnyConfig(block_n=32, block_k=128, use_dot=True)


def _block_m(rows: int, cfg: SkinnyConfig) -> int:
    return max(16, triton.next_power_of_2(rows)) if cfg.use_dot else triton.next_power_of_2(rows)


def skinny_gemm(x: torch.Tensor, w: torch.Tensor, bias: Optional[torch.Tensor] = None,
                cfg: Optional[SkinnyConfig] = None, out: Optional[torch.Tensor] = None) -> torch.Tensor:
    """`x @ w.T + bias` for x [..., K] with at most MAX_ROWS rows, w [N, K] (K contiguous)."""
    k = x.shape[-1]
    n = w.shape[0]
    x2 = x.reshape(-1, k)
    rows = x2.shape[0]
    if rows > MAX_ROWS:
        raise ValueError(f"skinny_gemm: {rows} rows of x; the kernel serves at most {MAX_ROWS} "
                         f"(call torch.nn.functional.linear for more)")
    if w.dim() != 2 or w.shape[1] != k:
        raise ValueError(f"skinny_gemm: weight {tuple(w.shape)} does not match x's last dim {k}; expected [N, {k}]")
    if w.stride(1) != 1 or x2.stride(-1) != 1:
        raise ValueError("skinny_gemm: x and w need a contiguous last (reduction) dim")
    if bias is not None and (bias.shape != (n,) or not bias.is_contiguous()):
        raise ValueError(f"skinny_gemm: bias {tuple(bias.shape)} must be a contiguous [{n}] vector")
    y = out if out is not None else torch.empty((rows, n), dtype=x.dtype, device=x.device)
    if rows:
        cfg = cfg or skinny_config(rows, n, k, compiled=x.is_cuda)
        skinny_gemm_kernel[(triton.cdiv(n, cfg.block_n),)](
            x2, w, bias if bias is not None else w, y, rows, n, k, x2.stride(0), w.stride(0), y.stride(0),
            HAS_BIAS=bias is not None, BLOCK_M=_block_m(rows, cfg), BLOCK_N=cfg.block_n, BLOCK_K=cfg.block_k,
            USE_DOT=cfg.use_dot, EVEN_K=k % cfg.block_k == 0,
            DOT_PRECISION="ieee" if x.dtype == torch.float32 else "tf32", PREFETCH=cfg.prefetch and x.is_cuda,
            PDL=cfg.pdl and x.is_cuda, launch_pdl=cfg.pdl and x.is_cuda, num_warps=cfg.num_warps, num_stages=cfg.num_stages)
    return y.reshape(*x.shape[:-1], n)


# ----------------------------------------------------------------------------- the benchmark

MODELS = {"v2_lite": lambda: V2_LITE, "glm_4_7_flash": lambda: GLM_47_FLASH, "v3_4layer": v3_4layer}
#: (block_n, block_k, use_dot, warps, stages) tried per shape besides the shipped rule, each plain, with
#: the L2 prefetch, and with the prefetch and programmatic dependent launch
SWEEP = [(4, 512, False, 4, 3), (8, 256, False, 4, 3), (8, 128, False, 2, 3), (16, 128, True, 4, 5),
         (32, 128, True, 4, 3), (32, 256, True, 4, 3)]
#: bytes each timed graph streams at least, so the weights it cycles through do not fit L2
STREAM_BYTES = 512 * 2**20


def linear_shapes(hf: dict[str, Any]) -> list[tuple[str, int, int, int]]:
    """(name, N, K, per-step count) of the dense linears of one decode step, as fuse_gemms leaves them."""
    h, n_heads = hf["hidden_size"], hf["num_attention_heads"]
    qk = hf["qk_nope_head_dim"] + hf["qk_rope_head_dim"]
    latent = hf["kv_lora_rank"] + hf["qk_rope_head_dim"]
    layers = hf["num_hidden_layers"]
    dense = hf.get("first_k_dense_replace", 0)
    q_lora = hf.get("q_lora_rank")
    rows = [("q_a|kv_a" if q_lora else "q|kv_a", (q_lora or n_heads * qk) + latent, h, layers)]
    if q_lora:
        rows.append(("q_b", n_heads * qk, q_lora, layers))
    rows.append(("o_proj", h, n_heads * hf["v_head_dim"], layers))
    shared = hf.get("n_shared_experts") or 0
    if shared:
        inter = shared * hf["moe_intermediate_size"]
        rows += [("shared gate|up", 2 * inter, h, layers - dense), ("shared down", h, inter, layers - dense)]
    if dense:
        rows += [("dense gate|up", 2 * hf["intermediate_size"], h, dense), ("dense down", h, hf["intermediate_size"], dense)]
    rows.append(("lm_head", hf["vocab_size"], h, 1))
    return rows


def rotating_graph_ms(make_call: Callable[[int], Callable[[], Any]], copies: int, reps: int = 20) -> float:
    """Median device time of one call: `copies` calls (call i on weight copy i) captured as one graph."""
    return graph_time_ms([make_call(i) for i in range(copies)], reps=reps)


def bench_shape(model: str, name: str, n: int, k: int, count: int, rows_list: list[int], sweep: bool,
                copy_gb_s: float) -> list[dict[str, Any]]:
    import torch.nn.functional as F

    dev = torch.device("cuda")
    wbytes = n * k * 2
    copies = max(4, min(64, -(-STREAM_BYTES // wbytes)))
    ws = [torch.randn(n, k, device=dev, dtype=torch.bfloat16) / k**0.5 for _ in range(copies)]
    out = []
    for rows in rows_list:
        x = torch.randn(rows, k, device=dev, dtype=torch.bfloat16)
        ref = (x.double() @ ws[0].double().T)
        scale = ref.abs().max().item()
        # copy_gb_s is read + write traffic: a GEMM's bytes move once
        floor_ms = (wbytes + 2 * rows * (n + k)) / (copy_gb_s * 1e9) * 1e3
        xe, ye = torch.randn(rows, 4096, device=dev, dtype=torch.bfloat16), torch.empty(rows, 4096, device=dev,
                                                                                       dtype=torch.bfloat16)

        def with_ew(call: Callable[[], Any]) -> Callable[[], Any]:
            return lambda: (torch.mul(xe, 2.0, out=ye), call())

        variants: dict[str, Callable[[int], Callable[[], Any]]] = {
            "cublas": lambda i: (lambda: F.linear(x, ws[i])),
            "cublas+ew": lambda i: with_ew(lambda: F.linear(x, ws[i]))}
        if rows <= MAX_ROWS:
            shipped = skinny_config(rows, n, k)
            variants["skinny"] = lambda i, c=shipped: (lambda: skinny_gemm(x, ws[i], cfg=c))
            variants["skinny+ew"] = lambda i, c=shipped: with_ew(lambda: skinny_gemm(x, ws[i], cfg=c))
            if sweep:
                for bn, bk, dot, warps, stages in SWEEP:
                    bm = max(16, rows) if dot else rows
                    if not dot and bm * bn * bk > 8192:  # the fma accumulator would spill
                        continue
                    for suffix, pf, pdl in (("", False, False), ("+pf", True, False), ("+pf+pdl", True, True)):
                        c = SkinnyConfig(block_n=bn, block_k=bk, use_dot=dot, num_warps=warps, num_stages=stages,
                                         prefetch=pf, pdl=pdl)
                        label = f"{'dot' if dot else 'fma'}{bn}x{bk}w{warps}s{stages}{suffix}"
                        variants[label] = lambda i, c=c: (lambda: skinny_gemm(x, ws[i], cfg=c))
                        if pdl:
                            variants[label + "+ew"] = lambda i, c=c: with_ew(lambda: skinny_gemm(x, ws[i], cfg=c))
        res: dict[str, dict[str, float]] = {}
        for vname, make in variants.items():
            try:
                y = make(0)()
                y = y[-1] if isinstance(y, tuple) else y
                err = ((y.double() - ref).abs().max().item()) / scale
                if err > 2e-2:
                    res[vname] = {"error": f"rel err {err:.2e}"}
                    continue
                ms = rotating_graph_ms(make, copies)
                res[vname] = {"ms": ms, "rel_err": err, "x_floor": ms / floor_ms}
            except Exception as e:  # a config the compiler rejects (shared memory, registers) is a row, not a crash
                res[vname] = {"error": f"{type(e).__name__}: {str(e)[:200]}"}
        timed = {v: r["ms"] for v, r in res.items() if "ms" in r and not v.endswith("+ew")}
        best = min(timed, key=timed.get) if timed else None
        row = {"model": model, "gemm": name, "n": n, "k": k, "per_step": count, "rows": rows, "floor_ms": floor_ms,
               "variants": res, "best": best}
        out.append(row)
        sk, cb = res.get("skinny", {}).get("ms"), res["cublas"].get("ms")
        print(f"{model:14s} {name:16s} N={n:6d} K={k:5d} M={rows:2d} floor {floor_ms * 1e3:7.2f} us  cublas "
              f"{(cb or float('nan')) * 1e3:7.2f}  skinny {(sk or float('nan')) * 1e3:7.2f}  best {best} "
              f"{timed.get(best, float('nan')) * 1e3:7.2f}", flush=True)
    ws.clear()
    torch.cuda.empty_cache()
    return out


def _best_triton_ms(row: dict[str, Any]) -> float:
    """The fastest Triton variant of a row (the shipped rule or any sweep config; not the +ew runs)."""
    ms = [v["ms"] for k, v in row["variants"].items() if not k.startswith("cublas") and not k.endswith("+ew")
          and "ms" in v]
    return min(ms, default=float("nan"))


def render(path: Path) -> None:
    data = json.loads(path.read_text())
    meta = data["meta"]
    lines = ["# Few-row dense GEMMs: cuBLAS vs the skinny Triton kernel (device µs per call, CUDA-graph replay)", "",
             f"Machine: {meta['gpu']}, torch {meta['torch']}, triton {meta['triton']}. Copy bandwidth "
             f"{meta['copy_gb_s']:.0f} GB/s (read + write).", "", f"Command: `{meta['command']}`", "",
             "Each call reads its own weight copy (as every layer does), so weights come from HBM. Floor: weight + x + y "
             "bytes at the copy bandwidth. `+ew`: an elementwise kernel before each GEMM (its own time included). `step µs saved`: (cuBLAS - skinny) x the GEMM's count per decode step.", "",
             "| model | GEMM | N | K | M | floor µs | cuBLAS µs (x floor) | skinny µs (x floor) | best µs (config) | "
             "cuBLAS+ew µs | best PDL+ew µs (config) | step µs saved |", "|---|---|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|"]
    for r in data["rows"]:
        v = r["variants"]
        cb, sk = v["cublas"].get("ms"), v.get("skinny", {}).get("ms")
        best = r.get("best")

        def cell(ms):
            return "-" if ms is None else f"{ms * 1e3:.2f} ({ms / r['floor_ms']:.2f}x)"

        saved = f"{(cb - sk) * 1e3 * r['per_step']:.0f}" if cb and sk else "-"
        ew = {k: x["ms"] for k, x in v.items() if k.endswith("+pdl+ew") and "ms" in x}
        bew = min(ew, key=ew.get) if ew else None
        cew = v.get("cublas+ew", {}).get("ms")
        gemm = r["gemm"].replace("|", "\\|")  # "q|kv_a": a fused GEMM's members
        lines.append(f"| {r['model']} | {gemm} | {r['n']} | {r['k']} | {r['rows']} | {r['floor_ms'] * 1e3:.2f} | "
                     f"{cell(cb)} | {cell(sk)} | {v.get(best, {}).get('ms', 0) * 1e3:.2f} ({best}) | "
                     f"{'-' if cew is None else f'{cew * 1e3:.2f}'} | "
                     f"{'-' if bew is None else f'{ew[bew] * 1e3:.2f} ({bew[:-3]})'} | {saved} |")
    path.with_suffix(".md").write_text("\n".join(lines) + "\n")
    from benchmarks.lib import pyplot

    plt = pyplot()
    if plt is None:
        return
    models = sorted({r["model"] for r in data["rows"]})
    fig, axes = plt.subplots(1, len(models), figsize=(6 * len(models), 4), squeeze=False)
    for ax, m in zip(axes[0], models):
        for g in dict.fromkeys(r["gemm"] for r in data["rows"] if r["model"] == m):
            rs = [r for r in data["rows"] if r["model"] == m and r["gemm"] == g]
            xs = [r["rows"] for r in rs]
            line, = ax.plot(xs, [r["variants"]["cublas"].get("ms", float("nan")) / r["floor_ms"] for r in rs], "o--")
            ax.plot(xs, [_best_triton_ms(r) / r["floor_ms"] for r in rs], "s-", color=line.get_color(), label=g)
        ax.set_xscale("log", base=2)
        ax.set_title(f"{m}: cuBLAS (dashed) vs the best Triton variant (solid)")
        ax.set_xlabel("rows (M)")
        ax.set_ylabel("x floor")
        ax.axhline(1.0, color="gray", lw=0.5)
        ax.legend(fontsize=7)
    fig.tight_layout()
    fig.savefig(path.with_suffix(".png"), dpi=110)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--out", type=Path)
    ap.add_argument("--render", type=Path)
    ap.add_argument("--models", default="v2_lite,glm_4_7_flash")
    ap.add_argument("--rows", default="1,2,4,8,16")
    ap.add_argument("--sweep", action="store_true", help="also time the SWEEP configs")
    args = ap.parse_args()
    if args.render:
        render(args.render)
        return
    if args.out is None:
        ap.error("--out is required (or --render)")
    unknown = [m for m in args.models.split(",") if m not in MODELS]
    if unknown:
        ap.error(f"--models {unknown}: known {sorted(MODELS)}")
    from benchmarks.lib import measure_peaks

    args.out.mkdir(parents=True, exist_ok=True)
    peaks = measure_peaks(torch.device("cuda"), False)
    meta = {"command": "python " + " ".join(sys.argv), "gpu": torch.cuda.get_device_name(), "torch": torch.__version__,
            "triton": triton.__version__, "python": platform.python_version(), "copy_gb_s": peaks["copy_gb_s"]}
    data: dict[str, Any] = {"meta": meta, "rows": []}
    out = args.out / "skinny_gemm.json"
    t0 = time.perf_counter()
    rows_list = [int(r) for r in args.rows.split(",")]
    for model in args.models.split(","):
        for name, n, k, count in linear_shapes(MODELS[model]()):
            data["rows"] += bench_shape(model, name, n, k, count, rows_list, args.sweep, peaks["copy_gb_s"])
            meta["total_s"] = time.perf_counter() - t0
            out.write_text(json.dumps(data, indent=1))
    render(out)
    print(out.with_suffix(".md").read_text())


if __name__ == "__main__":
    main()
