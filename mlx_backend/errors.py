"""The errors a request can end with; backend.py maps each to a gRPC status, once."""


class BackendError(Exception):
    """A request the backend refuses; backend.py maps each subclass to a status."""


class InvalidArgument(BackendError):
    """A request field is malformed or out of range (INVALID_ARGUMENT)."""


class FailedPrecondition(BackendError):
    """The backend is not in a state to serve the request (FAILED_PRECONDITION)."""


class NotFound(BackendError):
    """The request names something this backend does not have (NOT_FOUND)."""


class Unimplemented(BackendError):
    """The RPC is declared but not served yet (UNIMPLEMENTED)."""


class ResourceExhausted(BackendError):
    """A request outgrew a limit of the backend's, e.g. an unread stream (RESOURCE_EXHAUSTED)."""


class Aborted(BackendError):
    """The request was ended by the backend, e.g. its model was replaced (ABORTED)."""


class Unavailable(BackendError):
    """The backend can't serve now, e.g. a rank of its distributed group was lost (UNAVAILABLE)."""
