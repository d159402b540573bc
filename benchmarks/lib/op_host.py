"""One attention step of the op-host-cost benchmark, built through either API of the backends.

The host-cost benchmark compares two code roots (an older commit's package and the working tree)
in fresh processes; `OldApi` / `NewApi` hide how each drives a backend (module-global state vs a
session per model) so the timed loop is the same for both. The profile script builds the same step.
Everything from the package is looked up when a step is built, in whichever root this process
imported.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import torch

from benchmarks.lib import product

DIMS = {"num_heads": 16, "qk_nope_head_dim": 128, "qk_rope_head_dim": 64, "v_head_dim": 128, "kv_lora_rank": 512}


PAGE_SIZE = 64


@dataclass(frozen=True)
class Shape:
    """One step: (new tokens, cached tokens) per sequence, prefill sequences first; `pad_to` pads it."""

    name: str
    label: str
    seqs: tuple[tuple[int, int], ...]
    pad_to: int | None = None


SHAPES = {s.name: s for s in (
    Shape("decode_b32_kv1024", "decode 32 x kv 1024", ((1, 1023),) * 32),
    Shape("decode_b1_kv512", "decode 1 x kv 512", ((1, 511),)),
    Shape("prefill_128", "prefill 1 x 128 new", ((128, 0),)),
    Shape("mixed_4d_p64", "mixed 4 decode (kv 1024) + prefill 64", ((64, 0),) + ((1, 1023),) * 4),
    # Speculative-decoding verification: 3 draft tokens + 1 per sequence on a cached history.
    Shape("spec_32x4_kv1024", "multi-token decode 32 x 4 new (kv 1024)", ((4, 1020),) * 32),
    # No sequence, one padded token: every op returns right after its checks and the cache write, so
    # this is the per-call floor (dispatcher, argument packing, session lookup) without the math.
    Shape("floor_pad1", "floor: 1 padded token, no sequence", (), pad_to=1),
)}


@dataclass
class Step:
    """A prepared step of one backend: what a model step does around its cached-op calls."""

    op: Any  # the cached op's default overload, the graph node's target
    args: tuple  # (*inputs, *metadata, cache, scale): the graph's call_function arguments
    prepare: Callable[[], None]  # per-step host hook (FlashInfer: plan)
    context: Callable[[], Any] | None  # new code: a fresh `using_sessions(...)`; old code: None


class OldApi:
    """0f20270: stateless-looking descriptors over module-global state."""

    name = "old"

    def __init__(self) -> None:
        self.reg = product.backend_registry

    def check(self, be, dims, dtype, device, page_size):
        return be.check(dims, dtype, self.reg.DeviceInfo.of(device), self.reg.library_versions(), page_size)

    def step(self, be, dims, dtype, info, args) -> Step:
        be.setup([dims], dtype, info)
        return Step(be.cached_op.default, args, lambda: be.prepare(info), None)


class NewApi:
    """Working tree: per-model sessions published through a ContextVar for the step."""

    name = "new"

    def __init__(self) -> None:
        try:  # the runner's own step description (older roots kept it in testing.scenarios)
            describe = product.step_descriptor
        except (ImportError, AttributeError):
            describe = product.scenarios_step_descriptor
        self.reg, self.using_sessions, self.step_descriptor = product.backend_registry, product.using_sessions, describe
        self.via = "op"

    def check(self, be, dims, dtype, device, page_size):
        return be.check(dims, dtype, self.reg.Target.detect(device, page_size))

    def step(self, be, dims, dtype, info, args, policy: Any = None) -> Step:
        target = self.reg.Target.detect(info.device, info.page_size)
        spec = self.reg.SessionSpec((dims,), dtype, torch.device(info.device), target, info.max_batch_size,
                                    info.max_num_tokens, info.max_pages_per_seq)
        session = be.setup(spec) if policy is None else be.setup(spec, policy)
        sessions = {be.name: session}  # the runner's dict: built once per model
        describe = self.step_descriptor

        def prepare() -> None:
            session.prepare(info, describe(info))

        # --via direct: what the piecewise runner calls for an eager attention piece (the backend's
        # direct_call, no dispatcher), where the backend has one; else the op, as a graph calls it
        op = getattr(be, "direct_call", None) if self.via == "direct" else None
        return Step(op or be.cached_op.default, args, prepare, lambda: self.using_sessions(sessions))


def build_step_data(be, shape: Shape, dtype, device):
    """SequenceInfo, cache and inputs of one step, and the op's argument tuple."""
    dims = product.MLADims(**DIMS)
    lens = [new + cached for new, cached in shape.seqs]
    tokens = max(sum(new for new, _ in shape.seqs), shape.pad_to or 0)
    info = product.SequenceInfo(max(1, len(lens)), tokens, max(lens, default=1), PAGE_SIZE, device)
    num_pages = max(2, 1 + sum(-(-n // PAGE_SIZE) for n in lens))  # + the scratch page
    alloc = product.PageAllocator(num_pages, PAGE_SIZE, info.max_pages_per_seq)
    alloc.ensure_many(dict(enumerate(lens)))
    info.prepare_step([product.StepSequence(i, [0] * new, cached) for i, (new, cached) in enumerate(shape.seqs)],
                      alloc.pages_of, pad_to=shape.pad_to)
    gen = torch.Generator().manual_seed(0)

    def rand(*s):
        return torch.randn(*s, generator=gen).to(device=device, dtype=dtype)

    n, dn, dr, dv, r = (DIMS[k] for k in ("num_heads", "qk_nope_head_dim", "qk_rope_head_dim", "v_head_dim",
                                          "kv_lora_rank"))
    inputs = (rand(1, tokens, n, dn), rand(1, tokens, n, dr), rand(1, tokens, r), rand(1, tokens, 1, dr),
              rand(n * (dn + dv), r) * r**-0.5)
    cache = rand(num_pages, PAGE_SIZE, r + dr)
    scale = float((dn + dr) ** -0.5)
    args = (*inputs, *(info.get(m) for m in be.metadata), cache, scale)
    return dims, info, args
