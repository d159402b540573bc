"""Build the eager model a config asks for.

Two sources: an HF checkpoint directory (config.json + safetensors, loaded by transformers), or an
HF config dict (random weights from a fixed seed, for tests and the embedded default; the family
YAMLs in model_configs/ carry one). Random weights come from transformers' init, or with
`model.init: hashed` from a per-element hash (models/random_init.py) that tensor-parallel ranks can
evaluate on their slices alone. A checkpoint that lacks any of the model's weights is refused
with the list of missing tensors: transformers would fill them with random values.
"""

from __future__ import annotations

import contextlib
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any, Optional

import torch
from torch import nn

from ..config.schema import ModelConfig
from .errors import ModelLoadError
from .random_init import HashedInit


def resolve_dtype(name: str, device: torch.device) -> torch.dtype:
    if name == "auto":
        return torch.bfloat16 if device.type == "cuda" else torch.float32
    return getattr(torch, name)


def resolve_device(name: str) -> torch.device:
    """The device `model.device` names, refused here — before any build work — when this machine
    does not have it (the config schema has already checked the form: auto | cpu | cuda | cuda:N)."""
    if name == "auto":
        return torch.device("cuda" if torch.cuda.is_available() else "cpu")
    try:
        dev = torch.device(name)
    except RuntimeError:
        raise ModelLoadError(f"device {name!r}: not a device this build supports; expected auto | cpu | cuda | "
                             "cuda:N (--device / model.device)") from None
    if dev.type not in ("cpu", "cuda"):
        raise ModelLoadError(f"device {name!r}: only cpu and cuda devices are supported; use --device auto | cpu | "
                             "cuda | cuda:N")
    if dev.type == "cuda":
        if not torch.cuda.is_available():
            raise ModelLoadError(f"device {name!r} requested but CUDA is not available on this machine (torch "
                                 f"{torch.__version__}); use --device cpu or auto")
        count = torch.cuda.device_count()
        if dev.index is not None and dev.index >= count:
            raise ModelLoadError(f"device {name!r}: this machine has {count} CUDA device(s), cuda:0..cuda:{count - 1}; "
                                 "use one of those, or cuda / auto for the current one")
    return dev


def causal_lm_class(config: Any) -> Any:
    """The *ForCausalLM class of an HF config: AutoModelForCausalLM's, or the family's own where the
    auto mapping lacks it (transformers 5.x maps "mistral4" only in the pretraining mapping)."""
    import transformers
    from transformers.models.auto.modeling_auto import MODEL_FOR_PRETRAINING_MAPPING_NAMES

    if type(config) in transformers.AutoModelForCausalLM._model_mapping:
        return transformers.AutoModelForCausalLM._model_mapping[type(config)]
    name = MODEL_FOR_PRETRAINING_MAPPING_NAMES.get(config.model_type, "")
    if name.endswith("ForCausalLM"):
        return getattr(transformers, name)
    raise ModelLoadError(f"{type(config).__name__}: transformers has no causal-LM class for model_type {config.model_type!r}")


def hf_config(cfg: ModelConfig) -> Any:
    """The transformers config of `cfg`'s model: the checkpoint's config.json, or `model.hf_config`."""
    import transformers

    if cfg.path is not None:
        path = Path(cfg.path)
        if not (path / "config.json").is_file():
            raise ModelLoadError(f"model.path {cfg.path!r} has no config.json; expected an HF checkpoint directory")
        try:
            return transformers.AutoConfig.from_pretrained(path, trust_remote_code=cfg.trust_remote_code)
        except Exception as exc:
            raise ModelLoadError(f"reading the config of the checkpoint at {path} failed: "
                                 f"{type(exc).__name__}: {exc}") from exc
    if cfg.hf_config is None:
        raise ModelLoadError(
            "no model: set model.path (a checkpoint directory) or model.hf_config, or name a model family "
            "(`--model deepseek_v3`, `optimize(\"deepseek_v3\")`; `autodeploy models` lists them)"
        )
    hf = dict(cfg.hf_config)
    model_type = hf.pop("model_type", None)
    if model_type is None:
        raise ModelLoadError("model.hf_config needs a `model_type` (e.g. deepseek_v3)")
    try:
        return transformers.AutoConfig.for_model(model_type, **hf)
    except Exception as exc:
        raise ModelLoadError(f"model.hf_config is not a valid {model_type} config: {exc}") from exc


def text_config(config: Any) -> Any:
    """The decoder's part of an HF config (a multimodal config nests it; a causal LM's is itself)."""
    get = getattr(config, "get_text_config", None)
    try:
        return get(decoder=True) if callable(get) else config
    except (TypeError, ValueError):  # older/odd configs: the config itself
        return config


def vocab_size(cfg: ModelConfig) -> Optional[int]:
    """The model's vocabulary size from its config alone (config.json or `model.hf_config`, with
    transformers' defaults filled in), so token ids can be checked before any build; None when the
    config does not say. Raises ModelLoadError when there is no usable model config."""
    v = getattr(text_config(hf_config(cfg)), "vocab_size", None)
    return int(v) if isinstance(v, int) and v > 0 else None


