"""Tiny FP8 checkpoints in the published layouts, written from a random-weight HF model.

`write_fp8_checkpoint(model, out, fmt)` writes what DeepSeek-V3 / R1 publish: `config.json` with
`quantization_config`, every decoder linear as `<name>.weight` float8_e4m3fn plus
`<name>.weight_scale_inv` float32 [ceil(N/bn), ceil(K/bk)], MoE experts per expert
(`mlp.experts.{e}.gate_proj/up_proj/down_proj.weight` + their scales), and the embeddings, norms,
router and LM head in bf16 — optionally in several safetensors shards with an index.

`per_tensor=True` writes the per-tensor layout instead (`weight_block_size: null`,
`activation_scheme: static`, one float32 `weight_scale_inv` and `activation_scale` per linear),
which is what Mistral's FP8 checkpoints hold (docs/fp8_weights.md).

It returns the reference state dict: the model's weights as the checkpoint holds them, FP8 ones
dequantized to fp32 — load it into the same HF model for the fp32 comparison.
"""

from __future__ import annotations

import json
import math
from pathlib import Path
from typing import Optional

import torch
from torch import nn

from ..models.fp8_format import FP8_DTYPE, FP8_MAX, BlockFP8Format, dequantize, quantize_weight
from ..models.fp8_modules import is_experts_module


def _quantize(w: torch.Tensor, fmt: BlockFP8Format) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """(fp8, stored scale, dequantized fp32) of one [N, K] weight."""
    if fmt.per_tensor:
        scale = torch.clamp(w.abs().amax().float(), min=1e-12) / FP8_MAX
        q = (w.float() / scale).clamp(-FP8_MAX, FP8_MAX).to(FP8_DTYPE)
        return q, scale.reshape(()), q.float() * scale
    q, s = quantize_weight(w, fmt)
    return q, s, dequantize(q, s, fmt, torch.float32)


def write_fp8_checkpoint(model: nn.Module, out: Path, fmt: BlockFP8Format, shards: int = 1,
                         skip: tuple[str, ...] = ()) -> dict[str, torch.Tensor]:
    """Write `model` (fp32 HF causal LM) as an FP8 checkpoint in `out` (module doc); `skip`: module
    names left bf16. Returns the reference fp32 state dict (module doc)."""
    from safetensors.torch import save_file

    out = Path(out)
    out.mkdir(parents=True, exist_ok=True)
    tensors: dict[str, torch.Tensor] = {}
    ref: dict[str, torch.Tensor] = {}
    out_emb = model.get_output_embeddings()
    done: set[str] = set()

    def put_fp8(key: str, w: torch.Tensor) -> torch.Tensor:
        q, s, deq = _quantize(w.detach(), fmt)
        tensors[key] = q.contiguous()
        tensors[key.removesuffix(".weight") + ".weight_scale_inv"] = s.contiguous()
        if fmt.per_tensor:  # a static activation scale, as such checkpoints carry (not used: dynamic quant)
            tensors[key.removesuffix(".weight") + ".activation_scale"] = torch.tensor(1.0)
        return deq

    for name, mod in model.named_modules():
        prefix = f"{name}." if name else ""
        if isinstance(mod, nn.Linear) and mod is not out_emb and name not in skip:
            ref[prefix + "weight"] = put_fp8(prefix + "weight", mod.weight)
            done.add(prefix + "weight")
            if mod.bias is not None:
                b = mod.bias.detach().to(torch.bfloat16)
                tensors[prefix + "bias"] = b
                ref[prefix + "bias"] = b.float()
                done.add(prefix + "bias")
        elif is_experts_module(mod) and name not in skip:
            gu, down = mod.gate_up_proj.detach(), mod.down_proj.detach()
            i = gu.shape[1] // 2
            gus, downs = [], []
            for e in range(gu.shape[0]):
                g = put_fp8(f"{prefix}{e}.gate_proj.weight", gu[e, :i])
                u = put_fp8(f"{prefix}{e}.up_proj.weight", gu[e, i:])
                gus.append(torch.cat([g, u], 0))
                downs.append(put_fp8(f"{prefix}{e}.down_proj.weight", down[e]))
            ref[prefix + "gate_up_proj"] = torch.stack(gus)
            ref[prefix + "down_proj"] = torch.stack(downs)
            done.update({prefix + "gate_up_proj", prefix + "down_proj"})
    for key, t in model.state_dict().items():
        if key in done or key in ref:
            continue
        if key in tensors:
            continue
        b = t.detach().to(torch.bfloat16) if t.is_floating_point() else t.detach()
        tensors[key] = b.contiguous().clone()
        ref[key] = b.float() if t.is_floating_point() else b
    keys = sorted(tensors)
    per = math.ceil(len(keys) / shards)
    if shards == 1:
        save_file(tensors, str(out / "model.safetensors"))
    else:
        weight_map = {}
        for s in range(shards):
            part = keys[s * per:(s + 1) * per]
            fname = f"model-{s + 1:05d}-of-{shards:05d}.safetensors"
            save_file({k: tensors[k] for k in part}, str(out / fname))
            weight_map.update({k: fname for k in part})
        (out / "model.safetensors.index.json").write_text(json.dumps({"metadata": {}, "weight_map": weight_map}))
    model.config.save_pretrained(out)
    cfg = json.loads((out / "config.json").read_text())
    cfg["quantization_config"] = fmt.to_quantization_config()
    if fmt.per_tensor:
        cfg["quantization_config"]["activation_scheme"] = "static"
    cfg["torch_dtype"] = "bfloat16"
    (out / "config.json").write_text(json.dumps(cfg, indent=2))
    return ref


def reference_hf_model(model: nn.Module, ref: dict[str, torch.Tensor]) -> nn.Module:
    """`model` (fp32 HF) with the checkpoint's weights as `write_fp8_checkpoint` returned them."""
    missing, unexpected = model.load_state_dict(ref, strict=False)
    missing = [m for m in missing if m in dict(model.named_parameters())]
    if missing or unexpected:
        raise AssertionError(f"reference weights: missing {missing[:5]}, unexpected {unexpected[:5]}")
    return model.eval()


def edit_checkpoint(ckpt: Path, drop: tuple[str, ...] = (), replace: Optional[dict[str, torch.Tensor]] = None,
                    config: Optional[dict] = None) -> None:
    """Change a single-file checkpoint in place (loader-error tests): drop tensors, replace some,
    update keys of config.json's quantization_config."""
    from safetensors.torch import load_file, save_file

    f = Path(ckpt) / "model.safetensors"
    t = load_file(str(f))
    for k in drop:
        t.pop(k)
    t.update(replace or {})
    save_file(t, str(f))
    if config is not None:
        cfg = json.loads((Path(ckpt) / "config.json").read_text())
        cfg.setdefault("quantization_config", {}).update(config)
        (Path(ckpt) / "config.json").write_text(json.dumps(cfg, indent=2))


__all__ = ["edit_checkpoint", "reference_hf_model", "write_fp8_checkpoint"]
