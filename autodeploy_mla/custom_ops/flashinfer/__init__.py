"""Everything that calls FlashInfer: the `flashinfer_mla` (BatchMLAPagedAttentionWrapper),
`flashinfer_trtllm_mla` (TRT-LLM-gen decode) and `flashinfer_mla_sparse` backends, their shared
session parts and host metadata, the capability facts, the JIT module builds, and the FA3 ragged
prefill kernel other backends may use for their expanded prefill.

Nothing here imports FlashInfer at module load: the project (and its CPU tests) run without it.
"""

from . import fa3_prefill  # noqa: F401,E402  (registers the FA3 prefill kernel)
