"""Exceptions raised by starckpt. Each carries the Rust SDK's message: what failed, on which
job, step, file, chunk or target.

Every exception derives from :class:`StarckptError`; where a builtin category fits, the class
derives from it too, so ``except OSError`` or ``except ValueError`` also catch them.
"""

import builtins


class StarckptError(Exception):
    """Base class of every starckpt error."""


class ConnectionError(StarckptError, builtins.ConnectionError):
    """The control plane or a storage target could not be reached, or the connection broke."""


class NotFoundError(StarckptError, LookupError):
    """No such job, checkpoint, step or file (or no committed checkpoint at all), or the
    checkpoint being read was deleted meanwhile and its chunks collected."""


class AlreadyExistsError(StarckptError):
    """The checkpoint (job, step) exists already."""


class RejectedError(StarckptError):
    """The control plane refused the request (e.g. a commit after the pending timeout)."""


class FencedError(StarckptError):
    """A newer run of the job took its writer lease: this process is a zombie of a preempted run
    and can no longer save checkpoints of that job."""


class DeniedError(StarckptError, PermissionError):
    """The control plane did not accept this client's bearer token (missing, unknown or revoked),
    or the token's tenant may not make this call."""


class ChecksumError(StarckptError):
    """Stored bytes failed their BLAKE3 check on every replica; nothing unverified was returned."""


class UnavailableError(StarckptError):
    """No replica of a chunk could be read, or no storage target accepted a chunk (e.g. every
    target is full)."""


class TargetError(StarckptError):
    """A storage target answered with an error."""


class InvalidInputError(StarckptError, ValueError):
    """A bad argument: a job name, a path, a step, a timeout, a buffer."""


class UnsupportedTypeError(InvalidInputError, TypeError):
    """A value in a saved state that starckpt cannot store (it names the key path and type)."""


class FormatError(StarckptError, ValueError):
    """A checkpoint's contents are not what the reader expects (not written by this SDK, or by
    an incompatible version)."""


class StarckptIOError(StarckptError, OSError):
    """A local file or directory could not be read or written."""


class CancelledError(StarckptError):
    """A save or restore was stopped before it finished (a save that raises this never committed)."""


class ClosedError(StarckptError):
    """The client was closed."""


class IncompleteCheckpointWarning(UserWarning):
    """A step this rank saved is still not committed when it saves the next: the checkpoint
    waits for the parts of ranks that have not saved it (``latest`` does not see it)."""


__all__ = [name for name, value in list(globals().items()) if isinstance(value, type) and issubclass(value, (Exception, Warning))]
