"""Model factory: HF checkpoint directories, HF config dicts (seeded random weights), family names."""

from .factory import ModelLoadError, build_model, model_config_path, resolve_model_arg  # noqa: F401
