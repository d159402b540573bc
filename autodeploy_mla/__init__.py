"""autodeploy-mla: compile MLA models from Hugging Face / PyTorch code to fast cached inference."""

from . import custom_ops  # noqa: F401  (registers torch.ops.autodeploy.*)

__version__ = "0.1.0"


def __getattr__(name: str):
    # api imports transformers and the pass pipeline; keep `import autodeploy_mla` light.
    if name in ("optimize", "OptimizedModel"):
        from . import api

        return getattr(api, name)
    raise AttributeError(name)
