"""One decode row of the kernel tables: every backend's attention core and cached op on one
(dims, batch, kv_len), with bytes, FLOPs, achieved TB/s and TFLOP/s, and FlashInfer checked against
Triton on the same latent. Shared by the kernel benchmark and the sparse-vs-dense comparison."""

from __future__ import annotations

import traceback

import torch

from benchmarks.lib.mla_case import PAGE, Case, FlashInferDecode, decode_core_triton, flashinfer_accepts
from benchmarks.lib.product import MLADims, triton_tuning
from benchmarks.lib.records import error_line
from benchmarks.lib.timing import host_ms, time_us

TORCH_DECODE_MAX_TOKENS = 128 * 2048  # reference gathers the whole history in fp32: skip beyond


def bench_decode(dims_name: str, d: MLADims, B: int, kv: int, dtype, dev, rep_ms: float, with_fi: bool,
                 flush: str = "zero", page: int = PAGE) -> dict:
    row: dict = {"kind": "decode", "dims": dims_name, "N": d.num_heads, "R": d.kv_lora_rank,
                 "Dr": d.qk_rope_head_dim, "Dn": d.qk_nope_head_dim, "Dv": d.v_head_dim, "batch": B, "kv_len": kv}
    case = Case(d, [(kv - 1, 1)] * B, dtype, dev, seed=B * 7 + kv, page=page)
    bytes_kv = B * kv * (d.kv_lora_rank + d.qk_rope_head_dim) * case.cache.element_size()
    flops = 2.0 * B * d.num_heads * kv * (2 * d.kv_lora_rank + d.qk_rope_head_dim)
    row["bytes"], row["flops"] = bytes_kv, flops
    try:
        run, q_abs, latent, splits = decode_core_triton(case)
        row["triton_splits"], row["triton_kernel"] = splits, run.kernel
        row["triton_core_us"], row["triton_core_how"] = time_us(run, graph=True, rep_ms=rep_ms, flush=flush)
        ref_latent = None
        if with_fi or B * kv <= 8 * 2048:
            run()
            ref_latent = latent.clone()
    except Exception as e:
        row["triton_core_err"] = error_line(e)
        traceback.print_exc()
        ref_latent = None
    # A/B of the two decode kernels (the default is one of them): heads on the MMA's M or N side
    for layout, key in (("heads_on_m", "triton_m_core_us"), ("heads_on_n", "triton_n_core_us")):
        cfg = triton_tuning.decode_config(d, dtype, case.cache.dtype, layout)
        if layout == "heads_on_n" and not cfg.heads_on_n:
            continue
        try:
            run_l, *_ = decode_core_triton(case, cfg)
            row[key], _ = time_us(run_l, graph=True, rep_ms=rep_ms, flush=flush)
        except Exception as e:
            row[key.replace("_us", "_err")] = error_line(e)
    row["triton_layout"] = "heads_on_n" if triton_tuning.decode_config(d, dtype, case.cache.dtype).heads_on_n else "heads_on_m"
    if row.get("triton_kernel") == "gluon":
        row["triton_layout"] = "gluon"
    try:
        with case.op("triton") as op:
            row["triton_op_us"], row["triton_op_how"] = time_us(op, graph=True, rep_ms=rep_ms, flush=flush)
            row["triton_op_eager_us"], _ = time_us(op, graph=False, rep_ms=rep_ms, flush=flush)
    except Exception as e:
        row["triton_op_err"] = error_line(e)
        traceback.print_exc()
    fi_ok, fi_why = flashinfer_accepts(d) if with_fi else (False, "")
    if fi_ok:
        try:
            fi = FlashInferDecode(case, q_abs)
            row["fi_plan_ms"] = host_ms(fi.plan)
            fi.plan()
            row["fi_core_us"], row["fi_core_how"] = time_us(fi.run, graph=True, rep_ms=rep_ms, flush=flush)
            fi.run()
            torch.cuda.synchronize()
            if ref_latent is not None:  # both compute the same latent: cross-check
                row["fi_vs_triton_rel"] = float((fi.out.transpose(0, 1).float() - ref_latent.float()).abs().max()
                                                / ref_latent.float().abs().max())
            row["fi_op_us"], row["fi_op_how"] = time_us(fi.full(), graph=True, rep_ms=rep_ms, flush=flush)
        except Exception as e:
            row["fi_err"] = error_line(e)
            traceback.print_exc()
    elif with_fi:
        row["fi_skip"] = f"FlashInfer not launched: {fi_why}"
    if B * kv <= TORCH_DECODE_MAX_TOKENS:
        try:
            with case.op("torch") as op:
                row["torch_op_us"], row["torch_op_how"] = time_us(op, graph=False, rep_ms=rep_ms, flush=flush)
        except Exception as e:
            row["torch_err"] = error_line(e)
    else:
        row["torch_skip"] = f"B*kv={B * kv} > {TORCH_DECODE_MAX_TOKENS}: fp32 history gather of several GB"
    for k in ("triton_core", "fi_core"):
        t = row.get(f"{k}_us")
        if t:
            row[f"{k}_tbs"] = bytes_kv / (t * 1e-6) / 1e12
            row[f"{k}_tflops"] = flops / (t * 1e-6) / 1e12
    del case
    return row

