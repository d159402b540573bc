"""Exploration run of 2026-11-26 (issue 13): expert GEMM variants on the sorted-rows TMA path, against
the kernels of commit 9f63f75 (two accumulators, one program per tile). Its output is
docs/benchmarks/moe_prefill_gemms_explore.json; the script was rewritten for the kernels that came
out of it (bench_moe_prefill_gemms.py at the next commit).



Per shape: the layout + gather of the shipped op, then each GEMM variant timed alone (CUDA-graph
replay, do_bench_cudagraph), checked against the shipped kernel's output. TFLOP/s on useful rows and
on padded slots. cuBLAS on the same padded [slots, H] x [H, 2I] and [slots, I] x [I, H] as a ceiling.

Variants:
- up0 / down0: shipped kernels (up: two 128x64 accumulators, down 128x128).
- upIL[BN,BK,st]: gate/up rows interleaved once (row 2j gate j, 2j+1 up j), one dot of [BM, 2BN]
  then split: one A read per k-step instead of two.
- upIL-P[...]: the same, persistent (grid = SMs, tiles row-block-major), optional flatten / WS.
- downP: persistent down.
"""
import sys, json, traceback
import torch
import triton
import triton.language as tl
from triton.tools.tensor_descriptor import TensorDescriptor

sys.path.insert(0, ".")
from autodeploy_mla.custom_ops.moe import kernels as K
from autodeploy_mla.custom_ops.moe.ops import expert_layout
from autodeploy_mla.custom_ops.moe.tuning import moe_config

SHAPES = {"v2_lite": (64, 6, 2048, 1408), "glm_4_7_flash": (64, 4, 2048, 1536)}


@triton.jit
def up_il_kernel(XS_DESC, W_DESC, BLOCK_EXPERT, OUT, K, N, stride_ot,
                 BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr):
    pid_n = tl.program_id(0)
    pid_m = tl.program_id(1)
    e = tl.load(BLOCK_EXPERT + pid_m)
    if e < 0:
        return
    m0 = pid_m * BLOCK_M
    row = e * 2 * N + pid_n * 2 * BLOCK_N
    acc = tl.zeros([BLOCK_M, 2 * BLOCK_N], dtype=tl.float32)
    for k0 in range(0, K, BLOCK_K):
        a = XS_DESC.load([m0, k0])
        w = W_DESC.load([row, k0])
        acc = tl.dot(a, tl.trans(w), acc)
    g, u = tl.split(tl.reshape(acc, [BLOCK_M, BLOCK_N, 2]))
    h = g / (1.0 + tl.exp(-g)) * u
    slots = m0 + tl.arange(0, BLOCK_M)
    offs_n = pid_n * BLOCK_N + tl.arange(0, BLOCK_N)
    tl.store(OUT + slots.to(tl.int64)[:, None] * stride_ot + offs_n[None, :], h.to(OUT.dtype.element_ty),
             mask=(offs_n < N)[None, :])


@triton.jit
def up_il_persist_kernel(XS_DESC, W_DESC, O_DESC, BLOCK_EXPERT, NUM_BLOCKS, K, N, n_tiles_n,
                         BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr,
                         NUM_SMS: tl.constexpr, FLAT: tl.constexpr, WS: tl.constexpr):
    pid = tl.program_id(0)
    total = tl.load(NUM_BLOCKS) * n_tiles_n
    k_tiles = tl.cdiv(K, BLOCK_K)
    for tile in tl.range(pid, total, NUM_SMS, flatten=FLAT, warp_specialize=WS):
        pid_m = tile // n_tiles_n
        pid_n = tile % n_tiles_n
        e = tl.load(BLOCK_EXPERT + pid_m)
        m0 = pid_m * BLOCK_M
        row = e * 2 * N + pid_n * 2 * BLOCK_N
        acc = tl.zeros([BLOCK_M, 2 * BLOCK_N], dtype=tl.float32)
        for ki in range(k_tiles):
            a = XS_DESC.load([m0, ki * BLOCK_K])
            w = W_DESC.load([row, ki * BLOCK_K])
            acc = tl.dot(a, tl.trans(w), acc)
        g, u = tl.split(tl.reshape(acc, [BLOCK_M, BLOCK_N, 2]))
        h = g / (1.0 + tl.exp(-g)) * u
        O_DESC.store([m0, pid_n * BLOCK_N], h.to(O_DESC.dtype))


