"""Persistent compile caches under one directory (issue 42, item 2: "start in seconds").

A build compiles three kinds of artifacts, each with its own on-disk cache:
- Inductor (the static pieces): FX graph cache and AOTAutograd cache, under TORCHINDUCTOR_CACHE_DIR
  (torch's default: /tmp/torchinductor_<user>, gone with the machine's /tmp);
- Triton kernels (Inductor's and our own: MLA attention, MoE, routing), under TRITON_CACHE_DIR (default
  <inductor dir>/triton/<device> for Inductor's, ~/.triton/cache for ours);
- FlashInfer's JIT-built modules, under $FLASHINFER_WORKSPACE_BASE/.cache/flashinfer (default $HOME), read
  once when flashinfer is imported.

`configure_compile_caches` points all three at one directory, `$AUTODEPLOY_CACHE_DIR` (default
`$XDG_CACHE_HOME/autodeploy-mla`, else `~/.cache/autodeploy-mla`; `off` leaves every library at its own
default), in a subdirectory named by everything that invalidates a compiled artifact (torch, triton,
flashinfer and transformers versions, CUDA version, GPU name and compute capability, Python version):

    $AUTODEPLOY_CACHE_DIR/<key>/inductor-<ops digest>/   TORCHINDUCTOR_CACHE_DIR
    $AUTODEPLOY_CACHE_DIR/<key>/triton/                  TRITON_CACHE_DIR
    $AUTODEPLOY_CACHE_DIR/<key>/flashinfer/              FLASHINFER_WORKSPACE_BASE

Why these keys suffice: Inductor's and AOTAutograd's cache keys hash the traced graph (every op, constant
and input shape/stride/dtype), the Inductor config and the torch/triton versions and device; Triton's
hashes the kernel source, its constants and compile options; FlashInfer's JIT names modules by their
generated source and flags. A different model or config is a different graph or kernel, so a different
key. What those keys cannot see are the *custom ops* inside our graphs (`torch.ops.autodeploy.*`, and
`torch.ops.transformers.*` from the model code): Inductor calls them opaquely but plans buffers from
their fake (meta) implementations. So the Inductor directory is further keyed by a digest of
`custom_ops/` sources and the transformers version is in the key: a changed fake can never meet an
artifact compiled against the old one. Triton and FlashInfer artifacts stay shared across such changes.

The function mutates nothing but the process environment (`os.environ`, or the mapping it is given),
and only variables the user did not set: a variable already set by the user wins and is reported as
such (except TORCHINDUCTOR_CACHE_DIR holding torch's own default, which torch writes there itself on
import). Variables it set itself are listed in `AUTODEPLOY_CACHE_VARS_SET`, so a later call in the same
process (another model, another device) may move them and still tell them from the user's.
"""

from __future__ import annotations

import hashlib
import importlib.metadata
import os
import re
import sys
from collections.abc import MutableMapping
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Optional

import torch

from ..custom_ops.attention.registry import DeviceInfo

#: The cache root; `off` (or 0 / false / none / no) disables the whole set-up.
CACHE_DIR_ENV = "AUTODEPLOY_CACHE_DIR"
#: Which of the variables below this module set (comma-separated): the process environment it documents.
VARS_SET_ENV = "AUTODEPLOY_CACHE_VARS_SET"
INDUCTOR_ENV = "TORCHINDUCTOR_CACHE_DIR"
TRITON_ENV = "TRITON_CACHE_DIR"
FLASHINFER_ENV = "FLASHINFER_WORKSPACE_BASE"
OFF_VALUES = frozenset({"off", "0", "false", "none", "no"})
#: Sources of a cache setting, as reported.
SET, KEPT, USER, OFF, FIXED, ABSENT = ("autodeploy", "autodeploy (already set)", "user", "off", "fixed at import",
                                      "not installed")
#: Where this package's custom ops (schemas and fake implementations) live: their digest keys Inductor's dir.
_CUSTOM_OPS_DIR = Path(__file__).resolve().parents[1] / "custom_ops"


@dataclass(frozen=True)
class CacheSetting:
    """One library's cache directory: the variable, the directory it names, and who chose it."""

    library: str  # inductor | triton | flashinfer
    env: str
    path: Optional[str]  # None: the library's own default (caches off, or not determinable)
    source: str  # autodeploy | autodeploy (already set) | user | off | fixed at import | not installed
    note: str = ""

    def to_dict(self) -> dict[str, Any]:
        return {"library": self.library, "env": self.env, "path": self.path, "source": self.source,
                "note": self.note}


