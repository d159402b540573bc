"""The attention layer every MLA backend is written against, independent of any kernel library.

- `torch_mla` / `sparse_mla`: the uncached source ops the compiler matches and rewrites;
- `mla_dims`, `cache_format`: the node's dims and the paged cache's format (FP8 scales);
- `contract`: the cached ops' shared signature and the helpers that define them;
- `registry`: backend descriptors, their per-model sessions, the registry and `StepDescriptor`;
- `step_context`: how an op finds its model's sessions during a step;
- `router`: which backend path serves each step of a node (decode and prefill), from facts the
  backends declare, and the bounded per-step record of what it chose;
- `handoff`, `prefill_cost`: the routed step's execution on another registered backend's op, and the
  cost facts the router compares.

Backends (`torch_backend`, `triton_mla/`, `flashinfer/`) import this package; it imports none of them.
"""
