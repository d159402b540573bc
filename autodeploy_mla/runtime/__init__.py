"""Runtime: page allocator, paged latent caches, per-step batch metadata, generation engine."""

from .errors import CapacityError, OutOfPagesError  # noqa: F401
from .page_allocator import PageAllocator  # noqa: F401
from .sequence_info import SCRATCH_PAGE, SequenceInfo, StepSequence  # noqa: F401
