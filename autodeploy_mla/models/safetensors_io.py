"""Reading tensors of a safetensors checkpoint directory by name and by slices (no full load)."""

from __future__ import annotations

import contextlib
import json
from pathlib import Path
from typing import Any, Union

import torch

from .errors import ModelLoadError


class CheckpointReader:
    """Tensors of a safetensors checkpoint directory (single file or index + shards), by slices."""

    def __init__(self, path: Union[str, Path]) -> None:
        from safetensors import safe_open

        self.path = Path(path)
        self._safe_open = safe_open
        self._stack = contextlib.ExitStack()
        self._handles: dict[str, Any] = {}
        index = self.path / "model.safetensors.index.json"
        if index.is_file():
            self.weight_map: dict[str, str] = dict(json.loads(index.read_text())["weight_map"])
        else:
            files = sorted(p.name for p in self.path.glob("*.safetensors"))
            if not files:
                raise ModelLoadError(
                    f"{self.path}: no *.safetensors files. Sharded loading reads slices from safetensors "
                    "only; convert the checkpoint (transformers save_pretrained writes safetensors) or set "
                    "transforms.shard.load=full to load the whole model on every rank."
                )
            self.weight_map = {}
            for f in files:
                for key in self._handle(f).keys():
                    self.weight_map[key] = f
        self.bytes_read = 0

    def __enter__(self) -> "CheckpointReader":
        return self

    def __exit__(self, *exc: Any) -> None:
        self.close()

    def close(self) -> None:
        self._stack.close()
        self._handles.clear()

    def _handle(self, file: str) -> Any:
        if file not in self._handles:
            handle = self._safe_open(str(self.path / file), framework="pt", device="cpu")
            self._handles[file] = self._stack.enter_context(handle)
        return self._handles[file]

    def has(self, key: str) -> bool:
        return key in self.weight_map

    def shape(self, key: str) -> tuple[int, ...]:
        return tuple(self._handle(self.weight_map[key]).get_slice(key).get_shape())

    def read(self, key: str, index: tuple[slice, ...]) -> torch.Tensor:
        sl = self._handle(self.weight_map[key]).get_slice(key)
        t = sl[index] if index else (sl[:] if len(sl.get_shape()) else self._handle(self.weight_map[key]).get_tensor(key))
        self.bytes_read += t.numel() * t.element_size()
        return t

    def dtype(self, key: str) -> str:
        """The stored dtype of `key`, as safetensors names it (F8_E4M3, BF16, F32, ...)."""
        return str(self._handle(self.weight_map[key]).get_slice(key).get_dtype())


__all__ = ["CheckpointReader"]
