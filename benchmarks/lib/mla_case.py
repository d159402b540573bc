"""One MLA attention step on a random paged cache, and the kernels of each backend on it.

`Case` is a decode batch or prefill sequences over shuffled pages; `Case.op` runs a backend's cached
op on it as a model would (a session of its own, prepared for the step); `decode_core_triton` and
`FlashInferDecode` run only the attention core (after q·W_kn, before ·W_v), which is what the
kernel tables compare. `DIMS` are the published models' per-layer MLA dims the tables use.
"""

from __future__ import annotations

import contextlib
import math

import torch

from benchmarks.lib.product import (
    LOG2E,
    MLADims,
    PageAllocator,
    SequenceInfo,
    SessionSpec,
    StepSequence,
    Target,
    TritonCall,
    TritonPolicy,
    get_backend,
    gluon_decode_choice,
    launch_absorbed,
    launch_append,
    launch_gluon_decode,
    resolve_scale,
    shuffle_free_pages,
    step_descriptor,
    triton_tuning,
    using_sessions,
)

DIMS = {
    "deepseek_v3_n128": MLADims(128, 128, 64, 128, 512),
    "deepseek_v3_tp2_n64": MLADims(64, 128, 64, 128, 512),
    "deepseek_v3_tp8_n16": MLADims(16, 128, 64, 128, 512),
    "mistral_small_4_n32": MLADims(32, 64, 64, 128, 256),
    "glm_4_7_flash_n20": MLADims(20, 192, 64, 256, 512),
    "minicpm3_n40": MLADims(40, 64, 32, 64, 256),
}
PAGE = 64
# FlashInfer 0.6.x MLA: only (R, Dr) = (512, 64) is known to work; R=256 crashed the CUDA context
# (DESIGN §8). Never launch it on anything else.


def flashinfer_accepts(d: MLADims, dtype=torch.bfloat16) -> tuple[bool, str]:
    """Whether the installed FlashInfer's capability facts (the backend's check) accept these dims on
    this GPU: 0.7.x serves R = 256 too; never launched outside them."""
    be = get_backend("flashinfer_mla")
    res = be.check(d, dtype, Target.detect("cuda", PAGE))
    return res.ok, res.reason


class Case:
    """One step (decode batch or one prefill sequence) over a random, page-shuffled paged cache."""

    def __init__(self, dims: MLADims, seqs: list[tuple[int, int]], dtype, device, seed: int = 0, page: int = PAGE):
        # seqs: (cached tokens, new tokens) per sequence; page: the cache's page size
        self.dims, self.dtype, self.device = dims, dtype, device
        g = torch.Generator(device="cpu").manual_seed(seed)
        max_len = max(c + n for c, n in seqs)
        self.pages_per_seq = math.ceil(max_len / page)
        num_pages = 1 + self.pages_per_seq * len(seqs)
        alloc = PageAllocator(num_pages, page, self.pages_per_seq)
        shuffle_free_pages(alloc, seed)
        alloc.ensure_many({i: c + n for i, (c, n) in enumerate(seqs)})
        n_tok = sum(n for _, n in seqs)
        self.info = SequenceInfo(len(seqs), n_tok, max_len, page, device)
        self.info.prepare_step([StepSequence(i, [0] * n, c) for i, (c, n) in enumerate(seqs)], alloc.pages_of)
        self.seqs = seqs
        self.num_tokens = n_tok
        N, dn, dr, dv, r = dims.num_heads, dims.qk_nope_head_dim, dims.qk_rope_head_dim, dims.v_head_dim, dims.kv_lora_rank

        def rnd(*shape, scale=1.0):
            return (torch.randn(*shape, generator=g) * scale).to(device=device, dtype=dtype)

        # Random cache (never zeros): prefixes are "already cached" tokens.
        self.cache = torch.randn(num_pages, page, r + dr, device=device, dtype=torch.float32).to(dtype)
        self.x = [rnd(1, n_tok, N, dn), rnd(1, n_tok, N, dr), rnd(1, n_tok, r), rnd(1, n_tok, 1, dr)]
        self.w = rnd(N * (dn + dv), r, scale=r**-0.5)
        self.scale = resolve_scale(dims, None)

    @contextlib.contextmanager
    def op(self, backend: str, policy=None):
        """The backend's cached op on this step as a no-argument callable, run as in a model: a session
        of its own (`policy`, e.g. TritonPolicy(prefill_mode="expand")) is prepared for the step and
        active while the block runs (outside the timed calls)."""
        be = get_backend(backend)
        info = self.info
        dev = torch.device(self.device)
        spec = SessionSpec((self.dims,), self.dtype, dev, Target.detect(dev, info.page_size), info.max_batch_size,
                           info.max_num_tokens, info.max_pages_per_seq)
        sess = be.setup(spec, policy)
        sess.prepare(info, step_descriptor(info))
        meta = [info.get(m) for m in be.metadata]
        with using_sessions({backend: sess}):
            yield lambda: be.cached_op(*self.x, self.w, *meta, self.cache, None)

    @property
    def kv_tokens(self) -> int:
        return sum(c + n for c, n in self.seqs)


