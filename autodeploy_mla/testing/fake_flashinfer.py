"""A fake FlashInfer in pure torch, for CPU tests of the FlashInfer backends.

It mirrors the real APIs' argument contracts — keyword names, dtypes, shapes, strides, block-table
padding, fixed CUDA-graph buffers (BatchMLAPagedAttentionWrapper and
trtllm_batch_decode_with_kv_cache_mla as of 0.6.18; their FP8 cache rules as of 0.7.2: e4m3 KV with
bf16 queries and ckv/kpe scales, e4m3 query + KV with tensor bmm scales) — and computes the attention from the CSR /
block-table metadata it is given, so every index the backends build is checked by the numbers.
`install_fake_flashinfer(monkeypatch, version, sm)` puts it in `sys.modules` and makes
`Target.detect` report an SM90 (or SM100) GPU with that FlashInfer while tensors stay on the CPU.
"""

from __future__ import annotations

import sys
import types

import torch

from ..custom_ops.attention.registry import DeviceInfo, Target


class FakeMLAWrapper:
    """Mirrors BatchMLAPagedAttentionWrapper (0.6.18) contracts; computes attention from its CSR plan."""

    def __init__(self, float_workspace_buffer, use_cuda_graph=False, qo_indptr=None, kv_indptr=None,
                 kv_indices=None, kv_len_arr=None, backend="auto"):
        assert backend in ("fa2", "fa3", "auto")
        assert float_workspace_buffer.numel() >= 1 << 20
        self.use_cuda_graph = use_cuda_graph
        if use_cuda_graph:
            assert all(t is not None and t.dtype == torch.int32 for t in (qo_indptr, kv_indptr, kv_indices, kv_len_arr))
        self._qo_indptr_buf, self._kv_indptr_buf = qo_indptr, kv_indptr
        self._kv_indices_buf, self._kv_len_arr_buf = kv_indices, kv_len_arr
        self.plans = 0
        self.runs = 0

    def plan(self, qo_indptr, kv_indptr, kv_indices, kv_len_arr, num_heads, head_dim_ckv, head_dim_kpe,
             page_size, causal, sm_scale, q_data_type, kv_data_type, use_profiler=False):
        for t in (qo_indptr, kv_indptr, kv_indices, kv_len_arr):
            assert t.dtype == torch.int32 and t.device.type == "cpu", "plan from host tensors"
        if kv_data_type == torch.float8_e4m3fn:  # 0.7.2 _fa_common: bf16 queries, ckv 512, kpe 0/64
            assert q_data_type == torch.bfloat16 and head_dim_ckv == 512 and head_dim_kpe in (0, 64)
        else:
            assert kv_data_type in (torch.float16, torch.bfloat16) and q_data_type == kv_data_type
        self._kv_dtype = kv_data_type
        b = kv_len_arr.numel()
        assert qo_indptr.numel() == b + 1 == kv_indptr.numel() and int(qo_indptr[0]) == 0
        assert int(kv_indptr[-1]) == kv_indices.numel()
        pages = (kv_len_arr + page_size - 1) // page_size
        assert (kv_indptr[1:] - kv_indptr[:-1]).equal(pages.to(torch.int32))
        assert causal is True
        if self.use_cuda_graph:  # fixed buffers: same shape, copied into
            assert self._qo_indptr_buf.shape == qo_indptr.shape and self._kv_len_arr_buf.shape == kv_len_arr.shape
            assert self._kv_indices_buf.numel() >= kv_indices.numel()
            self._qo_indptr_buf.copy_(qo_indptr)
            self._kv_indptr_buf.copy_(kv_indptr)
            self._kv_indices_buf[: kv_indices.numel()].copy_(kv_indices)
            self._kv_len_arr_buf.copy_(kv_len_arr)
        else:
            self._kv_indices_buf = kv_indices.clone()
        # Like plan_info: the schedule is fixed at plan time from the host values.
        self._plan_q, self._plan_kv_indptr, self._plan_kv_len = qo_indptr.clone(), kv_indptr.clone(), kv_len_arr.clone()
        self._num_heads, self._ckv, self._kpe, self._ps = num_heads, head_dim_ckv, head_dim_kpe, page_size
        self._sm_scale, self._dtype = sm_scale, q_data_type
        self.plans += 1

    def run(self, q_nope, q_pe, ckv_cache, kpe_cache, out=None, lse=None, return_lse=False, profiler_buffer=None,
            kv_len=None, page_table=None, return_lse_base_on_e=False, o_scale=None, ckv_scale=None, kpe_scale=None):
        nnz = int(self._plan_q[-1])
        assert q_nope.dtype == q_pe.dtype == self._dtype and ckv_cache.dtype == kpe_cache.dtype == self._kv_dtype
        fp8 = self._kv_dtype == torch.float8_e4m3fn
        assert (ckv_scale is not None and kpe_scale is not None) == fp8, "FP8 plans need ckv_scale and kpe_scale"
        assert tuple(q_nope.shape) == (nnz, self._num_heads, self._ckv)
        assert tuple(q_pe.shape) == (nnz, self._num_heads, self._kpe)
        assert ckv_cache.shape[1:] == (self._ps, self._ckv) and kpe_cache.shape[1:] == (self._ps, self._kpe)
        for t in (q_nope, q_pe, ckv_cache, kpe_cache, out):
            assert t.stride(-1) == 1 or t.shape[-1] == 0, "last dim must be contiguous"
        assert out is not None and out.shape == q_nope.shape and out.dtype == q_nope.dtype
        ckv = ckv_cache.reshape(-1, self._ckv).float() if ckv_cache.is_contiguous() else \
            ckv_cache.flatten(0, 1).float()
        kpe = kpe_cache.flatten(0, 1).float()
        if fp8:
            ckv, kpe = ckv * float(ckv_scale), kpe * float(kpe_scale)
        for b in range(self._plan_kv_len.numel()):
            q0, q1 = int(self._plan_q[b]), int(self._plan_q[b + 1])
            kvl = int(self._plan_kv_len[b])
            pages = self._kv_indices_buf[int(self._plan_kv_indptr[b]): int(self._plan_kv_indptr[b + 1])].long()
            tok = (pages[:, None] * self._ps + torch.arange(self._ps)).flatten()[:kvl]
            qn, qp = q_nope[q0:q1].float(), q_pe[q0:q1].float()  # [q, N, *]
            s = torch.einsum("qnr,kr->nqk", qn, ckv[tok]) + torch.einsum("qnd,kd->nqk", qp, kpe[tok])
            s = s * self._sm_scale
            qpos = kvl - (q1 - q0) + torch.arange(q1 - q0)
            s = s.masked_fill(torch.arange(kvl)[None, None, :] > qpos[None, :, None], float("-inf"))
            out[q0:q1] = torch.einsum("nqk,kr->qnr", torch.softmax(s, -1), ckv[tok]).to(out.dtype)
        self.runs += 1
        return out


