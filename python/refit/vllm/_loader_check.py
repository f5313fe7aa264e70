"""An update checked by the served model's own loader, before a byte of it moves.

The check asks vLLM, not a list kept here: the model's ``load_weights`` runs on
meta tensors of the update's names, shapes and dtypes (no data), with every layer
in the checkpoint format vLLM recorded for its layerwise reload
(``LAYERWISE_INFO``) and on the meta device, exactly as during a real reload. So
whatever that loader does is what is checked: names it renames or stacks
(``WeightsMapper``, ``stacked_params_mapping``), per-expert names into fused
experts, names it skips (the tied ``lm_head.weight``, rotary buffers), and names
it refuses. Each weight's loader call is counted the way vLLM's reload counts it
(``get_numel_loaded``), which gives:

* a name the loader raises on: refused, naming it and quoting the loader;
* a name the loader copies nothing of: taken when the model has a parameter or
  buffer of that name (a tied alias) or its checkpoint the tensor (what the loader
  drops by design); else refused, naming it (the loader would drop it unused, as
  AutoWeightsLoader does any unexpected ".bias": the trainer's model is not the
  served one);
* a shape the loader cannot take: refused (its shape checks run on meta tensors);
* a dtype neither the checkpoint format's nor the model's: refused;
* a layer the update fills only in part: refused (vLLM would process it with
  the rest of its memory uninitialised).

The model is not used meanwhile: the check runs inside vLLM's ``update_weights``
call, before any load, so no forward pass meets it, and every layer gets its own
tensors back (the objects themselves, never copied) before the check returns,
whatever happened. A model vLLM's reload did not record (or another vLLM whose
bookkeeping differs) is not checked here (:func:`loader_problems` returns None).
"""

from __future__ import annotations

import contextlib
import functools
import inspect
import logging
from collections.abc import Callable, Iterable, Iterator
from types import SimpleNamespace
from typing import Any

import torch

from refit.integration.model import MetaUpdate, first_sentence, known_names, torch_dtype, unloaded

logger = logging.getLogger(__name__)


@functools.cache
def _vllm_reload() -> SimpleNamespace | None:
    """vLLM's layerwise-reload internals (the same in 0.32 and 0.33), or None where
    they differ."""
    try:
        from vllm.model_executor.model_loader.reload import layerwise, meta, utils

        return SimpleNamespace(
            LAYERWISE_INFO=layerwise.LAYERWISE_INFO,
            original_loader=layerwise._get_original_loader,  # without its reload wrappers
            restore_layer_on_meta=meta.restore_layer_on_meta,
            to_meta_tensor=meta.to_meta_tensor,
            get_numel_loaded=meta.get_numel_loaded,
            SKIP_LOAD_TENSORS=meta.SKIP_LOAD_TENSORS,
            get_layer_params_buffers=utils.get_layer_params_buffers,
            get_layer_tensors=utils.get_layer_tensors,
            get_layer_size=utils.get_layer_size,
        )
    except (ImportError, AttributeError):
        return None


