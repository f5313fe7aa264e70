"""vLLM's layerwise reload around the loads of one update, kept safe to serve.

On vLLM's CPU and GPU backends alike, ``model.load_weights`` of a loaded model works
only inside vLLM's layerwise reload (``initialize_layerwise_reload`` ..
``finalize_layerwise_reload``): vLLM repacks weights after loading (oneDNN on CPUs,
quantization kernels on GPUs), and the reload restores the checkpoint format first.
While the reload is open the model's layers sit on the meta device until their
tensors arrive: a forward pass then kills vLLM's EngineCore. So refit:

* enters the reload only at the first load of an update (once the update was
  checked and, for a staged commit, every byte of it is in refit's stage), never
  at ``start_weight_update``;
* closes it before the vLLM call that loaded returns (``settle``), so no forward
  pass can ever meet it open;
* after a failed load, loads the previous version back (a staged commit undoing
  itself, a rollback) in a fresh reload: vLLM's reload silently ignores loads into
  a layer it already processed, so the open one is closed first;
* on a failure, gives every layer that had started loading but was not processed
  yet its old weights back before closing (``settle(failed=True)``): such a layer
  is never processed with part of its bytes (vLLM would fill the rest with
  uninitialised memory). Layers already processed keep the new weights. (On
  success vLLM's own finalize runs unchanged: it also processes layers whose
  padding no checkpoint tensor fills, such as a padded vocabulary; that refit's
  checks let only whole layers through is what keeps a layer from loading in
  part.)

The reload's bookkeeping (``LAYERWISE_INFO``) is vLLM's internal API (identical in
0.32 and 0.33); where it differs, refit closes the reload the plain way and says so.
"""

from __future__ import annotations

import logging
import threading
from collections.abc import Callable
from typing import Any

import torch

logger = logging.getLogger(__name__)


def applies_to(model: torch.nn.Module, setting: bool | None) -> bool:
    """Whether updates of ``model`` load through the layerwise reload: the explicit
    setting, else whether vLLM's loader recorded the model (every model vLLM loads;
    a plain ``torch.nn.Module`` is not, and reloading it would drop its parameters)."""
    if setting is not None:
        return setting
    try:
        from vllm.model_executor.model_loader.reload.layerwise import LAYERWISE_INFO
    except ImportError:
        return False
    return model in LAYERWISE_INFO


class LayerwiseReload:
    """One update's reload of ``model``: :meth:`wrap` a loader so that its first call
    opens the reload; :meth:`settle` closes it. Loads run on refit's processing
    thread; ``settle`` runs after refit's call returned (no load is running)."""

    def __init__(self, model: torch.nn.Module, model_config: Any, enabled: bool) -> None:
        self.model = model
        self.model_config = model_config
        self.enabled = enabled
        self._open = False
        self._failed = False  # a load of the open reload raised
        self._lock = threading.Lock()

    @property
    def open(self) -> bool:
        return self._open

    def wrap(self, load: Callable[[list], None]) -> Callable[[list], None]:
        if not self.enabled:
            return load

        def load_in_reload(weights: list) -> None:
            if self._failed:
                # A load after a failed one (refit loading the previous version
                # back): vLLM's reload ignores loads into layers it already
                # processed, so close this reload (half-loaded layers get their old
                # tensors) and load into a fresh one, where every layer takes them.
                self.settle(failed=True)
            self._enter()
            try:
                load(weights)
            except BaseException:
                self._failed = True
                raise

        return load_in_reload

    def _enter(self) -> None:
        with self._lock:
            if self._open:
                return
            from vllm.model_executor.model_loader.reload import initialize_layerwise_reload

            initialize_layerwise_reload(self.model)
            self._open = True

    def settle(self, failed: bool) -> list[str]:
        """Closes the reload if one is open. After a failure, first gives the layers
        that had started loading but were not processed their old weights back;
        returns their names."""
        self._failed = False
        if not self._open:
            return []
        restored = _restore_unprocessed_layers(self.model) if failed else []
        from vllm.model_executor.model_loader.reload import finalize_layerwise_reload

        try:
            finalize_layerwise_reload(self.model, self.model_config)
        finally:
            self._open = False
        return restored


def _restore_unprocessed_layers(model: torch.nn.Module) -> list[str]:
    """Makes finalize give every layer that received some but not all of its
    tensors its old (kernel) tensors back instead of processing it half-loaded;
    returns their names."""
    try:
        from vllm.model_executor.model_loader.reload.layerwise import LAYERWISE_INFO
    except ImportError:
        return []
    partial: list[str] = []
    for name, layer in model.named_modules():
        info = LAYERWISE_INFO.get(layer)
        if info is None:
            continue
        try:
            if info.can_load() and info.load_numel > 0 and info.kernel_tensors is not None:
                # finalize places the kernel tensors back for a layer that loaded
                # nothing (vLLM's fallback for a reload that skipped a layer).
                info.load_numel = 0
                info.loaded_weights.clear()
                partial.append(name or type(layer).__name__)
        except AttributeError as e:  # another vLLM's bookkeeping
            logger.warning("refit: cannot inspect vLLM's layerwise reload (%s); closing it as vLLM does", e)
            return partial
    return partial