def fake_trtllm_decode(query, kv_cache, workspace_buffer, qk_nope_head_dim, kv_lora_rank, qk_rope_head_dim,
                       block_tables, seq_lens, max_seq_len, sparse_mla_top_k=0, out=None, bmm1_scale=1.0,
                       bmm2_scale=1.0, sinks=None, skip_softmax_threshold_scale_factor=None, enable_pdl=None,
                       backend="auto"):
    """Mirrors trtllm_batch_decode_with_kv_cache_mla's shape rules (0.6.18 _check_trtllm_gen_mla_shape)."""
    assert backend == "trtllm-gen"
    assert query.dim() == 4 and kv_cache.dim() == 4 and kv_cache.shape[1] == 1
    b, q_len, n, d = query.shape
    ps = kv_cache.shape[2]
    assert (kv_lora_rank, qk_rope_head_dim) in ((512, 64), (256, 64))
    assert d == kv_lora_rank + qk_rope_head_dim == kv_cache.shape[-1]
    assert ps in (32, 64) and not (64 < n < 128)
    assert query.dtype == kv_cache.dtype and query.dtype in (torch.bfloat16, torch.float8_e4m3fn)
    if query.dtype == torch.float8_e4m3fn:  # 0.7.2: fp32 tensor scales on trtllm-gen
        assert isinstance(bmm1_scale, torch.Tensor) and bmm1_scale.dtype == torch.float32
        bmm1_scale, bmm2_scale = float(bmm1_scale), float(bmm2_scale)
    assert block_tables.dtype == torch.int32 and block_tables.shape[0] == b
    assert block_tables.shape[1] % (128 // ps) == 0, "block_num % (128 / block_size) == 0"
    assert seq_lens.dtype == torch.int32 and seq_lens.shape == (b,)
    assert isinstance(max_seq_len, int) and max_seq_len >= int(seq_lens.max())
    assert workspace_buffer.numel() >= 1 << 20
    assert out is not None and out.shape == (b, q_len, n, kv_lora_rank) and out.dtype == torch.bfloat16
    assert isinstance(bmm1_scale, float) and isinstance(bmm2_scale, float) and q_len == 1
    flat = kv_cache.reshape(-1, d).float()
    for i in range(b):
        ln = int(seq_lens[i])
        pages = block_tables[i, : -(-ln // ps)].long()
        assert int(pages.max()) < kv_cache.shape[0]
        tok = (pages[:, None] * ps + torch.arange(ps)).flatten()[:ln]
        s = torch.einsum("qnd,kd->nqk", query[i].float(), flat[tok]) * bmm1_scale
        out[i] = (torch.einsum("nqk,kr->qnr", torch.softmax(s, -1), flat[tok, :kv_lora_rank]) * bmm2_scale).to(out.dtype)
    return out


def _fake_flashinfer(version: str) -> dict[str, types.ModuleType]:
    root = types.ModuleType("flashinfer")
    root.__version__ = version
    mla = types.ModuleType("flashinfer.mla")
    mla.BatchMLAPagedAttentionWrapper = FakeMLAWrapper
    mla.trtllm_batch_decode_with_kv_cache_mla = fake_trtllm_decode
    dec = types.ModuleType("flashinfer.decode")
    dec.trtllm_batch_decode_with_kv_cache_mla = fake_trtllm_decode
    root.mla, root.decode = mla, dec
    return {"flashinfer": root, "flashinfer.mla": mla, "flashinfer.decode": dec}


def install_fake_flashinfer(monkeypatch, version: str = "0.6.18.post1", sm=(9, 0)) -> None:
    """Install the fake FlashInfer and make `Target.detect` (what optimize() and run_scenario use)
    report an SM90 (flashinfer_mla) or SM100 (trtllm) GPU with it, while tensors stay on the CPU."""
    for k, v in _fake_flashinfer(version).items():
        monkeypatch.setitem(sys.modules, k, v)
    vers = {"torch": "2.13", "triton": None, "flashinfer": version}
    dev = DeviceInfo("cuda", sm, "fake")
    monkeypatch.setattr(Target, "detect", classmethod(lambda cls, device, page_size: cls(dev, vers, int(page_size))))
