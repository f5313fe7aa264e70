"""refit inside a running SGLang server (docs/sglang.md).

The server, one flag (and refit installed in its environment)::

    python -m sglang.launch_server ... --custom-weight-loader refit.sglang.load_weights

The trainer::

    with refit.sglang.Client("http://server:30000") as client:
        client.update(model.named_parameters(), version=step)

The bytes move over refit's engines (tcp, ucx; the GPU engines where built) into a
host buffer on every tensor-parallel rank, checked first by the served model's own
loader and loaded whole between two forward passes, or not at all; SGLang's
``weight_version`` follows refit's. Importing this module never imports SGLang.
"""

from __future__ import annotations

from ._client import LOAD_FORMAT, Client, ServerError
from ._server import load_weights, loader_problems

__all__ = ["LOAD_FORMAT", "Client", "ServerError", "load_weights", "loader_problems"]
