"""What passes share: the model, the graph being rewritten, the target, and the products of passes."""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any, Optional

import torch
from torch import nn

if TYPE_CHECKING:
    from ..config.schema import AppConfig


@dataclass
class PassRecord:
    name: str
    enabled: bool
    seconds: float
    summary: str
    details: dict[str, Any] = field(default_factory=dict)


@dataclass
class BuildContext:
    config: "AppConfig"
    model: Optional[nn.Module]
    device: torch.device
    dtype: torch.dtype
    gm: Optional[torch.fx.GraphModule] = None
    #: Products passes leave for later passes and the runtime (e.g. "mla_layers", "graph_inputs").
    state: dict[str, Any] = field(default_factory=dict)
    history: list[PassRecord] = field(default_factory=list)
