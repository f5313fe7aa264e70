"""What refit's Python API takes and gives (dicts are JSON-like: vLLM's infos,
refit's stats); :mod:`refit` re-exports these aliases."""

from __future__ import annotations

from collections.abc import Callable, Iterable, Mapping
from typing import Any

Tensors = Mapping[str, Any] | Iterable[tuple[str, Any]]
"""``{name: tensor}`` or ``(name, tensor)`` pairs (``model.named_parameters()``);
a tensor is anything with ``__dlpack__``."""
LoadWeights = Callable[[list[tuple[str, Any]]], None]
"""``load_weights(batch)``: a list of ``(name, tensor)`` views, valid during the call."""
Info = dict[str, Any]
"""An init_info, update_info, trainer_args, state or stats dict."""
