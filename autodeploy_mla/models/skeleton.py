"""Weightless models: the HF model of a checkpoint with every parameter a placeholder.

How a checkpoint model is built for tensor parallelism (`transforms.shard` enabled, world_size > 1,
`model.path` set, `load: slices`):

1. `build_skeleton` builds the HF model with every *parameter* replaced by a placeholder: a
   zero-stride view of one element (`torch.zeros(()).expand(shape)`) on the target device, so the
   whole model costs a few bytes per parameter. Buffers are real (RoPE `inv_freq` is computed at
   construction and is not in checkpoints). The placeholders carry the right shapes and dtypes, so
   `torch.export` traces the skeleton exactly like the real model.
2. The passes run on the skeleton's graph; the `shard` pass replaces each sharded weight by this
   rank's slice (a placeholder of the sliced shape) and records a `ShardSpec` per weight.
3. The `load_weights` pass fills every graph weight from the checkpoint (models/checkpoint.py),
   reading only this rank's slices of sharded weights.

Random-weight models (`model.hf_config`) have no checkpoint: every rank builds the full model from
the same seed and the shard pass slices it (the full model stays as the HF reference).
"""

from __future__ import annotations

import contextlib
from collections.abc import Iterator, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Optional

import torch
from torch import nn

from ..config.schema import ModelConfig
from .factory import ModelLoadError, build_model, causal_lm_class


@dataclass(frozen=True)
class SkeletonInfo:
    """Marks a weightless model: which names are placeholders and where the weights are."""

    checkpoint: Path
    params: frozenset[str]
    persistent_buffers: frozenset[str]
    aliases: dict[str, tuple[str, ...]] = field(default_factory=dict)  # tied parameters: every name


def is_skeleton(model: Optional[nn.Module]) -> bool:
    return model is not None and getattr(model, "_autodeploy_skeleton", None) is not None


def skeleton_info(model: nn.Module) -> SkeletonInfo:
    return model._autodeploy_skeleton  # type: ignore[attr-defined,no-any-return]


def placeholder(shape: Sequence[int], dtype: torch.dtype, device: torch.device) -> torch.Tensor:
    """A tensor of `shape` that owns one element (zero strides)."""
    return torch.zeros((), dtype=dtype, device=device).expand(*shape)


def is_placeholder(t: torch.Tensor) -> bool:
    return t.numel() > 1 and all(s == 0 for s in t.stride())


@contextlib.contextmanager
def _parameters_on_meta() -> Iterator[None]:
    """Modules constructed inside register their parameters on the meta device (buffers stay real)."""
    original = nn.Module.register_parameter

    def register(self: nn.Module, name: str, param: Optional[nn.Parameter]) -> None:
        original(self, name, param)
        p = self._parameters.get(name)
        if p is not None and p.device.type != "meta":
            self._parameters[name] = nn.Parameter(p.to("meta"), requires_grad=p.requires_grad)

    nn.Module.register_parameter = register  # type: ignore[method-assign]
    try:
        yield
    finally:
        nn.Module.register_parameter = original  # type: ignore[method-assign]


def build_skeleton(cfg: ModelConfig, device: torch.device, dtype: torch.dtype) -> nn.Module:
    """The HF model of the checkpoint at `cfg.path`, weightless (see module doc)."""
    import transformers

    if cfg.path is None:
        raise ModelLoadError("build_skeleton needs model.path (a checkpoint directory)")
    path = Path(cfg.path)
    if not (path / "config.json").is_file():
        raise ModelLoadError(f"model.path {cfg.path!r} has no config.json; expected an HF checkpoint directory")
    try:
        config = transformers.AutoConfig.from_pretrained(path, trust_remote_code=cfg.trust_remote_code)
        with _parameters_on_meta():
            model = causal_lm_class(config)._from_config(
                config, dtype=torch.float32, attn_implementation=cfg.attn_implementation
            )
    except ModelLoadError:
        raise
    except Exception as exc:
        raise ModelLoadError(f"building the model skeleton for {path} failed: {type(exc).__name__}: {exc}") from exc
    model.to(dtype)  # floating buffers follow the model dtype, as in build_model; parameters stay meta
    params: set[str] = set()
    memo: dict[int, nn.Parameter] = {}  # tied parameters stay tied
    names_of: dict[int, list[str]] = {}
    persistent: set[str] = set()
    for mod_name, mod in model.named_modules(remove_duplicate=False):
        prefix = f"{mod_name}." if mod_name else ""
        for name, p in list(mod._parameters.items()):
            if p is None:
                continue
            if id(p) not in memo:
                memo[id(p)] = nn.Parameter(placeholder(p.shape, p.dtype, device), requires_grad=False)
            names_of.setdefault(id(memo[id(p)]), []).append(prefix + name)
            mod._parameters[name] = memo[id(p)]
            params.add(prefix + name)
        for name, b in list(mod._buffers.items()):
            if b is None:
                continue
            mod._buffers[name] = b.to(device)
            if name not in mod._non_persistent_buffers_set:
                persistent.add(prefix + name)
    model.eval()
    aliases = {n: tuple(ns) for ns in names_of.values() if len(ns) > 1 for n in ns}
    model._autodeploy_skeleton = SkeletonInfo(  # type: ignore[attr-defined]
        path.resolve(), frozenset(params), frozenset(persistent), aliases
    )
    return model


def reference_model(model: nn.Module, cfg: ModelConfig, device: torch.device, dtype: torch.dtype) -> nn.Module:
    """A model with real weights for verification: `model` itself, or (skeleton) the full HF model."""
    if not is_skeleton(model):
        return model
    return build_model(cfg, device, dtype)


