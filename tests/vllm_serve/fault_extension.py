"""The worker extension the tests serve with: refit's RefitWorkerExtension (the
fleet verbs) plus a switch that makes the model's next load fail half-way, as a
loader that raises in the middle of a commit does."""

from __future__ import annotations

from typing import Any

from refit.vllm import RefitWorkerExtension


class FaultExtension(RefitWorkerExtension):
    def refit_test_fail_next_load(self, only_rank: str = "") -> dict[str, Any]:
        """The next ``model.load_weights`` loads the first half of its tensors, then
        raises (once; later loads are the model's own). With ``only_rank``, on
        that rank of the server only."""
        if only_rank and int(only_rank) != self.rank:
            return {"armed": False, "rank": self.rank}
        model = self.get_model()

        def failing(weights: Any) -> Any:
            del model.load_weights  # the class's own again
            weights = list(weights)
            model.load_weights(weights[: len(weights) // 2])
            raise RuntimeError("refit test: load_weights failed half-way on purpose")

        model.load_weights = failing
        return {"armed": True, "rank": self.rank, "model": type(model).__name__}
