"""Sparse MLA (DeepSeek Sparse Attention) vs dense MLA: decode time per layer at long contexts.

DeepSeek-V3.2 dims (N 128, R 512, Dr 64, Dn 128, Dv 128; indexer 64 heads x 128, index_topk 2048),
bf16, pages of 64, batch B of decode sequences at context C. Per layer and step:
- sparse = the indexer op (append the index key, score every cached key, top-k) + the sparse MLA op
  (append the latent, attend to the top-k positions, W_V), both the Triton backend's cached ops,
  timed eagerly as the runtime runs them (they size launches from host metadata: no CUDA graph);
- dense = the dense decode core of the Triton backend (CUDA-graph replay) and FlashInfer's where it
  serves the dims (benchmarks/bench_mla_kernels.py's `bench_decode`), i.e. what the same layer costs
  when it attends to all C tokens.
The torch reference sparse op is timed where its fp32 gather fits (B*C <= 128 x 2048).

    python benchmarks/bench_sparse_mla.py --out /tmp/sparse            # H200: table + JSON + plot
    python benchmarks/bench_sparse_mla.py --out /tmp/sparse --quick    # CPU (interpreted) smoke run
"""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent))
from bench_mla_kernels import PAGE, bench_decode, machine, time_us  # noqa: E402

from autodeploy_mla.custom_ops import MLADims  # noqa: E402
from autodeploy_mla.custom_ops.attention.sparse_mla import INDEXER_METADATA  # noqa: E402
from autodeploy_mla.runtime import PageAllocator, SequenceInfo, StepSequence  # noqa: E402

V32 = MLADims(num_heads=128, qk_nope_head_dim=128, qk_rope_head_dim=64, v_head_dim=128, kv_lora_rank=512)
INDEX_HEADS, INDEX_DIM, TOPK = 64, 128, 2048
TORCH_MAX_TOKENS = 128 * 2048


