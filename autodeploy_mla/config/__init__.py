"""Typed build configuration: schema, packaged default, YAML layering and overrides."""

from .loader import ConfigError, deep_merge, load_config, parse_set_overrides  # noqa: F401
from .schema import AppConfig, ModelConfig, RuntimeConfig  # noqa: F401
