"""Expanded MLA prefill: our Triton op against FlashInfer's ragged prefill (FA3 on SM90) (issue 13).

A fresh T-token prefill on one sequence is attention over K/V expanded by kv_b_proj (q and k of
Dn + Dr, v of Dv per head). Our Triton backend runs it as one op (`prefill_mode="expand"`: latent
gather, expansion GEMM, FlashAttention-style kernel). FlashInfer has no MLA prefill of its own but
its ragged prefill wrapper (`BatchPrefillWithRaggedKVCacheWrapper`, backend "fa3": the Hopper
FlashAttention-3 kernels) takes qk 192 / vo 128 (DeepSeek) and 256 / 256 (GLM-4.7-Flash's 192 + 64).
Times, as CUDA-graph replays (µs):

- `triton_op`: our whole op on the step with its own attention kernel (`prefill_attention="triton"`),
- `triton_op_fa3`: our whole op with FlashInfer's FA3 as its attention (`prefill_attention="flashinfer"`:
  K and q written per head, V a strided view of the expansion GEMM; what "auto" runs from
  tuning.FA3_PREFILL_MIN_TOKENS new tokens),
- `fi_attn`: FlashInfer's attention alone on ready q, k, v (`[T, N, D]`, contiguous),
- `fi_whole`: the expansion GEMM in torch (cuBLAS), k assembled (k_nope | shared k_pe), q
  concatenated, then FlashInfer's attention: what a FlashInfer prefill path would run.

Outputs are checked against an fp32 softmax(q k^T) v of the same bf16 q, k, v (max |diff| / max
|ref|). Attention TFLOP/s counts the causal products only: 2 * T(T+1)/2 * N * (Dqk + Dv).

    python -m benchmarks.kernels.bench_fi_ragged_prefill --out /tmp/fip
"""

from __future__ import annotations

import argparse
import json
import sys
import traceback
from pathlib import Path
from typing import Any

import torch

from benchmarks.lib import DIMS, Case, TritonPolicy, time_us

DEFAULT_DIMS = "deepseek_v3_tp8_n16,glm_4_7_flash_n20,deepseek_v3_n128"


def reference(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, scale: float) -> torch.Tensor:
    """fp32 causal attention, [T, N, D] in, [T, N, Dv] out (per head, to bound memory)."""
    t = q.shape[0]
    mask = torch.ones(t, t, dtype=torch.bool, device=q.device).tril()
    out = torch.empty(t, q.shape[1], v.shape[2], dtype=torch.float32, device=q.device)
    for h in range(q.shape[1]):
        s = (q[:, h].float() @ k[:, h].float().t()) * scale
        out[:, h] = torch.softmax(s.masked_fill(~mask, float("-inf")), -1) @ v[:, h].float()
    return out


def device_us(fn, reps: int = 20) -> float:
    """Device time of one eager call: the kernels' summed durations under torch.profiler, per call (an
    eager op's host work may exceed its device time; this counts only what the GPU runs)."""
    from torch.profiler import ProfilerActivity, profile

    for _ in range(3):
        fn()
    torch.cuda.synchronize()
    with profile(activities=[ProfilerActivity.CUDA]) as prof:
        for _ in range(reps):
            fn()
        torch.cuda.synchronize()
    total = sum(e.device_time_total for e in prof.key_averages() if e.device_type == torch.autograd.DeviceType.CUDA)
    return total / reps