def loader_problems(
    model: torch.nn.Module,
    load_weights: Callable[[Iterable[tuple[str, torch.Tensor]]], Any],
    names: list[str],
    dtype_names: list[str],
    shapes: list[list[int]],
    *,
    model_dtype: str | None,
    checkpoint_names: set[str] | frozenset[str] = frozenset(),
) -> list[str] | None:
    """What keeps the update from loading, by ``load_weights`` (the model's own,
    run on meta tensors); None when the model cannot be checked this way."""
    api = _vllm_reload()
    if api is None:
        return None
    layers = [(qual, layer, api.LAYERWISE_INFO.get(layer)) for qual, layer in model.named_modules()]
    layers = [(qual, layer, info) for qual, layer, info in layers if info is not None]
    if not layers or any(info.can_load() for _, _, info in layers):
        return None  # not recorded, or a reload is open: not ours to touch

    update = MetaUpdate(names, dtype_names, shapes)
    if update.problems:
        return update.problems

    copied: dict[str, int] = {name: 0 for name in update.names}
    wrong_dtype: dict[str, str] = {}
    loaded: dict[int, int] = {}  # per layer (id), elements loaded
    filled: dict[int, int] = {}  # per layer tensor (id), elements loaded
    allowed_extra = {torch_dtype(model_dtype)} if model_dtype else set()

    def counting(layer: torch.nn.Module, original: Callable) -> Callable:
        signature = inspect.signature(original)

        def load(*args: Any, **kwargs: Any) -> Any:
            bound = signature.bind(*args, **kwargs)
            bound.apply_defaults()
            numel, ret = api.get_numel_loaded(original, bound)
            name = update.source_of(bound.arguments.values())
            param = bound.arguments.get("param")
            if name is not None:
                copied[name] = copied.get(name, 0) + numel
                sent = update.by_name.get(name)
                if numel and isinstance(param, torch.Tensor) and sent is not None:
                    allowed = {param.dtype} | allowed_extra
                    if sent.dtype not in allowed:
                        wrong_dtype[name] = " or ".join(sorted(str(d).split(".")[-1] for d in allowed if d))
            loaded[id(layer)] = loaded.get(id(layer), 0) + numel
            if isinstance(param, torch.Tensor):
                filled[id(param)] = filled.get(id(param), 0) + numel
            return ret

        return load

    refusal: str | None = None
    with torch.no_grad(), _on_meta(api, layers, counting):
        layer_of = {id(layer): (qual, layer) for qual, layer, _ in layers}
        error = update.run(load_weights)
        if error is not None:  # the loader's refusal, quoted
            who = update.current
            refusal = (f"{who!r}: " if who else "") + f"vLLM's loader refuses it: {type(error).__name__}: " + (
                first_sentence(str(error)))
        sizes = {id(layer): api.get_layer_size(layer) for _, layer, _ in layers}
        unfilled = {  # per layer (id), its tensors nothing was loaded into
            id(layer): [
                f"{qual}.{tname}" if qual else tname
                for tname, t in api.get_layer_tensors(layer).items()
                if tname not in api.SKIP_LOAD_TENSORS and t.numel() > 0 and filled.get(id(t), 0) == 0
            ]
            for qual, layer, _ in layers
        }

    if refusal is not None:
        return [refusal]
    # What the loader ignores as unexpected (AutoWeightsLoader: any ".bias"): the
    # trainer's model is not the served one.
    dropped = set(unloaded(update, lambda n: n in wrong_dtype or copied.get(n, 0) > 0,
                           known_names(model) | set(checkpoint_names)))
    problems: list[str] = []
    for name in update.names:
        if name in wrong_dtype:
            sent = str(update.by_name[name].dtype).split(".")[-1]
            problems.append(f"{name!r}: dtype {sent} sent, the model loads {wrong_dtype[name]}")
        elif name in dropped:
            problems.append(
                f"{name!r} is not a weight of this model: vLLM's loader would drop it unused (the model has no "
                "parameter of that name and its checkpoint no such tensor)"
            )
    for key, numel in sorted(loaded.items(), key=lambda kv: layer_of[kv[0]][0]):
        total = sizes.get(key, 0)
        if 0 < numel < total:
            qual = layer_of[key][0] or type(layer_of[key][1]).__name__
            lacks = unfilled.get(key, [])
            if lacks:
                more = f" and {len(lacks) - 3} more" if len(lacks) > 3 else ""
                what = f"lacks {', '.join(repr(n) for n in lacks[:3])}{more} (it fills {numel} of its {total} elements)"
            else:
                what = f"fills {numel} of its {total} elements"
            problems.append(
                f"vLLM layer {qual!r} is loaded whole, but the update {what} (send every tensor of a layer in one "
                "update_weights call)"
            )
    return problems


@contextlib.contextmanager
def _on_meta(api: SimpleNamespace, layers: list[tuple[str, torch.nn.Module, Any]],
             counting: Callable[[torch.nn.Module, Callable], Callable]) -> Iterator[None]:
    """Every recorded layer on the meta device in its checkpoint format, as during
    vLLM's reload, each tensor's loader wrapped by ``counting``; on leaving, every
    layer gets its own tensors (and their attributes) back, whatever happened."""
    saved: list[tuple[torch.nn.Module, Any, set[str]]] = []
    attrs: list[tuple[torch.Tensor, dict[str, Any]]] = []
    try:
        for _, layer, info in layers:
            saved.append((layer, api.get_layer_params_buffers(layer), set(layer._non_persistent_buffers_set)))
            params, buffers = info.restore_metadata
            for t in list(params.values()) + list(buffers.values()):
                attrs.append((t, dict(t.__dict__)))
            api.restore_layer_on_meta(layer, info)
            for tname, t in api.get_layer_tensors(layer).items():
                if tname in api.SKIP_LOAD_TENSORS:
                    continue  # never loaded (expert maps): read as they are
                if not t.is_meta:
                    # What vLLM's reload loads in place (a bias): a meta twin here,
                    # so that nothing of the served model is written.
                    twin = api.to_meta_tensor(t)
                    if tname in layer._parameters:
                        layer._parameters[tname] = twin
                    else:
                        layer._buffers[tname] = twin
                    t = twin
                # A finished reload leaves its wrappers on the recorded tensors, and
                # they load nothing once it closed: vLLM's own unwrapping.
                t.weight_loader = counting(layer, api.original_loader(t))
        yield
    finally:
        for layer, (params, buffers), non_persistent in saved:
            for tname in list(api.get_layer_tensors(layer)):
                delattr(layer, tname)
            for tname, p in params.items():
                layer.register_parameter(tname, p)
            for tname, b in buffers.items():
                layer.register_buffer(tname, b, persistent=tname not in non_persistent)
            layer._non_persistent_buffers_set = non_persistent
        for t, d in attrs:
            t.__dict__.clear()
            t.__dict__.update(d)