@contextlib.contextmanager
def parameters_on_meta() -> Iterator[None]:
    """Modules constructed inside register their parameters on the meta device (buffers stay real):
    a model's structure without its weights' memory or init time."""
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


def meta_model(cfg: ModelConfig, config: Any) -> nn.Module:
    """The HF model of `config` with every parameter on the meta device (buffers real, fp32)."""
    try:
        with parameters_on_meta():
            return causal_lm_class(config)._from_config(config, dtype=torch.float32,
                                                        attn_implementation=cfg.attn_implementation)
    except ModelLoadError:
        raise
    except Exception as exc:
        raise ModelLoadError(f"building the {type(config).__name__} model failed: {type(exc).__name__}: {exc}") from exc


def replace_parameters(model: nn.Module, make: Callable[[str, nn.Parameter], torch.Tensor]) -> dict[int, list[str]]:
    """Replace every parameter of `model` by `make(name, old)` (as a frozen Parameter); tied parameters
    stay tied (made once, under their first name). Returns new parameter id -> all its names."""
    made: dict[int, nn.Parameter] = {}
    names: dict[int, list[str]] = {}
    for mod_name, mod in model.named_modules(remove_duplicate=False):
        prefix = f"{mod_name}." if mod_name else ""
        for attr, p in list(mod._parameters.items()):
            if p is None:
                continue
            if id(p) not in made:
                made[id(p)] = nn.Parameter(make(prefix + attr, p), requires_grad=False)
            names.setdefault(id(made[id(p)]), []).append(prefix + attr)
            mod._parameters[attr] = made[id(p)]
    return names


def _hashed_model(cfg: ModelConfig, device: torch.device, dtype: torch.dtype) -> nn.Module:
    """The hf_config model with `model.init: hashed` weights, generated on `device` in `dtype`."""
    model = meta_model(cfg, hf_config(cfg))
    model.to(dtype)  # floating buffers follow the model dtype; parameters stay meta until filled
    init = HashedInit.for_model(model, cfg.seed)
    replace_parameters(model, lambda name, p: init.tensor(name, p.shape, p.dtype, device))
    return model.to(device).eval()


def build_model(cfg: ModelConfig, device: torch.device, dtype: torch.dtype) -> nn.Module:
    """The eager HF model in eval mode on `device`/`dtype`."""
    import transformers

    kwargs = {"attn_implementation": cfg.attn_implementation}
    if cfg.hf_config is not None and cfg.init == "hashed":
        return _hashed_model(cfg, device, dtype)
    if cfg.path is not None:
        path = Path(cfg.path)
        if not (path / "config.json").is_file():
            raise ModelLoadError(f"model.path {cfg.path!r} has no config.json; expected an HF checkpoint directory")
        try:
            config = transformers.AutoConfig.from_pretrained(path, trust_remote_code=cfg.trust_remote_code)
            model, info = causal_lm_class(config).from_pretrained(path, config=config, dtype=dtype,
                                                                  output_loading_info=True, **kwargs)
        except ModelLoadError:
            raise
        except Exception as exc:
            raise ModelLoadError(f"loading the checkpoint at {path} failed: {type(exc).__name__}: {exc}") from exc
        _refuse_incomplete(path, info)
    elif cfg.hf_config is not None:
        config = hf_config(cfg)
        torch.manual_seed(cfg.seed)
        if device.type == "cuda":
            # Random weights made where they live, in their dtype: a 16-30 B model built as fp32 on
            # the host first takes minutes and 4 bytes per parameter of host memory.
            with torch.device(device):
                model = causal_lm_class(config)._from_config(config, dtype=dtype, **kwargs)
        else:  # fp32 first, so that fp32 and cast-down CPU models share their weights
            model = causal_lm_class(config)._from_config(config, dtype=torch.float32, **kwargs)
            model = model.to(dtype)
    else:
        hf_config(cfg)  # raises: no model source
    return model.to(device).eval()


def _refuse_incomplete(path: Path, info: dict[str, Any]) -> None:
    """A checkpoint with missing or wrongly shaped weights is an error, not random weights."""
    missing = sorted(info.get("missing_keys") or ())
    mismatched = sorted(str(m) for m in (info.get("mismatched_keys") or ()))
    if not missing and not mismatched:
        return
    parts = []
    if missing:
        shown = ", ".join(missing[:20]) + (f", ... ({len(missing)} in all)" if len(missing) > 20 else "")
        parts.append(f"{len(missing)} weight tensor(s) missing: {shown}")
    if mismatched:
        parts.append(f"{len(mismatched)} with the wrong shape: {', '.join(mismatched[:10])}")
    raise ModelLoadError(
        f"the checkpoint at {path} is incomplete for {info.get('model_class', 'this model')}: {'; '.join(parts)}. "
        "transformers would initialise these randomly; fix the checkpoint (or its config.json) instead."
    )


def eos_token_ids(model: nn.Module) -> tuple[int, ...]:
    """The model's end-of-sequence token id(s), as HF `generate` would use them (empty if none)."""
    for src in (getattr(model, "generation_config", None), getattr(model, "config", None)):
        eos = getattr(src, "eos_token_id", None)
        if eos is None:
            continue
        ids = (eos,) if isinstance(eos, int) else tuple(eos)
        return tuple(int(i) for i in ids)
    return ()
