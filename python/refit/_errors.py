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


def _kind(name, kind, *bases):
    cls = type(name, (Error, *bases), {"kind": kind, "__doc__": f"refit error kind '{kind}'."})
    cls.__module__ = "refit"
    return cls


TimeoutError = _kind("TimeoutError", "timeout", builtins.TimeoutError)
PeerLostError = _kind("PeerLostError", "peer_lost", ConnectionError)
InvalidArgumentError = _kind("InvalidArgumentError", "invalid_argument", ValueError)
ProtocolError = _kind("ProtocolError", "protocol_error")
NotRegisteredError = _kind("NotRegisteredError", "not_registered", LookupError)
AlreadyRegisteredError = _kind("AlreadyRegisteredError", "already_registered")
InvalidStateError = _kind("InvalidStateError", "invalid_state")
LoadFailedError = _kind("LoadFailedError", "load_failed")
ProcessingFailedError = _kind("ProcessingFailedError", "processing_failed")
IntegrityError = _kind("IntegrityError", "integrity_error")
IoError = _kind("IoError", "io_error", OSError)
CancelledError = _kind("CancelledError", "cancelled")
UnsupportedError = _kind("UnsupportedError", "unsupported", NotImplementedError)
AuthError = _kind("AuthError", "auth_error", PermissionError)
ResourceExhaustedError = _kind("ResourceExhaustedError", "resource_exhausted")

_BY_KIND = {
    cls.kind: cls
    for cls in (TimeoutError, PeerLostError, InvalidArgumentError, ProtocolError, NotRegisteredError,
                AlreadyRegisteredError, InvalidStateError, LoadFailedError, ProcessingFailedError,
                IntegrityError, IoError, CancelledError, UnsupportedError, AuthError, ResourceExhaustedError)
}


def error_class(kind):
    """The exception class of refit error kind ``kind`` (Error for an unknown one)."""
    return _BY_KIND.get(kind, Error)
