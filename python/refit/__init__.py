"""refit: weight transfer from RL trainers to inference workers, from Python.

The engines are refit's C++ engines (tcp, loopback, and nccl / cuda_ipc in CUDA
builds), run on refit's own event loop, a thread of its own. Every long call comes
in two forms:

* blocking, ``engine.receive(info, load_weights)``: the GIL is released while C++
  works, so other Python threads run; Ctrl-C cancels it;
* asyncio, ``await engine.receive_async(info, load_weights)``: returns at once to
  the asyncio loop, which keeps running; the result comes back through
  ``loop.call_soon_threadsafe``. Cancelling the awaiting task cancels the C++
  operation (refit's loop gets asio's terminal cancellation).

Tensors are exchanged without copies: anything with ``__dlpack__`` (torch tensors
on the CPU or a GPU, numpy arrays, cupy, ...) is read or written in place, and
``load_weights`` gets torch tensors (numpy arrays when torch is not installed, or
with ``framework="numpy"``) that view refit's memory for the duration of the call:
copy what must outlive it (vLLM's ``model.load_weights`` does).

Errors are :class:`refit.Error` subclasses by refit's kind (``refit.TimeoutError``,
``refit.PeerLostError``, ...). An exception raised by a Python ``load_weights``
comes out of the call that received as itself.

Worker side: :class:`Engine` (an engine from the factory, with vLLM's session verbs)
and :class:`WorkerHost` (refit's control plane, driven by a trainer's
:class:`WorkerGroup`). Trainer side: :class:`Sender` and :class:`WorkerGroup`. The
vLLM backend is :mod:`refit.vllm`.
"""

from __future__ import annotations

try:
    from ._build import BUILD as _BUILD  # written into the wheel by build_wheel.py
    from ._build import VERSION as __version__
except ImportError:  # a source tree: the version is python/pyproject.toml's
    _BUILD = "cpu"
    from ._version import source_tree_version as _source_tree_version

    __version__ = _source_tree_version()
if _BUILD == "cuda":
    # The CUDA build links libnccl.so.2. torch brings its own (newer) NCCL under the
    # same soname: load torch first so that one serves both; loading refit first
    # would bind the system's older NCCL and torch's import would then fail.
    try:
        import torch  # noqa: F401
    except ImportError:
        pass

# The extension and every module that imports it come after torch (see above).
from . import _refit
from ._engine import Engine, HostCopy
from ._errors import (
    AlreadyRegisteredError,
    AuthError,
    CancelledError,
    Error,
    IntegrityError,
    InvalidArgumentError,
    InvalidStateError,
    IoError,
    LoadFailedError,
    NotRegisteredError,
    PeerLostError,
    ProcessingFailedError,
    ProtocolError,
    ResourceExhaustedError,
    TimeoutError,
    UnsupportedError,
    UpdateFailure,
    error_class,
)
from ._group import WorkerGroup
from ._host import WorkerHost
from ._sender import Sender, sharded_init_info
from ._types import Info, LoadWeights, Tensors

__all__ = [
    "Engine",
    "HostCopy",
    "Sender",
    "WorkerGroup",
    "WorkerHost",
    "backends",
    "describe",
    "fingerprints",
    "register_plugin",
    "sharded_init_info",
    "Tensors",
    "LoadWeights",
    "Info",
    "error_class",
    "Error",
    "AlreadyRegisteredError",
    "AuthError",
    "CancelledError",
    "IntegrityError",
    "InvalidArgumentError",
    "InvalidStateError",
    "IoError",
    "LoadFailedError",
    "NotRegisteredError",
    "PeerLostError",
    "ProcessingFailedError",
    "ProtocolError",
    "ResourceExhaustedError",
    "TimeoutError",
    "UnsupportedError",
    "UpdateFailure",
]

backends = _refit.backends
describe = _refit.describe
fingerprints = _refit.fingerprints
register_plugin = _refit.register_plugin

# The classes and functions are refit's, wherever they are written (as the errors).
for _obj in (Engine, Sender, WorkerGroup, WorkerHost, sharded_init_info):
    _obj.__module__ = __name__
del _obj
