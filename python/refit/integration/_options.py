""":class:`Options`: what every integration asks of refit, validated once."""

from __future__ import annotations

import dataclasses
import os
import re
from typing import Any

from .. import _refit
from .._errors import InvalidArgumentError

HOST_ENGINES = ("tcp", "ucx")
"""The engines that move host tensors between processes (and relay among workers)."""
GPU_ENGINES = ("nccl", "cuda_ipc")
"""The engines of refit's CUDA build: buckets land in the worker's device memory."""
COMMITS = ("in_place", "staged")

_TOPOLOGY = re.compile(r"star|chain|tree:[1-9][0-9]*")
_DEVICE = re.compile(r"cuda(:[0-9]+)?")


@dataclasses.dataclass(frozen=True)
class Options:
    """refit's options as an integration takes them from its user (a vLLM init
    info, ``refit.sglang.Client``'s arguments, verl's ``engine_kwargs``), checked
    together at construction: a bad value, or two that cannot go together, raises
    :class:`refit.InvalidArgumentError` naming ``owner`` and the option.

    * ``engine``: refit's backend, one of this build's (``refit.backends()``);
    * ``timeout_ms``: the deadline of every wait on a peer;
    * ``auth_secret_file``: every connection authenticated (the file must exist);
    * ``device``: the GPU engines' ``"cuda"`` or ``"cuda:N"``; host engines move
      host tensors and take none;
    * ``commit``: ``"in_place"`` or ``"staged"`` (all or nothing per update);
    * ``checksums``, ``buffer_bytes``, ``num_buffers``, ``topology`` (``star``,
      ``chain``, ``tree:K``), ``delta``: the trainer's wire options
      (:meth:`trainer_args`), None for the engine's default.

    :meth:`worker_args` and :meth:`trainer_args` hand them to refit's worker
    (``WorkerHost``, ``Engine``) and trainer (``Sender.prepare``) sides.
    """

    engine: str = "tcp"
    timeout_ms: int = 60000
    auth_secret_file: str | None = None
    device: str | None = None
    commit: str = "in_place"
    checksums: bool = False
    buffer_bytes: int | None = None
    num_buffers: int | None = None
    topology: str | None = None
    delta: bool = False
    owner: str = "refit"

    def __post_init__(self) -> None:
        self._check_types()
        self._check_engine()
        self._check_combinations()

    # ------------------------------------------------------------------ checks

    def _bad(self, what: str) -> InvalidArgumentError:
        return InvalidArgumentError(f"{self.owner}: {what}")

    def _check_types(self) -> None:
        for name, least in (("timeout_ms", 1), ("buffer_bytes", 4096), ("num_buffers", 1)):
            value = getattr(self, name)
            if value is None and name != "timeout_ms":
                continue
            if isinstance(value, bool) or not isinstance(value, int) or value < least:
                raise self._bad(f"{name}: expected an integer of at least {least}, got {value!r}")
        for name in ("checksums", "delta"):
            if not isinstance(getattr(self, name), bool):
                raise self._bad(f"{name}: expected true or false, got {getattr(self, name)!r}")
        if self.commit not in COMMITS:
            raise self._bad(f"commit: expected one of {COMMITS}, got {self.commit!r}")
        if self.topology is not None and not (isinstance(self.topology, str) and _TOPOLOGY.fullmatch(self.topology)):
            raise self._bad(f"topology: expected star, chain or tree:K, got {self.topology!r}")
        if self.device is not None and not (isinstance(self.device, str) and _DEVICE.fullmatch(self.device)):
            raise self._bad(f"device: expected \"cuda\" or \"cuda:N\", got {self.device!r}")
        if self.auth_secret_file is not None and not os.path.isfile(self.auth_secret_file):
            raise self._bad(f"auth_secret_file: {self.auth_secret_file!r} is not a file")

    def _check_engine(self) -> None:
        engines = _refit.backends()
        if not isinstance(self.engine, str) or self.engine not in engines:
            where = " (the GPU engines are in refit's CUDA build)" if self.engine in GPU_ENGINES else ""
            raise self._bad(f"engine: {self.engine!r} is not one of this build's engines {sorted(engines)}{where}")

    def _check_combinations(self) -> None:
        if self.device is not None and not self.gpu:
            raise self._bad(f"device: {self.engine!r} moves host tensors; device= is for the GPU engines "
                            f"{GPU_ENGINES}")
        if self.gpu:
            # What these engines cannot do, refused here rather than at the first update.
            for name, value, why in (
                ("checksums", self.checksums, "their bytes cross no byte stream to checksum"),
                ("commit", self.commit == "staged",
                 "a staged update is held in host memory; they land in device memory"),
                ("topology", self.topology is not None, "the trainer reaches every worker itself (no relay)"),
                ("delta", self.delta, "deltas go over the tcp engine"),
            ):
                if value:
                    raise self._bad(f"{name}: {self.engine!r} does not support it ({why})")
        if self.delta and (self.engine != "tcp" or self.commit != "in_place"):
            raise self._bad(f"delta: deltas go over the tcp engine, in place (got engine {self.engine!r}, "
                            f"commit {self.commit!r})")

    # ------------------------------------------------------------------ uses

    @property
    def gpu(self) -> bool:
        """Whether the engine moves device tensors (nccl, cuda_ipc)."""
        return self.engine in GPU_ENGINES

    def resolved_device(self) -> str:
        """Where tensors move from or land: ``"cpu"`` for the host engines, the GPU
        engines' ``"cuda:N"`` (torch's current device for a bare ``"cuda"`` or none)."""
        if not self.gpu:
            return "cpu"
        if self.device not in (None, "cuda"):
            return str(self.device)
        import torch

        return f"cuda:{torch.cuda.current_device()}"

    def worker_args(self) -> dict[str, Any]:
        """What :class:`refit.WorkerHost` and :class:`refit.Engine` take of these
        options: ``backend``, ``timeout_ms``, ``commit``, ``auth_secret_file``,
        ``device``."""
        return {"backend": self.engine, "timeout_ms": self.timeout_ms, "commit": self.commit,
                "auth_secret_file": self.auth_secret_file, "device": self.resolved_device()}

    def trainer_args(self, address: str, **more: Any) -> dict[str, Any]:
        """``Sender.prepare``'s trainer_args: where the workers reach the trainer
        (``address``, any free port), the set wire options, then ``more``."""
        args: dict[str, Any] = {"master_address": address, "master_port": 0, "timeout_ms": self.timeout_ms}
        if self.checksums:
            args["checksums"] = True
        for name in ("buffer_bytes", "num_buffers", "topology"):
            if getattr(self, name) is not None:
                args[name] = getattr(self, name)
        if self.delta:
            args["delta"] = True
        args.update(more)
        return args

    def replace(self, **changes: Any) -> Options:
        """A copy with ``changes``, checked again."""
        return dataclasses.replace(self, **changes)