@dataclass(frozen=True)
class CompileCaches:
    """What `configure_compile_caches` set up, and why (the `startup.caches` section of the report)."""

    root: Optional[str]  # $AUTODEPLOY_CACHE_DIR resolved (None: off)
    root_source: str  # "AUTODEPLOY_CACHE_DIR", "XDG_CACHE_HOME", "home", or "off (...)"
    key: str  # the subdirectory name ("" when off)
    key_parts: dict[str, str] = field(default_factory=dict)
    settings: tuple[CacheSetting, ...] = ()
    #: torch's in-process switches for the Inductor-side caches, as they stand (never changed here)
    fx_graph_cache: bool = False
    autograd_cache: bool = False
    caches_force_disabled: bool = False

    @property
    def enabled(self) -> bool:
        return self.root is not None

    def setting(self, library: str) -> CacheSetting:
        return next(s for s in self.settings if s.library == library)

    def to_dict(self) -> dict[str, Any]:
        return {
            "root": self.root,
            "root_source": self.root_source,
            "key": self.key,
            "key_parts": dict(self.key_parts),
            "settings": [s.to_dict() for s in self.settings],
            "fx_graph_cache": self.fx_graph_cache,
            "autograd_cache": self.autograd_cache,
            "caches_force_disabled": self.caches_force_disabled,
        }

    def summary(self) -> str:
        """One line for `autodeploy build`."""
        if not self.enabled:
            return f"compile caches: {self.root_source}; each library keeps its own default directory"
        libs = ", ".join(f"{s.library} ({s.source})" for s in self.settings)
        torch_side = "on" if self.fx_graph_cache and self.autograd_cache and not self.caches_force_disabled else \
            f"fx_graph_cache={self.fx_graph_cache}, autograd_cache={self.autograd_cache}, " \
            f"force_disable_caches={self.caches_force_disabled}"
        return f"compile caches: {self.root}/{self.key} [{libs}; inductor caches {torch_side}]"


def _version(dist: str) -> str:
    try:
        return importlib.metadata.version(dist)
    except importlib.metadata.PackageNotFoundError:
        return "none"


def custom_ops_digest(root: Path = _CUSTOM_OPS_DIR) -> str:
    """12 hex digits over every source file of `custom_ops/` (path and content, in sorted order)."""
    h = hashlib.sha256()
    for path in sorted(root.rglob("*.py")):
        h.update(str(path.relative_to(root)).encode())
        h.update(b"\0")
        h.update(path.read_bytes())
        h.update(b"\0")
    return h.hexdigest()[:12]


def cache_key_parts(device: DeviceInfo, versions: Optional[dict[str, str]] = None) -> dict[str, str]:
    """What invalidates a compiled artifact, in the order the key lists it. `versions` (tests) overrides
    the installed library versions by key: torch, triton, flashinfer, transformers, cuda, python."""
    parts = {
        "torch": torch.__version__,
        "triton": _version("triton"),
        "flashinfer": _version("flashinfer-python"),
        "transformers": _version("transformers"),
        "cuda": torch.version.cuda or "none",
        "python": f"{sys.version_info.major}.{sys.version_info.minor}",
    }
    parts.update(versions or {})
    if device.type == "cuda":
        cap = device.capability
        parts["gpu"] = f"{device.name} sm{cap[0]}{cap[1]}" if cap is not None else device.name
    else:
        parts["gpu"] = device.type
    return parts


def cache_key(parts: dict[str, str]) -> str:
    """A readable directory name from the key parts (only [A-Za-z0-9._+-]; other characters become '_')."""
    raw = "-".join(f"{k}{v}" for k, v in parts.items())
    return re.sub(r"[^A-Za-z0-9._+-]+", "_", raw)


def resolve_cache_root(env: MutableMapping[str, str]) -> tuple[Optional[Path], str]:
    """(the cache root, where it came from), or (None, "off (...)") when disabled."""
    value = env.get(CACHE_DIR_ENV, "").strip()
    if value.lower() in OFF_VALUES:
        return None, f"off ({CACHE_DIR_ENV}={value})"
    if value:
        return Path(value).expanduser().resolve(), CACHE_DIR_ENV
    xdg = env.get("XDG_CACHE_HOME", "").strip()
    if xdg:
        return Path(xdg).expanduser().resolve() / "autodeploy-mla", "XDG_CACHE_HOME"
    return Path(env.get("HOME") or Path.home()).expanduser().resolve() / ".cache" / "autodeploy-mla", "home"


