"""The model families shipped with the package: one YAML per family in model_configs/.

Each YAML carries the family's transform/runtime options and a tiny random-weight `hf_config`.
They are package data (`autodeploy_mla/model_configs` links to the repo's model_configs/), so a
family can be named — `optimize("deepseek_v3")`, `--model deepseek_v3`, `--config deepseek_v3` —
after any install, editable or not.
"""

from __future__ import annotations

import re
from pathlib import Path
from typing import Optional

MODEL_CONFIGS_DIR = Path(__file__).resolve().parents[1] / "model_configs"


def model_config_path(name: str) -> Optional[Path]:
    """model_configs/<name>.yaml if it exists."""
    if not name or "/" in name or "\\" in name:
        return None
    p = MODEL_CONFIGS_DIR / f"{name}.yaml"
    return p if p.is_file() else None


def available_model_configs() -> list[str]:
    return sorted(p.stem for p in MODEL_CONFIGS_DIR.glob("*.yaml")) if MODEL_CONFIGS_DIR.is_dir() else []


_DIMS_LINE = re.compile(r"^#\s*mla_dims:\s*(.*)$")
_DIM = re.compile(r"\b(N|Dn|Dr|Dv|R)=(\d+)")


def published_dims(name: str) -> Optional[dict[str, int]]:
    """The real model's MLA dims of a family, from its YAML's `# mla_dims: N=.. Dn=.. Dr=.. Dv=.. R=..`
    line (the `hf_config` in the YAML is a tiny stand-in); None when the YAML has no such line."""
    path = model_config_path(name)
    if path is None:
        return None
    for line in path.read_text().splitlines():
        m = _DIMS_LINE.match(line)
        if m:
            found = dict(_DIM.findall(m.group(1).split("(")[0]))
            if set(found) == {"N", "Dn", "Dr", "Dv", "R"}:
                return {k: int(v) for k, v in found.items()}
    return None