def decode_core_triton(case: Case, cfg=None, forced_splits: int = 0):
    d = case.dims
    N, dn, r = d.num_heads, d.qk_nope_head_dim, d.kv_lora_rank
    w = case.w.view(N, dn + d.v_head_dim, r)
    q_abs = torch.bmm(case.x[0][0].transpose(0, 1), w[:, :dn])
    latent = torch.empty_like(q_abs)
    info = case.info
    B = len(case.seqs)
    kv = max(c + n for c, n in case.seqs)
    # cfg None: what the op runs (the Gluon decode kernel where TritonPolicy.decode_kernel="auto" picks it)
    call = TritonCall(TritonPolicy(decode_splits=forced_splits), warmed=set())
    gluon = cfg is None and gluon_decode_choice(call, triton_tuning.decode_config(d, case.dtype, case.cache.dtype), d,
                                                     q_abs.dtype, case.cache, torch.device(case.device), False)
    cfg = cfg or triton_tuning.decode_config(d, case.dtype, case.cache.dtype)
    launch_append(case.x[2], case.x[3], case.cache, info.get("cache_loc"), B, d)

    used: list[int] = []

    def run():
        if gluon:
            got = launch_gluon_decode(
                call, q_abs, case.x[1], case.cache, info.get("page_table"), info.get("cu_seqlen"),
                info.get("seq_len_with_cache"), latent, seq_base=0, n_seqs=B, tok_base=0, abs_base=0, kv_bound=kv,
                dims=d, qk_scale=case.scale * LOG2E)
            if got:
                used.append(got)
                return
        used.append(launch_absorbed(
            call, q_abs, case.x[1], case.cache, info.get("page_table"), info.get("cu_seqlen"), info.get("input_pos"),
            info.get("seq_len_with_cache"), latent, seq_base=0, n_seqs=B, tok_base=0, n_tok=B, abs_base=0,
            max_q=1, kv_bound=kv, cfg=cfg, dims=d, qk_scale=case.scale * LOG2E,
        ))

    def splits():  # the count the launcher plans (split_plan or split_plan_waves), from one eager call
        run()
        return used[-1]

    run.kernel = "gluon" if gluon else "tl"  # what the default core ran (bench_decode's layout column)

    return run, q_abs, latent, splits()


class FlashInferDecode:
    """FlashInfer BatchMLAPagedAttentionWrapper on the shared paged cache ([..., :R] / [..., R:] views)."""

    def __init__(self, case: Case, q_abs: torch.Tensor):
        import flashinfer

        d = case.dims
        B = len(case.seqs)
        self.case = case
        self.ws = torch.empty(128 << 20, dtype=torch.uint8, device=case.device)
        self.wrapper = flashinfer.mla.BatchMLAPagedAttentionWrapper(self.ws, backend="auto")
        pt_host = case.info.get("page_table_host")
        pps = case.pages_per_seq
        kv = torch.tensor([c + n for c, n in case.seqs], dtype=torch.int32)
        self.plan_args = (
            torch.arange(B + 1, dtype=torch.int32),
            torch.arange(B + 1, dtype=torch.int32) * pps,
            pt_host[:B, :pps].reshape(-1).to(case.device),
            kv,
            d.num_heads, d.kv_lora_rank, d.qk_rope_head_dim, case.info.page_size, False, case.scale, case.dtype, case.dtype,
        )
        self.plan()
        self.q = q_abs.transpose(0, 1).contiguous()  # [B, N, R]
        self.q_pe = case.x[1][0].contiguous()  # [B, N, Dr]
        self.out = torch.empty_like(self.q)
        r = d.kv_lora_rank
        self.ckv, self.kpe = case.cache[..., :r], case.cache[..., r:]

    def plan(self):
        self.wrapper.plan(*self.plan_args)

    def run(self):
        self.wrapper.run(self.q, self.q_pe, self.ckv, self.kpe, out=self.out)

    def full(self):
        """append + q_abs GEMM + run + W_v GEMM, the same work as the triton op around its kernel."""
        case, d = self.case, self.case.dims
        N, dn, r = d.num_heads, d.qk_nope_head_dim, d.kv_lora_rank
        w = case.w.view(N, dn + d.v_head_dim, r)
        out = torch.empty(1, case.num_tokens, N, d.v_head_dim, device=case.device, dtype=case.dtype)

        def run():
            flat = case.cache.view(-1, case.cache.shape[-1])
            new = torch.cat([case.x[2][0], case.x[3][0, :, 0]], dim=-1)
            flat.index_copy_(0, case.info.get("cache_loc")[: case.num_tokens].long(), new)
            q = torch.bmm(case.x[0][0].transpose(0, 1), w[:, :dn]).transpose(0, 1)
            self.q.copy_(q)
            self.wrapper.run(self.q, self.q_pe, self.ckv, self.kpe, out=self.out)
            o = torch.bmm(self.out.transpose(0, 1), w[:, dn:].transpose(1, 2))
            out[0].copy_(o.transpose(0, 1))

        return run