def run_case(name: str, tokens: int, rep_ms: float) -> dict[str, Any]:
    import flashinfer

    d = DIMS[name]
    dev = torch.device("cuda")
    n, dn, dr, dv = d.num_heads, d.qk_nope_head_dim, d.qk_rope_head_dim, d.v_head_dim
    case = Case(d, [(0, tokens)], torch.bfloat16, dev, seed=tokens + n)
    flops = 2.0 * tokens * (tokens + 1) / 2 * n * (dn + dr + dv)
    row: dict[str, Any] = {"dims": name, "T": tokens, "N": n, "dqk": dn + dr, "dv": dv, "attn_gflop": flops / 1e9}
    q_nope, q_pe, ckv, k_pe = (x[0] for x in case.x)
    w = case.w

    def expand():
        kv = (ckv @ w.t()).view(tokens, n, dn + dv)
        k = torch.cat([kv[..., :dn], k_pe.expand(tokens, n, dr)], -1)
        return torch.cat([q_nope, q_pe], -1), k, kv[..., dn:].contiguous()

    q, k, v = expand()
    ref = reference(q, k, v, case.scale)
    scale_ref = ref.abs().max().item()
    for key, attn in (("triton_op", "triton"), ("triton_op_fa3", "flashinfer")):
        try:
            with case.op("triton", TritonPolicy(prefill_mode="expand", prefill_attention=attn)) as op:
                out = op().float().view(tokens, n, dv)
                row[key + "_err"] = (out - ref).abs().max().item() / scale_ref
                # eager (the FA3 path plans on the host; long prefill steps run eagerly): device time
                row[key + "_us"] = device_us(op)
        except Exception as e:  # noqa: BLE001 - record and go on
            traceback.print_exc()
            row[key + "_error"] = f"{type(e).__name__}: {str(e)[:200]}"
    try:
        ws = torch.empty(256 << 20, dtype=torch.uint8, device=dev)
        wrapper = flashinfer.prefill.BatchPrefillWithRaggedKVCacheWrapper(ws, "NHD", backend="fa3")
        indptr = torch.tensor([0, tokens], dtype=torch.int32, device=dev)
        wrapper.plan(indptr, indptr, n, n, dn + dr, head_dim_vo=dv, causal=True, sm_scale=case.scale,
                     q_data_type=torch.bfloat16, kv_data_type=torch.bfloat16)
        out = wrapper.run(q, k, v).float()
        row["fi_err"] = (out - ref).abs().max().item() / scale_ref
        row["fi_attn_us"], row["fi_attn_how"] = time_us(lambda: wrapper.run(q, k, v), graph=True, rep_ms=rep_ms)

        def whole():
            qq, kk, vv = expand()
            return wrapper.run(qq, kk, vv)

        row["fi_whole_us"], row["fi_whole_how"] = time_us(whole, graph=True, rep_ms=rep_ms)
    except Exception as e:  # noqa: BLE001
        traceback.print_exc()
        row["fi_error"] = f"{type(e).__name__}: {str(e)[:300]}"
    for key in ("triton_op_us", "triton_op_fa3_us", "fi_attn_us", "fi_whole_us"):
        if key in row:
            row[key.replace("_us", "_tflops")] = flops / row[key] / 1e6
    return row


def render(rows: list[dict[str, Any]], command: str) -> str:
    lines = ["# Expanded MLA prefill: Triton op vs FlashInfer ragged prefill (fa3)", "", f"Command: `{command}`", "",
             "µs per call (our op: device time of eager calls, kernels summed by torch.profiler; FlashInfer alone: CUDA-graph replay), attention TFLOP/s in brackets (causal products only).", "",
             "| dims | T | Dqk / Dv | Triton op, own kernel | Triton op, FA3 attention | FA3 / own | "
             "FlashInfer attention alone | expansion + FlashInfer in torch ops | err own / FA3 op / FI |",
             "|---|---:|---|---:|---:|---:|---:|---:|---|"]

    def cell(r, key):
        return f"{r[key + '_us']:.1f} ({r[key + '_tflops']:.0f})" if key + "_us" in r else "-"

    for r in rows:
        ratio = f"{r['triton_op_fa3_us'] / r['triton_op_us']:.2f}x" if "triton_op_fa3_us" in r and "triton_op_us" in r \
            else "-"
        errs = " / ".join(f"{r.get(k, float('nan')):.1e}" for k in ("triton_op_err", "triton_op_fa3_err", "fi_err"))
        lines.append(f"| {r['dims']} | {r['T']} | {r['dqk']} / {r['dv']} | {cell(r, 'triton_op')} | "
                     f"{cell(r, 'triton_op_fa3')} | {ratio} | {cell(r, 'fi_attn')} | {cell(r, 'fi_whole')} | {errs} |")
    return "\n".join(lines) + "\n"


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--out", type=Path, required=True)
    ap.add_argument("--dims", default=DEFAULT_DIMS)
    ap.add_argument("--tokens", default="512,2048,4096")
    ap.add_argument("--rep-ms", type=float, default=30)
    args = ap.parse_args()
    args.out.mkdir(parents=True, exist_ok=True)
    command = "python " + " ".join(sys.argv)
    rows = []
    for name in args.dims.split(","):
        for t in (int(x) for x in args.tokens.split(",")):
            rows.append(run_case(name, t, args.rep_ms))
            print(json.dumps(rows[-1]), flush=True)
            (args.out / "fi_ragged_prefill.json").write_text(
                json.dumps({"command": command, "gpu": torch.cuda.get_device_name(), "torch": torch.__version__,
                            "rows": rows}, indent=1))
            torch.cuda.empty_cache()
    md = render(rows, command)
    (args.out / "fi_ragged_prefill.md").write_text(md)
    print(md)


if __name__ == "__main__":
    main()
