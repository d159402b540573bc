"""The MoE prefill GEMMs under Nsight Compute: DRAM bytes per block table (issue 13).

GLM-4.7-Flash's experts (64 x 1536, top-4, H 2048) at T tokens (uniform random routing), the shipped
persistent `up_sorted_kernel` / `down_sorted_kernel` launched once each over five block tables:
`current` (the layout's: most experts get a full block and a nearly empty one at T = 2048), `own`
(every block its own expert: nothing to share), `one_per_expert` (one full block per expert, a
perfectly balanced routing), `64+16` (16 experts with two blocks) and `l2` (every block on expert 0:
the weights stay in L2). Plain run: event-timed medians of 20 launches per table; `NCU=1`: one
launch per table, for

    NCU=1 ncu --kernel-name regex:"up_sorted|down_sorted" --launch-count 10 \\
        --metrics dram__bytes_read.sum,gpu__time_duration.sum,dram__throughput.avg.pct_of_peak_sustained_elapsed,lts__t_sector_hit_rate.pct \\
        python -m benchmarks.moe.moe_gemms_ncu
    python -m benchmarks.moe.moe_gemms_ncu [T] [extra]     # timings (T = 2048, extra = 16)

Results: docs/benchmarks/archive/moe_prefill_gemms_ncu_2026-11-26.md.
"""

from __future__ import annotations

import argparse
import os

import torch


def main() -> None:
    ap = argparse.ArgumentParser(description="GLM-4.7-Flash's MoE prefill GEMMs over five block tables "
                                 "(NCU=1: one launch per table, for Nsight Compute)")
    ap.add_argument("t", nargs="?", type=int, default=2048, help="tokens")
    ap.add_argument("extra", nargs="?", type=int, default=16, help="the 64+16 table's experts with two blocks")
    args = ap.parse_args()
    from triton.tools.tensor_descriptor import TensorDescriptor

    from benchmarks.lib import moe_kernels as K
    from benchmarks.lib import persistent_programs, expert_layout
    from benchmarks.lib import moe_config

    e, k, h, i = 64, 4, 2048, 1536
    t, extra = args.t, args.extra
    ncu = bool(os.environ.get("NCU"))
    dev = torch.device("cuda")
    g = torch.Generator(device=dev).manual_seed(t)
    w_up = (torch.randn(e, 2 * i, h, device=dev, generator=g) / h ** 0.5).to(torch.bfloat16)
    w_down = (torch.randn(e, h, i, device=dev, generator=g) / i ** 0.5).to(torch.bfloat16)
    wts, ids = torch.topk(torch.rand(t, e, device=dev, generator=g).softmax(-1), k)
    n = t * k
    cfg = moe_config(n, e, h, i, torch.bfloat16, True)
    bm = cfg.block_m
    lay = expert_layout(ids.reshape(-1), e, cfg)
    mb = lay.block_expert.shape[0]
    print(f"T={t}: {int(lay.num_blocks.item())} blocks in use of {mb}", flush=True)
    xs = torch.randn(mb * bm, h, dtype=torch.bfloat16, device=dev)
    inter = torch.randn(mb * bm, i, dtype=torch.bfloat16, device=dev)
    pair = torch.zeros(n, h, dtype=torch.bfloat16, device=dev)
    wflat = wts.reshape(-1).contiguous()
    progs = persistent_programs(dev, mb * -(-i // cfg.up_n))
    progs_d = persistent_programs(dev, mb * -(-h // cfg.down_n))
    xs_d = TensorDescriptor.from_tensor(xs, [bm, cfg.up_k])
    wu_d = TensorDescriptor.from_tensor(w_up.view(e * 2, i, h), [2, cfg.up_n, cfg.up_k])
    out_d = TensorDescriptor.from_tensor(inter, [bm, cfg.up_n])
    a_d = TensorDescriptor.from_tensor(inter, [bm, cfg.down_k])
    wd_d = TensorDescriptor.from_tensor(w_down.view(e * h, i), [cfg.down_n, cfg.down_k])
    ar = torch.arange(mb, device=dev, dtype=torch.int32)
    live = lay.block_expert >= 0
    two = torch.full((mb,), -1, dtype=torch.int32, device=dev)
    tab = sorted(list(range(e)) + list(range(extra)))
    two[: len(tab)] = torch.tensor(tab, dtype=torch.int32, device=dev)
    tables = [("current", lay.block_expert, lay.num_blocks),
              ("own", torch.where(live, ar % e, -1).to(torch.int32), lay.num_blocks),
              ("one_per_expert", torch.where(ar < e, ar, -1).to(torch.int32), torch.full_like(lay.num_blocks, e)),
              (f"{e}+{extra}", two, torch.full_like(lay.num_blocks, len(tab))),
              ("l2", torch.where(live, 0, -1).to(torch.int32), lay.num_blocks)]
    for name, be, nb in tables:
        def up(be=be, nb=nb):
            K.up_sorted_kernel[(progs,)](xs_d, wu_d, be, nb, out_d, h, i, BLOCK_M=bm, BLOCK_N=cfg.up_n,
                                         BLOCK_K=cfg.up_k, NUM_PROGRAMS=progs, DOT_PREC="tf32",
                                         num_warps=cfg.num_warps, num_stages=cfg.num_stages)

        def down(be=be, nb=nb):
            K.down_sorted_kernel[(progs_d,)](a_d, wd_d, lay.sorted_pairs, be, nb, wflat, pair, n, i, h,
                                             pair.stride(0), BLOCK_M=bm, BLOCK_N=cfg.down_n, BLOCK_K=cfg.down_k,
                                             NUM_PROGRAMS=progs_d, DOT_PREC="tf32", num_warps=cfg.num_warps,
                                             num_stages=cfg.num_stages)
        for _ in range(1 if ncu else 3):
            up()
            down()
        torch.cuda.synchronize()
        if ncu:
            print("table", name, flush=True)
            continue
        for kname, fn in (("up", up), ("down", down)):
            ts = []
            for _ in range(20):
                a, b = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
                a.record()
                fn()
                b.record()
                b.synchronize()
                ts.append(a.elapsed_time(b) * 1e3)
            ts.sort()
            print(f"{name:16s} {kname:4s} blocks {int(nb.item()):3d} {ts[10]:7.1f} us", flush=True)


if __name__ == "__main__":
    main()