@triton.jit
def up_persist_kernel(XS_DESC, W_DESC, O_DESC, BLOCK_EXPERT, NUM_BLOCKS, K, N, n_tiles_n,
                      BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr,
                      NUM_SMS: tl.constexpr, FLAT: tl.constexpr, WS: tl.constexpr):
    """Shipped layout (gate rows, then up rows), two accumulators, persistent."""
    pid = tl.program_id(0)
    total = tl.load(NUM_BLOCKS) * n_tiles_n
    k_tiles = tl.cdiv(K, BLOCK_K)
    for tile in tl.range(pid, total, NUM_SMS, flatten=FLAT, warp_specialize=WS):
        pid_m = tile // n_tiles_n
        pid_n = tile % n_tiles_n
        e = tl.load(BLOCK_EXPERT + pid_m)
        m0 = pid_m * BLOCK_M
        row = e * 2 * N + pid_n * BLOCK_N
        acc_g = tl.zeros([BLOCK_M, BLOCK_N], dtype=tl.float32)
        acc_u = tl.zeros([BLOCK_M, BLOCK_N], dtype=tl.float32)
        for ki in range(k_tiles):
            a = XS_DESC.load([m0, ki * BLOCK_K])
            wg = W_DESC.load([row, ki * BLOCK_K])
            wu = W_DESC.load([row + N, ki * BLOCK_K])
            acc_g = tl.dot(a, tl.trans(wg), acc_g)
            acc_u = tl.dot(a, tl.trans(wu), acc_u)
        h = acc_g / (1.0 + tl.exp(-acc_g)) * acc_u
        O_DESC.store([m0, pid_n * BLOCK_N], h.to(O_DESC.dtype))


@triton.jit
def down_persist_kernel(A_DESC, W_DESC, SORTED, BLOCK_EXPERT, NUM_BLOCKS, TOPK_W, OUT, n_pairs, K, N, stride_ot,
                        n_tiles_n, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr,
                        NUM_SMS: tl.constexpr, FLAT: tl.constexpr, WS: tl.constexpr):
    pid = tl.program_id(0)
    total = tl.load(NUM_BLOCKS) * n_tiles_n
    k_tiles = tl.cdiv(K, BLOCK_K)
    for tile in tl.range(pid, total, NUM_SMS, flatten=FLAT, warp_specialize=WS):
        pid_m = tile // n_tiles_n
        pid_n = tile % n_tiles_n
        e = tl.load(BLOCK_EXPERT + pid_m)
        m0 = pid_m * BLOCK_M
        row = e * N + pid_n * BLOCK_N
        acc = tl.zeros([BLOCK_M, BLOCK_N], dtype=tl.float32)
        for ki in range(k_tiles):
            a = A_DESC.load([m0, ki * BLOCK_K])
            w = W_DESC.load([row, ki * BLOCK_K])
            acc = tl.dot(a, tl.trans(w), acc)
        slots = m0 + tl.arange(0, BLOCK_M)
        pairs = tl.load(SORTED + slots)
        rmask = pairs < n_pairs
        offs_n = pid_n * BLOCK_N + tl.arange(0, BLOCK_N)
        wt = tl.load(TOPK_W + pairs, mask=rmask, other=0.0).to(tl.float32)
        tl.store(OUT + pairs.to(tl.int64)[:, None] * stride_ot + offs_n[None, :],
                 (acc * wt[:, None]).to(OUT.dtype.element_ty), mask=rmask[:, None] & (offs_n < N)[None, :])


def bench(fn):
    return triton.testing.do_bench_cudagraph(fn, rep=60)


