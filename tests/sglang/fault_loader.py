"""The custom weight loader tests/sglang's tensor-parallel server lists beside refit's:
``refit.sglang.load_weights`` itself, plus a switch that makes one rank's next apply
fail half-way, as a model whose ``load_weights`` raises in the middle of an apply.

Armed by a file ``fail-next-apply-rank<R>`` in ``$REFIT_SGLANG_FAULT_DIR`` (the
test's temporary folder): rank R's next ``apply`` ticket loads the first half of
its tensors, then raises; the file is removed, so it happens once."""

from __future__ import annotations

import json
import os
from typing import Any

from refit.sglang import load_weights as refit_load_weights
from refit.sglang._server import TICKET, _tp


def _applies(named_tensors: list[tuple[str, Any]]) -> bool:
    for name, _ in named_tensors:
        if name.startswith(TICKET):
            try:
                if json.loads(name[len(TICKET):]).get("op") == "apply":
                    return True
            except ValueError:
                pass
    return False


def load_weights(model: Any, named_tensors: list[tuple[str, Any]]) -> None:
    folder = os.environ.get("REFIT_SGLANG_FAULT_DIR")
    flag = os.path.join(folder, f"fail-next-apply-rank{_tp()[0]}") if folder else None
    if flag is None or not os.path.exists(flag) or not _applies(named_tensors):
        refit_load_weights(model, named_tensors)
        return
    os.remove(flag)

    def failing(weights: Any) -> Any:
        weights = list(weights)
        type(model).load_weights(model, weights[: len(weights) // 2])
        raise RuntimeError("refit test: load_weights failed half-way on purpose")

    model.load_weights = failing
    try:
        refit_load_weights(model, named_tensors)
    finally:
        del model.load_weights  # the class's own again
