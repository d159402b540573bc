"""What the CLI prints: the build report's tables, the model families, the backends table."""

from __future__ import annotations

from typing import Any

import torch
from rich.console import Console
from rich.table import Table

from ..config.families import available_model_configs, model_config_path, published_dims
from ..custom_ops.attention.registry import Target, all_backends
from ..custom_ops.attention.mla_dims import MLADims


def list_models(console: Console) -> int:
    for name in available_model_configs():
        path = model_config_path(name)
        assert path is not None
        first = next((ln for ln in path.read_text().splitlines() if ln.startswith("#")), "")
        console.print(f"[bold]{name}[/]  {first.lstrip('# ')}")
    return 0


def list_backends(console: Console, dtype: torch.dtype = torch.bfloat16, page_size: int = 64) -> int:
    """Which backend serves each family's published dims on this machine, and why not."""
    target = Target.detect("cuda" if torch.cuda.is_available() else "cpu", page_size)
    versions = ", ".join(f"{k} {v}" for k, v in target.versions.items())
    t = Table(title=f"MLA backends on {target.device.short()} ({versions}), {str(dtype).replace('torch.', '')}, "
                    f"page {page_size}")
    families = [(name, d) for name in available_model_configs() if (d := published_dims(name)) is not None]
    t.add_column("backend")
    for name, d in families:
        t.add_column(f"{name} N{d['N']} {d['R']}/{d['Dr']}", overflow="fold")
    for name, be in all_backends().items():
        cells = []
        for _, d in families:
            r = be.check(MLADims(d["N"], d["Dn"], d["Dr"], d["Dv"], d["R"]), dtype, target)
            cells.append(("[green]yes[/] " if r.ok else "[red]no[/] ") + r.reason)
        t.add_row(name, *cells)
    console.print(t)
    return 0


def print_report(console: Console, report: dict[str, Any], prompts: list[list[int]], outs: list[list[int]]) -> None:
    t = Table(title="MLA layers: backend per node")
    for col in ("layer", "dims", "backend", "why", "rejected"):
        t.add_column(col, overflow="fold")
    for lay in report["layers"]:
        d = lay["dims"]
        dims = f"N{d['num_heads']} R{d['kv_lora_rank']} Dr{d['qk_rope_head_dim']} Dn{d['qk_nope_head_dim']} Dv{d['v_head_dim']}"
        rej = "; ".join(f"{r['backend']}: {r['reason']}" for r in lay["rejected"]) or "-"
        t.add_row(lay["layer"], dims, lay["backend"], lay["reason"], rej)
    console.print(t)
    paths = report.get("attention_paths") or []
    if paths:
        t = Table(title="MLA layers: decode and prefill paths (routed per step by the attention router)")
        for col in ("layer", "decode path", "prefill path"):
            t.add_column(col, overflow="fold")
        for row in paths:
            dec, pre = row["decode"], row["prefill"]
            t.add_row(row["layer"], f"{dec['backend']}: {dec['reason']}", f"{pre['backend']}: {pre['reason']}")
        console.print(t)
    c = report["cache"]
    console.print(
        f"cache: {c['layers']} layers x {c['num_pages']} pages x {c['page_size']} tokens "
        f"= {c['total_bytes'] / 2**20:.2f} MiB ({'/'.join(c['dtypes'])}: {c['bytes_per_token']} bytes per token "
        f"over all layers; activations {report['dtype']}, {report['device']})"
    )
    pc = report["generation"].get("prefix_cache") or c.get("prefix_cache")
    if pc is not None:
        hits = (f"; {pc['hit_tokens']} of {pc['query_tokens']} prompt tokens from the cache"
                if "hit_tokens" in pc else "")
        console.print(f"prefix cache: {'on' if pc['enabled'] else 'off'}, {pc['pages_cached']} pages cached "
                      f"({pc['pages_evictable']} evictable, {pc['pages_evicted']} evicted){hits}")
    t = Table(title="passes")
    for col in ("pass", "seconds", "summary"):
        t.add_column(col)
    for p in report["passes"]:
        t.add_row(p["name"], f"{p['seconds']:.3f}" if p["enabled"] else "off", p["summary"])
    console.print(t)
    g = report["generation"]
    warm = report.get("warmup") or {}
    title = (f"generation: {g['generated_tokens']} tokens in {g['steps']} steps, {g['tokens_per_s']:.1f} tokens/s "
             f"(after a {warm.get('seconds', 0.0):.2f}s warm-up)")
    t = Table(title=title)
    for col in ("prompt len", "generated", "HF eager"):
        t.add_column(col, overflow="fold")
    ver = (report.get("verification") or {}).get("prompts") or [{}] * len(prompts)
    for p, o, v in zip(prompts, outs, ver):
        hf = v.get("hf")
        t.add_row(str(len(p)), " ".join(map(str, o)), "-" if hf is None else ("same" if v["identical"] else " ".join(map(str, hf))))
    console.print(t)
