"""The models layer's error type (its own module so that every models module can raise it)."""


class ModelLoadError(RuntimeError):
    """The model could not be built or loaded; the message says from where and what to do."""


__all__ = ["ModelLoadError"]