def main(out_path):
    dev = torch.device("cuda")
    nsm = torch.cuda.get_device_properties(dev).multi_processor_count
    rows = []
    triton.set_allocator(lambda size, align, stream: torch.empty(size, dtype=torch.int8, device=dev))
    for name, (E, k, H, I) in SHAPES.items():
        for T in (2048, 512, 4096):
            g = torch.Generator(device=dev).manual_seed(0)
            w_up = (torch.randn(E, 2 * I, H, device=dev, generator=g) / H ** 0.5).to(torch.bfloat16)
            w_down = (torch.randn(E, H, I, device=dev, generator=g) / I ** 0.5).to(torch.bfloat16)
            w_il = torch.stack([w_up[:, :I], w_up[:, I:]], dim=2).reshape(E, 2 * I, H).contiguous()
            x = torch.randn(T, H, device=dev, generator=g).to(torch.bfloat16)
            scores = torch.rand(T, E, device=dev, generator=g)
            wts, ids = torch.topk(scores.softmax(-1), k)
            n = T * k
            cfg = moe_config(n, E, H, I, torch.bfloat16, True)
            if not cfg.sorted_tma:
                from autodeploy_mla.custom_ops.moe.tuning import MoEConfig
                cfg = MoEConfig(block_m=128, up_n=64, up_k=64, down_n=128, down_k=64, num_warps=8, num_stages=3, sorted_tma=True)
            bm = cfg.block_m
            sp, be = expert_layout(ids.reshape(-1), E, cfg)
            mb = be.shape[0]
            nblk = (be >= 0).sum().to(torch.int32).reshape(1)
            used = int(nblk.item())
            xs = torch.empty(mb * bm, H, dtype=x.dtype, device=dev)
            K.gather_kernel[(mb, H // 128)](x, sp, be, xs, n, H, x.stride(0), TOP_K=k, BLOCK_M=bm, BLOCK_H=128)
            wflat = wts.reshape(-1).contiguous()
            inter0 = torch.zeros(mb * bm, I, dtype=x.dtype, device=dev)
            flop_up_useful = 2 * n * H * 2 * I
            flop_up_pad = 2 * used * bm * H * 2 * I
            flop_dn_useful = 2 * n * I * H
            flop_dn_pad = 2 * used * bm * I * H
            res = {"shape": name, "T": T, "pairs": n, "blocks_used": used, "slots": used * bm,
                   "pad_frac": 1 - n / (used * bm), "up": {}, "down": {}}

            def rec(kind, vname, fn, check):
                try:
                    fn(); torch.cuda.synchronize()
                    err = check()
                    ms = bench(fn)
                    fu, fp = (flop_up_useful, flop_up_pad) if kind == "up" else (flop_dn_useful, flop_dn_pad)
                    res[kind][vname] = {"us": ms * 1e3, "tflops_useful": fu / ms / 1e9, "tflops_padded": fp / ms / 1e9,
                                        "err": err}
                    print(f"{name} T={T} {kind} {vname}: {ms*1e3:.1f} us  useful {fu/ms/1e9:.0f}  padded {fp/ms/1e9:.0f} TFLOP/s  err {err:.1e}", flush=True)
                except Exception as exc:  # noqa: BLE001
                    res[kind][vname] = {"error": f"{type(exc).__name__}: {str(exc)[:300]}"}
                    print(f"{name} T={T} {kind} {vname}: ERROR {type(exc).__name__}: {str(exc)[:300]}", flush=True)

            # ---- up
            xs_d = TensorDescriptor.from_tensor(xs, [bm, cfg.up_k])
            wu_d = TensorDescriptor.from_tensor(w_up.view(E * 2 * I, H), [cfg.up_n, cfg.up_k])

            def up0():
                K.up_sorted_kernel[(I // cfg.up_n, mb)](xs_d, wu_d, be, inter0, H, I, inter0.stride(0),
                                                        BLOCK_M=bm, BLOCK_N=cfg.up_n, BLOCK_K=cfg.up_k, DOT_PREC="tf32",
                                                        num_warps=cfg.num_warps, num_stages=cfg.num_stages)
            up0(); torch.cuda.synchronize()
            ref_inter = inter0.clone()
            valid = (sp < n)
            scale = ref_inter[valid].float().abs().max().item()

            def chk_up(buf):
                return lambda: ((buf[valid].float() - ref_inter[valid].float()).abs().max().item() / scale)
            rec("up", "up0 (shipped)", up0, chk_up(inter0))
            # cuBLAS ceiling on the padded slots
            xs_used = xs[: used * bm]
            wt_up = w_up[0].t().contiguous()
            rec("up", "cublas dense [slots,H]x[H,2I]", lambda: torch.mm(xs_used, wt_up), lambda: 0.0)
            for (bn, bk, st, wp) in [(64, 64, 3, 8), (64, 64, 4, 8), (128, 64, 3, 8), (64, 128, 3, 8), (128, 64, 4, 8)]:
                buf = torch.zeros_like(inter0)
                xd = TensorDescriptor.from_tensor(xs, [bm, bk])
                wd = TensorDescriptor.from_tensor(w_il.view(E * 2 * I, H), [2 * bn, bk])

                def f(bn=bn, bk=bk, st=st, wp=wp, buf=buf, xd=xd, wd=wd):
                    up_il_kernel[(I // bn, mb)](xd, wd, be, buf, H, I, buf.stride(0), BLOCK_M=bm, BLOCK_N=bn,
                                                BLOCK_K=bk, num_warps=wp, num_stages=st)
                rec("up", f"upIL[bn{bn},bk{bk},st{st},w{wp}]", f, chk_up(buf))
            for (il, bn, bk, st, flat, ws) in [(1, 64, 64, 3, False, False), (1, 64, 64, 3, True, False),
                                               (1, 64, 64, 3, False, True), (1, 128, 64, 3, False, False),
                                               (1, 128, 64, 3, True, False), (0, 64, 64, 3, False, False),
                                               (0, 64, 64, 3, True, False), (0, 64, 64, 3, False, True),
                                               (1, 64, 64, 4, True, False)]:
                buf = torch.zeros_like(inter0)
                xd = TensorDescriptor.from_tensor(xs, [bm, bk])
                od = TensorDescriptor.from_tensor(buf, [bm, bn])
                if il:
                    wd = TensorDescriptor.from_tensor(w_il.view(E * 2 * I, H), [2 * bn, bk])
                    kern = up_il_persist_kernel
                else:
                    wd = TensorDescriptor.from_tensor(w_up.view(E * 2 * I, H), [bn, bk])
                    kern = up_persist_kernel

                def f(kern=kern, bn=bn, bk=bk, st=st, flat=flat, ws=ws, xd=xd, wd=wd, od=od):
                    kern[(nsm,)](xd, wd, od, be, nblk, H, I, I // bn, BLOCK_M=bm, BLOCK_N=bn, BLOCK_K=bk,
                                 NUM_SMS=nsm, FLAT=flat, WS=ws, num_warps=8, num_stages=st)
                rec("up", f"up{'IL' if il else ''}-P[bn{bn},bk{bk},st{st},flat{int(flat)},ws{int(ws)}]", f, chk_up(buf))

            # ---- down
            pair0 = torch.zeros(n, H, dtype=x.dtype, device=dev)
            a_d = TensorDescriptor.from_tensor(ref_inter, [bm, cfg.down_k])
            wdd = TensorDescriptor.from_tensor(w_down.view(E * H, I), [cfg.down_n, cfg.down_k])

            def dn0():
                K.down_sorted_kernel[(H // cfg.down_n, mb)](a_d, wdd, sp, be, wflat, pair0, n, I, H, pair0.stride(0),
                                                            BLOCK_M=bm, BLOCK_N=cfg.down_n, BLOCK_K=cfg.down_k,
                                                            DOT_PREC="tf32", num_warps=cfg.num_warps,
                                                            num_stages=cfg.num_stages)
            dn0(); torch.cuda.synchronize()
            ref_pair = pair0.clone()
            dscale = ref_pair.float().abs().max().item()
            rec("down", "down0 (shipped)", dn0, lambda: 0.0)
            inter_used = ref_inter[: used * bm]
            wt_dn = w_down[0].t().contiguous()
            rec("down", "cublas dense [slots,I]x[I,H]", lambda: torch.mm(inter_used, wt_dn), lambda: 0.0)
            for (bn, bk, st, flat, ws) in [(128, 64, 3, False, False), (128, 64, 3, True, False), (128, 64, 3, False, True),
                                           (256, 64, 3, True, False), (128, 64, 4, True, False), (128, 128, 3, True, False)]:
                buf = torch.zeros_like(pair0)
                ad = TensorDescriptor.from_tensor(ref_inter, [bm, bk])
                wd = TensorDescriptor.from_tensor(w_down.view(E * H, I), [bn, bk])

                def f(bn=bn, bk=bk, st=st, flat=flat, ws=ws, buf=buf, ad=ad, wd=wd):
                    down_persist_kernel[(nsm,)](ad, wd, sp, be, nblk, wflat, buf, n, I, H, buf.stride(0), H // bn,
                                                BLOCK_M=bm, BLOCK_N=bn, BLOCK_K=bk, NUM_SMS=nsm, FLAT=flat, WS=ws,
                                                num_warps=8, num_stages=st)
                rec("down", f"downP[bn{bn},bk{bk},st{st},flat{int(flat)},ws{int(ws)}]", f,
                    lambda buf=buf: (buf.float() - ref_pair.float()).abs().max().item() / dscale)
            # other pieces of the op, for the budget
            rec("up", "gather_kernel", lambda: K.gather_kernel[(mb, H // 128)](x, sp, be, xs, n, H, x.stride(0), TOP_K=k,
                                                                               BLOCK_M=bm, BLOCK_H=128), lambda: 0.0)
            rows.append(res)
            print(json.dumps({k2: v for k2, v in res.items() if k2 not in ("up", "down")}), flush=True)
    json.dump({"device": torch.cuda.get_device_name(), "nsm": nsm, "triton": triton.__version__, "rows": rows},
              open(out_path, "w"), indent=1)


if __name__ == "__main__":
    main(sys.argv[1])
