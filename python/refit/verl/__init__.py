"""refit as a verl checkpoint engine: two config lines move a verl run's weights.

::

    checkpoint_engine.backend=refit
    checkpoint_engine.custom_backend_module=refit.verl

verl imports ``custom_backend_module`` on every worker before it makes the engine;
importing this module registers :class:`RefitCheckpointEngine` as ``"refit"`` in
verl's ``CheckpointEngineRegistry``. ``checkpoint_engine.engine_kwargs.refit``
takes the engine's options (docs/verl.md). refit itself never requires verl: only
this module imports it, and it raises ImportError naming verl when verl is absent.
"""

from __future__ import annotations

try:
    from verl.checkpoint_engine.base import CheckpointEngineRegistry
except ImportError as e:  # pragma: no cover - exercised without verl
    raise ImportError(f"refit.verl needs verl (pip install verl): {e}") from e

from ._engine import RefitCheckpointEngine

__all__ = ["RefitCheckpointEngine", "register"]


def register() -> None:
    """Registers ``"refit"`` with verl's registry (done at import; idempotent)."""
    CheckpointEngineRegistry.register("refit")(RefitCheckpointEngine)


register()