def sparse_case(d: MLADims, batch: int, context: int, dtype: torch.dtype, dev: str, topk: int, heads: int, dim: int,
                new: int = 1):
    """Metadata, caches and inputs of one step: `batch` sequences at `context` cached tokens, `new`
    tokens each (1: decode; more: a prefill chunk after that context)."""
    page = PAGE if dev == "cuda" else 16
    info = SequenceInfo(batch, batch * new, context + new, page, dev)
    pages = 1 + batch * -(-(context + new) // page)
    alloc = PageAllocator(pages, page, info.max_pages_per_seq)
    alloc.ensure_many({s: context + new for s in range(batch)})
    info.prepare_step([StepSequence(s, [1] * new, context) for s in range(batch)], alloc.pages_of)
    meta = [info.get(m) for m in INDEXER_METADATA]
    g = torch.Generator(device=dev).manual_seed(batch * 7 + context)
    n, r, dr = d.num_heads, d.kv_lora_rank, d.qk_rope_head_dim
    batch = batch * new  # tokens

    def rnd(*shape):
        return torch.randn(*shape, generator=g, device=dev, dtype=torch.float32).to(dtype)

    return {
        "meta": meta,
        "indexer": (rnd(1, batch, heads, dim), rnd(1, batch, dim), torch.rand(1, batch, heads, generator=g, device=dev)),
        "index_cache": rnd(pages, page, dim),
        "mla": [rnd(1, batch, n, d.qk_nope_head_dim), rnd(1, batch, n, dr), rnd(1, batch, r), rnd(1, batch, 1, dr),
                rnd(n * (d.qk_nope_head_dim + d.v_head_dim), r) * 0.05],
        "cache": rnd(pages, page, r + dr),
        "topk": topk,
        "info": info,
        "page": page,
    }


def flashinfer_rows(c: dict, d: MLADims, dtype, dev: str, rep_ms: float, idx: torch.Tensor, triton_out: torch.Tensor,
                    row: dict) -> None:
    """The flashinfer_mla_sparse attention on the same step and selection (one-token pages), eager
    (eager wrapper) and as a graph replay (fixed-buffer wrapper); its indexer is the Triton op's."""
    from autodeploy_mla.custom_ops import using_sessions
    from autodeploy_mla.custom_ops.attention.registry import SessionSpec, Target, get_backend
    from autodeploy_mla.runtime.model_runner import step_descriptor

    be = get_backend("flashinfer_mla_sparse")
    info, topk = c["info"], c["topk"]
    target = Target.detect(dev, c["page"])
    ok = be.check(d, dtype, target)
    if not ok:
        row["fi_refused"] = ok.reason
        return
    sess = be.setup(SessionSpec((d,), dtype, torch.device(dev), target, info.max_batch_size, info.max_num_tokens,
                                info.max_pages_per_seq, (dtype,), (topk,)))
    ops = torch.ops.autodeploy

    def attend():
        return ops.flashinfer_mla_sparse_with_cache(*c["mla"], *c["meta"], idx, c["cache"])

    with using_sessions({be.name: sess}):
        sess.prepare(info, step_descriptor(info, ()))
        out = attend().float()
        row["fi_vs_triton_rel"] = float((out - triton_out).abs().max() / triton_out.abs().max())
        row["fi_sparse_attn_eager_us"], _ = time_us(attend, graph=False, rep_ms=rep_ms)
        if info.num_prefill_seqs == 0:
            sess.prepare(info, step_descriptor(info, (info.num_decode_seqs,)))
            row["fi_sparse_attn_us"], row["fi_sparse_attn_how"] = time_us(attend, graph=True, rep_ms=rep_ms)
    # the selection is the Triton indexer op's (the backend uses it)
    row["fi_sparse_us"] = row["indexer_us"] + row.get("fi_sparse_attn_us", row["fi_sparse_attn_eager_us"])
    row["fi_sparse_eager_us"] = row["indexer_eager_us"] + row["fi_sparse_attn_eager_us"]


def bench_sparse(d: MLADims, batch: int, context: int, dtype, dev: str, rep_ms: float, topk: int, heads: int,
                 dim: int, with_dense: bool, new: int = 1, with_fi: bool = False) -> dict:
    c = sparse_case(d, batch, context, dtype, dev, topk, heads, dim, new)
    row = {"batch": batch, "context": context, "new_tokens": new, "topk": topk, "N": d.num_heads}
    ops = torch.ops.autodeploy

    def indexer(prefix="triton"):
        return getattr(ops, f"{prefix}_dsa_indexer_with_cache")(*c["indexer"], *c["meta"], c["index_cache"], topk, dim ** -0.5)

    idx = indexer()
    row["selected_per_token"] = float((idx >= 0).sum(-1).float().mean())

    def attend(prefix="triton"):
        return getattr(ops, f"{prefix}_mla_sparse_with_cache")(*c["mla"], *c["meta"], idx, c["cache"])

    row["indexer_eager_us"], _ = time_us(indexer, graph=False, rep_ms=rep_ms)
    row["sparse_attn_eager_us"], _ = time_us(attend, graph=False, rep_ms=rep_ms)
    # as a captured decode step runs them (static sizes: the page table's full width)
    row["indexer_us"], row["indexer_how"] = time_us(indexer, graph=True, rep_ms=rep_ms)
    row["sparse_attn_us"], row["sparse_attn_how"] = time_us(attend, graph=True, rep_ms=rep_ms)
    row["sparse_us"] = row["indexer_us"] + row["sparse_attn_us"]
    row["sparse_eager_us"] = row["indexer_eager_us"] + row["sparse_attn_eager_us"]
    if with_fi:
        flashinfer_rows(c, d, dtype, dev, rep_ms, idx, attend().float(), row)
    if batch * context <= TORCH_MAX_TOKENS and new == 1:
        ref = attend("torch").float()
        out = attend().float()
        row["triton_vs_torch_rel"] = float((out - ref).abs().max() / ref.abs().max())
        row["torch_sparse_attn_us"], _ = time_us(lambda: attend("torch"), graph=False, rep_ms=rep_ms)
    if with_dense and new == 1:
        dense = bench_decode("deepseek_v32", d, batch, context, dtype, torch.device(dev), rep_ms, with_fi=dev == "cuda")
        for k in ("triton_core_us", "fi_core_us", "triton_op_us"):
            if k in dense:
                row[f"dense_{k}"] = dense[k]
        best = min((dense[k] for k in ("triton_core_us", "fi_core_us") if k in dense), default=None)
        if best:
            row["dense_best_us"] = best
            row["sparse_over_dense"] = row["sparse_us"] / best
    return row


def render(res: dict, out: Path) -> None:
    lines = [f"# Sparse vs dense MLA decode per layer ({res['machine']['gpu']})", "",
             f"Command: `{res['machine']['command']}`", "",
             f"MLA dims {res['dims']} (DeepSeek-V3.2: N 128, R 512, Dr 64), indexer "
             f"{res['heads']} heads x {res['dim']}, top-k {res['topk']}, {res['dtype']}, pages of {PAGE}. Sparse = Triton "
             "indexer op (append + scores + top-k) + Triton sparse MLA op (append + gather attention + W_V), as a "
             "CUDA-graph replay (how a captured decode step runs them) and eager; dense = the best dense decode "
             "core on the same shape (Triton or FlashInfer, CUDA-graph replay).", "",
             "FI = the flashinfer_mla_sparse backend on the same step: the same Triton indexer op, then FlashInfer's "
             "MLA wrapper over one-token pages; graph replay for decode, eager for prefill chunks "
             "(`new` > 1 tokens per sequence).", "",
             "| batch | context | new | indexer us | sparse attn us | sparse total us | eager total us | "
             "FI attn us | FI total us | FI eager total us | dense best us | best sparse / dense | Triton vs torch (rel) | "
             "FI vs Triton (rel) |", "|---|---|---|---|---|---|---|---|---|---|---|---|---|---|"]
    for r in res["rows"]:
        def f(k, nd=1):
            v = r.get(k)
            return "-" if v is None else (f"{v:.{nd}f}" if isinstance(v, float) else str(v))
        fi_attn = r.get("fi_sparse_attn_us", r.get("fi_sparse_attn_eager_us"))
        best = min([v for v in (r.get("sparse_us"), r.get("fi_sparse_us")) if v is not None], default=None)
        ratio = "-" if best is None or not r.get("dense_best_us") else f"{best / r['dense_best_us']:.2f}"
        sci = (lambda k: "-" if k not in r else format(r[k], ".1e"))
        lines.append(f"| {r['batch']} | {r['context']} | {r.get('new_tokens', 1)} | {f('indexer_us')} | "
                     f"{f('sparse_attn_us')} | {f('sparse_us')} | {f('sparse_eager_us')} | "
                     f"{'-' if fi_attn is None else format(fi_attn, '.1f')} | {f('fi_sparse_us')} | "
                     f"{f('fi_sparse_eager_us')} | {f('dense_best_us')} | {ratio} | {sci('triton_vs_torch_rel')} | "
                     f"{sci('fi_vs_triton_rel')} |")
    if res.get("notes"):  # added by hand after the run
        lines += ["", "Notes:", *[f"- {n}" for n in res["notes"]]]
    (out / "sparse_mla.md").write_text("\n".join(lines) + "\n")
    print("\n".join(lines))
    try:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:
        return
    fig, ax = plt.subplots(figsize=(7, 4))
    decode = [r for r in res["rows"] if r.get("new_tokens", 1) == 1]
    for b in sorted({r["batch"] for r in decode}):
        rows = sorted((r for r in decode if r["batch"] == b), key=lambda r: r["context"])
        ax.plot([r["context"] for r in rows], [r["sparse_us"] for r in rows], marker="o", label=f"sparse Triton, batch {b}")
        fi = [(r["context"], r["fi_sparse_us"]) for r in rows if r.get("fi_sparse_us")]
        if fi:
            ax.plot(*zip(*fi), marker="s", label=f"sparse FlashInfer, batch {b}")
        pts = [(r["context"], r["dense_best_us"]) for r in rows if r.get("dense_best_us")]
        if pts:
            ax.plot(*zip(*pts), marker="x", linestyle="--", label=f"dense, batch {b}")
    ax.set_xscale("log", base=2)
    ax.set_yscale("log")
    ax.set_xlabel("context (tokens)")
    ax.set_ylabel("decode time per layer (us)")
    ax.grid(True, alpha=0.3)
    ax.legend()
    fig.tight_layout()
    fig.savefig(out / "sparse_mla.png", dpi=120)


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--out", default="/tmp/sparse_mla")
    ap.add_argument("--batches", default="1,32")
    ap.add_argument("--contexts", default="8192,32768,131072")
    ap.add_argument("--rep-ms", type=float, default=30)
    ap.add_argument("--no-dense", action="store_true")
    ap.add_argument("--prefill", default="", help="prefill chunks as new@context[,..], e.g. 2048@6144 (batch 1)")
    ap.add_argument("--quick", action="store_true", help="tiny dims on the CPU (TRITON_INTERPRET=1)")
    ap.add_argument("--render", help="re-render the table and plot of this JSON next to it, and exit")
    args = ap.parse_args(argv)
    if args.render:
        render(json.loads(Path(args.render).read_text()), Path(args.render).parent)
        return 0
    dev = "cuda" if torch.cuda.is_available() else "cpu"
    d, topk, heads, dim, dtype = V32, TOPK, INDEX_HEADS, INDEX_DIM, torch.bfloat16
    batches = [int(x) for x in args.batches.split(",")]
    contexts = [int(x) for x in args.contexts.split(",")]
    if args.quick:
        d = MLADims(num_heads=4, qk_nope_head_dim=16, qk_rope_head_dim=16, v_head_dim=16, kv_lora_rank=32)
        topk, heads, dim, dtype, batches, contexts = 8, 4, 16, torch.float32, [2], [40]
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    try:
        import flashinfer  # noqa: F401
        with_fi = dev == "cuda"
    except ImportError:
        with_fi = False
    res = {"machine": machine("python " + " ".join([sys.argv[0], *(argv if argv is not None else sys.argv[1:])])),
           "dims": vars(d), "topk": topk, "heads": heads, "dim": dim, "dtype": str(dtype).replace("torch.", ""), "rows": []}
    for b in batches:
        for ctx in contexts:
            row = bench_sparse(d, b, ctx, dtype, dev, args.rep_ms, topk, heads, dim,
                               with_dense=not args.no_dense and not args.quick, with_fi=with_fi)
            print(json.dumps(row), flush=True)
            res["rows"].append(row)
            (out / "sparse_mla.json").write_text(json.dumps(res, indent=1))
    for spec in filter(None, args.prefill.split(",")):
        new, ctx = (int(v) for v in spec.split("@"))
        row = bench_sparse(d, 1, ctx, dtype, dev, args.rep_ms, topk, heads, dim, with_dense=False, new=new,
                           with_fi=with_fi)
        print(json.dumps(row), flush=True)
        res["rows"].append(row)
        (out / "sparse_mla.json").write_text(json.dumps(res, indent=1))
    render(res, out)
    return 0


if __name__ == "__main__":
    sys.exit(main())
