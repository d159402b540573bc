"""Typed build configuration: schema, packaged default, model families, YAML layering and overrides."""

from .families import available_model_configs, model_config_path  # noqa: F401
from .loader import ConfigError, config_layers, deep_merge, load_config, parse_set_overrides  # noqa: F401
from .schema import AppConfig, ModelConfig, RuntimeConfig  # noqa: F401
