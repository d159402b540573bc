"""Runtime: page allocator, paged latent caches, per-step batch metadata, the model runner, generation."""

from ..custom_ops.attention.registry import SCRATCH_PAGE  # noqa: F401
from .errors import CapacityError, OutOfPagesError, RequestError  # noqa: F401
from .page_allocator import PageAllocator  # noqa: F401
from .sequence_info import SequenceInfo, StepSequence  # noqa: F401
