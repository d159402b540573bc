"""Runtime errors. Each names the limit, the value that broke it, and what to do."""


class CapacityError(ValueError):
    """A step or request exceeds a configured runtime limit (batch, tokens, sequence length)."""


class OutOfPagesError(CapacityError):
    """The paged cache has too few free pages for a request. Recoverable: nothing was changed."""


class RequestError(ValueError):
    """A request is malformed (empty prompt, token id outside the vocabulary, ...); it fails alone."""
