"""refit's verbs on a vLLM worker beyond vLLM's weight-transfer routes:
:class:`RefitWorkerExtension`, vLLM's ``worker_extension_cls``.

vLLM's routes drive one update as start, update, finish. A fleet-atomic update
(several ``vllm serve`` replicas, or several workers of one, at one version or
none: :class:`refit.vllm.FleetClient`) needs three more on every worker: a vote
(prepare), an abort of a prepared update and a rollback of a committed one. vLLM
calls a worker's own methods by name through ``collective_rpc`` (the server's
dev-mode ``POST /collective_rpc``), and mixes the methods of a
``--worker-extension-cls`` class into its workers::

    vllm serve MODEL --weight-transfer-config '{"backend": "refit"}' \\
        --worker-extension-cls refit.vllm.RefitWorkerExtension

(with ``VLLM_SERVER_DEV_MODE=1`` for the HTTP route). Each method returns a
JSON-native dict; what fails raises (``collective_rpc`` answers HTTP 500 with it).
"""

from __future__ import annotations

from typing import Any

__all__ = ["RefitWorkerExtension"]


class RefitWorkerExtension:
    """Mixed into vLLM's worker (``self`` is the worker): refit's fleet verbs."""

    vllm_config: Any  # the worker's (annotated only: no attribute to clash with it)

    def _refit_engine(self) -> Any:
        from ._worker import RefitWeightTransferEngine

        engine = getattr(self, "weight_transfer_engine", None)
        if not isinstance(engine, RefitWeightTransferEngine):
            raise RuntimeError(
                "this vLLM worker's weight transfer engine is not refit's (serve with "
                "--weight-transfer-config '{\"backend\": \"refit\"}')"
            )
        return engine

    def refit_prepare_weight_update(self) -> dict[str, Any]:
        """The worker's vote: its whole update is staged and can be undone."""
        return self._refit_engine().prepare_weight_update()

    def refit_abort_weight_update(self, why: str = "") -> dict[str, Any]:
        """Drops an open update (staged: the model keeps its weights) and ends
        vLLM's session, as a failed ``update_weights`` does, so that the next
        ``start_weight_update`` is taken."""
        out = self._refit_engine().abort_weight_update(why)
        if getattr(self, "_weight_update_active", False):
            self._weight_update_active = False
            self._refit_engine().reset_weight_update_target()
            out["aborted"] = True
        return out

    def refit_rollback_weight_update(self, held_only: str = "") -> dict[str, Any]:
        """Loads the version before the last fleet-atomic finish back. With
        ``held_only`` ("1"), only on the ranks that hold that undo (the ranks of a
        server that committed a lost update when the others did not); the other
        ranks answer their state."""
        from vllm.config import set_current_vllm_config

        engine = self._refit_engine()
        with set_current_vllm_config(self.vllm_config):
            return engine.rollback_weight_update(held_only=bool(held_only))

    def refit_release_weight_undo(self) -> dict[str, Any]:
        """Drops the previous version the last fleet-atomic finish kept."""
        engine = self._refit_engine()
        engine.release_undo()
        return engine.refit_state()

    def refit_weight_state(self) -> dict[str, Any]:
        """refit's state of this worker (``RefitWeightTransferEngine.refit_state``)."""
        return self._refit_engine().refit_state()
