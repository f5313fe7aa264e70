"""The parts every integration of refit composes (vLLM, SGLang, verl,
examples/torch_server): the integration author's API, as lib/backend/ is the
engine author's. docs/integrations.md shows how to add an integration with them.

* :class:`Options`: refit's options as an integration takes them from its user,
  validated once (engine, deadline, secret, device, commit mode, wire options);
* :class:`TrainerLink` and :func:`route_address`: the trainer's connections to
  the workers of one topology, kept while the topology is unchanged;
* :mod:`refit.integration.model` (needs torch): the served model's dry run of
  its own loader on meta tensors (:class:`~refit.integration.model.MetaUpdate`)
  and the undo of an apply (:class:`~refit.integration.model.Undo`).
"""

from __future__ import annotations

from ._link import TrainerLink, route_address
from ._options import COMMITS, GPU_ENGINES, HOST_ENGINES, Options

__all__ = ["COMMITS", "GPU_ENGINES", "HOST_ENGINES", "Options", "TrainerLink", "route_address"]
