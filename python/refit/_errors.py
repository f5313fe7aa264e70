"""refit's errors as Python exceptions: one class per refit error kind.

Every exception refit raises is a :class:`refit.Error` whose ``kind`` is refit's
kind ("timeout", "peer_lost", ...); its class is the kind's subclass, which also
derives from the nearest built-in exception (``refit.TimeoutError`` is a
``builtins.TimeoutError``, ``refit.InvalidArgumentError`` a ``ValueError``, ...), so
``except TimeoutError`` works as a Python user expects.
"""

import builtins


class Error(Exception):
    """A refit failure. ``kind`` is refit's error kind, ``message`` what happened."""

    kind = "error"

    def __init__(self, message, kind=None):
        super().__init__(message)
        self.message = message
        if kind is not None:
            self.kind = kind

    def __str__(self):
        return f"{self.message} [{self.kind}]"


class TimeoutError(Error, builtins.TimeoutError):
    """A wait on a peer passed its deadline. Kind ``timeout``."""

    kind = "timeout"


class PeerLostError(Error, ConnectionError):
    """The peer (trainer or worker) closed or reset the connection. Kind ``peer_lost``."""

    kind = "peer_lost"


class InvalidArgumentError(Error, ValueError):
    """Bad input: init_info or update_info JSON, names, dtypes, shapes, sizes. Kind ``invalid_argument``."""

    kind = "invalid_argument"


class ProtocolError(Error):
    """The peer sent bytes that break refit's wire protocol. Kind ``protocol_error``."""

    kind = "protocol_error"


class NotRegisteredError(Error, LookupError):
    """An unknown backend name (the message lists the registered ones). Kind ``not_registered``."""

    kind = "not_registered"


class AlreadyRegisteredError(Error):
    """A backend name registered twice. Kind ``already_registered``."""

    kind = "already_registered"


class InvalidStateError(Error):
    """An operation out of order (receive before init, finish without start, ...). Kind ``invalid_state``."""

    kind = "invalid_state"


class LoadFailedError(Error):
    """A plugin library or its entry point could not be loaded. Kind ``load_failed``."""

    kind = "load_failed"


class ProcessingFailedError(Error):
    """Post-processing of received weights (``load_weights``) failed. Kind ``processing_failed``."""

    kind = "processing_failed"


class IntegrityError(Error):
    """A checksum or fingerprint mismatch. Kind ``integrity_error``."""

    kind = "integrity_error"


class IoError(Error, OSError):
    """An operating-system I/O failure. Kind ``io_error``."""

    kind = "io_error"


class CancelledError(Error):
    """The operation was cancelled (shutdown, or the awaiting task cancelled). Kind ``cancelled``."""

    kind = "cancelled"


class UnsupportedError(Error, NotImplementedError):
    """Not available in this build or on this machine. Kind ``unsupported``."""

    kind = "unsupported"


class AuthError(Error, PermissionError):
    """Shared-secret authentication failed (either side's verdict). Kind ``auth_error``."""

    kind = "auth_error"


class ResourceExhaustedError(Error):
    """A limit was reached: stage size, connections, descriptors, requests in flight. Kind ``resource_exhausted``."""

    kind = "resource_exhausted"


ERRORS = (
    TimeoutError,
    PeerLostError,
    InvalidArgumentError,
    ProtocolError,
    NotRegisteredError,
    AlreadyRegisteredError,
    InvalidStateError,
    LoadFailedError,
    ProcessingFailedError,
    IntegrityError,
    IoError,
    CancelledError,
    UnsupportedError,
    AuthError,
    ResourceExhaustedError,
)
"""Every kind's class (Error itself aside)."""

_BY_KIND = {cls.kind: cls for cls in ERRORS}


def error_class(kind):
    """The exception class of refit error kind ``kind`` (Error for an unknown one)."""
    return _BY_KIND.get(kind, Error)


class UpdateFailure(str):
    """Why a weight-update session ended without a clean finish, as a
    :class:`WorkerHost`'s ``on_update_failed`` hook receives it: the reason's text
    (a ``str``, as before) with its error kind as a field, so nothing parses the
    text. ``kind`` is refit's kind ("timeout": its trainer fell silent;
    "peer_lost": its trainer's connection closed; the kind the trainer's
    ``abort_weight_update`` named, "cancelled" by default; a failed chunk's or
    finish's own kind), as ``weight_info()["last_error_kind"]`` says it.
    ``error()`` is the failure as refit's exception of that kind, to raise.
    """

    kind: str

    def __new__(cls, reason: str, kind: str) -> "UpdateFailure":
        self = super().__new__(cls, reason)
        self.kind = str(kind)
        return self

    def error(self) -> Error:
        """The failure as an exception: ``error_class(kind)(str(self))``, e.g. a
        :class:`refit.TimeoutError` for "timeout"."""
        return error_class(self.kind)(str(self), self.kind)

    def __getnewargs__(self) -> tuple[str, str]:  # type: ignore[override]  # pickles and copies keep the kind
        return (str(self), self.kind)

    def __repr__(self) -> str:
        return f"UpdateFailure({str(self)!r}, kind={self.kind!r})"


# Public under refit's name (tracebacks say refit.TimeoutError, pickles load from refit).
for _cls in (Error, *ERRORS, UpdateFailure):
    _cls.__module__ = "refit"
del _cls