def _flashinfer_import_dir() -> Optional[str]:
    """The workspace base flashinfer fixed when it was imported (None when it is not imported yet)."""
    mod = sys.modules.get("flashinfer.jit.env")
    if mod is None:
        return "unknown (flashinfer imported, flashinfer.jit.env not loaded)" if "flashinfer" in sys.modules else None
    return str(getattr(mod, "FLASHINFER_BASE_DIR", "unknown"))


def _triton_knob_dir() -> Optional[str]:
    """triton.knobs.cache.dir where a user set it in Python (that wins over TRITON_CACHE_DIR)."""
    triton = sys.modules.get("triton")
    knobs = getattr(triton, "knobs", None) if triton is not None else None
    cache = getattr(knobs, "cache", None)
    if cache is None:
        return None
    value = vars(cache).get("dir")
    return None if value is None else str(value)


def _library_defaults(var: str) -> tuple[str, ...]:
    """Values a library writes into `var` itself: torch sets TORCHINDUCTOR_CACHE_DIR to its default
    (/tmp/torchinductor_<user>) when `torch._inductor.config` is first imported, so that value there
    says nothing about the user."""
    if var != INDUCTOR_ENV:
        return ()
    from torch._inductor.runtime.cache_dir_utils import default_cache_dir

    return (os.path.abspath(default_cache_dir()),)


def configure_compile_caches(device: torch.device | str, env: Optional[MutableMapping[str, str]] = None, *,
                             versions: Optional[dict[str, str]] = None) -> CompileCaches:
    """Point Inductor, Triton and FlashInfer at `$AUTODEPLOY_CACHE_DIR/<key>/...` (module docstring).

    Call before anything compiles or imports flashinfer (`optimize()` does, first thing). `env` defaults
    to `os.environ` (the libraries read it there); `versions` overrides key parts (tests)."""
    env = os.environ if env is None else env
    import torch._functorch.config as functorch_config
    import torch._inductor.config as inductor_config

    torch_side = dict(fx_graph_cache=bool(inductor_config.fx_graph_cache),
                      autograd_cache=bool(functorch_config.enable_autograd_cache),
                      caches_force_disabled=bool(torch.compiler.config.force_disable_caches))
    root, root_source = resolve_cache_root(env)
    if root is None:
        off = tuple(CacheSetting(lib, var, env.get(var), USER if env.get(var) else OFF)
                    for lib, var in (("inductor", INDUCTOR_ENV), ("triton", TRITON_ENV),
                                     ("flashinfer", FLASHINFER_ENV)))
        return CompileCaches(None, root_source, "", {}, off, **torch_side)
    parts = cache_key_parts(DeviceInfo.of(device), versions)
    key = cache_key(parts)
    base = root / key
    ops = custom_ops_digest()
    wanted = {
        "inductor": (INDUCTOR_ENV, base / f"inductor-{ops}"),
        "triton": (TRITON_ENV, base / "triton"),
        "flashinfer": (FLASHINFER_ENV, base / "flashinfer"),
    }
    ours = {v for v in env.get(VARS_SET_ENV, "").split(",") if v}
    settings: list[CacheSetting] = []
    for lib, (var, path) in wanted.items():
        current = env.get(var)
        if lib == "flashinfer" and (fixed := _flashinfer_import_dir()) is not None:
            if fixed == str(path):
                settings.append(CacheSetting(lib, var, fixed, KEPT))
            else:
                settings.append(CacheSetting(lib, var, fixed, FIXED, "flashinfer was imported before the build; its "
                                             f"JIT directory is fixed for this process (set {var} before importing "
                                             "it)"))
            continue
        if lib == "flashinfer" and parts["flashinfer"] == "none":
            settings.append(CacheSetting(lib, var, current, USER if current else ABSENT))
            continue
        if lib == "triton" and (knob := _triton_knob_dir()) is not None:
            settings.append(CacheSetting(lib, var, knob, USER, "triton.knobs.cache.dir set in Python"))
            continue
        if current and var not in ours and current not in _library_defaults(var):
            settings.append(CacheSetting(lib, var, current, USER, f"{var} was set before the build"))
            continue
        source = KEPT if current == str(path) else SET
        env[var] = str(path)
        ours.add(var)
        settings.append(CacheSetting(lib, var, str(path), source))
    if ours:
        env[VARS_SET_ENV] = ",".join(sorted(ours))
    parts["custom_ops"] = ops
    return CompileCaches(str(root), root_source, key, parts, tuple(settings), **torch_side)


__all__ = ["CACHE_DIR_ENV", "CacheSetting", "CompileCaches", "cache_key", "cache_key_parts", "configure_compile_caches",
           "custom_ops_digest", "resolve_cache_root"]
