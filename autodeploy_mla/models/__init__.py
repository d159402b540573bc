"""Models: building the eager HF model (checkpoint or random weights), weightless skeletons for
tensor-parallel loading, and reading checkpoints by slices."""

from .factory import ModelLoadError, build_model, eos_token_ids, resolve_device, resolve_dtype  # noqa: F401
