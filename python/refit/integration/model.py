"""The served model's side of an update, the parts every server shares: the
update as meta tensors for a dry run of the model's own loader
(:class:`MetaUpdate`), what such a run leaves unloaded (:func:`unloaded`), and the
undo of an apply (:class:`Undo`)."""

from __future__ import annotations

from collections.abc import Callable, Iterable, Iterator, Mapping
from typing import Any

import torch


def torch_dtype(name: str) -> torch.dtype | None:
    """torch's dtype of that name (``"bfloat16"``), None when there is none."""
    dtype = getattr(torch, str(name), None)
    return dtype if isinstance(dtype, torch.dtype) else None


class MetaUpdate:
    """An update's ``{"names", "dtype_names", "shapes"}`` as tensors on the meta
    device (shapes and dtypes, no data), fed to a model's ``load_weights`` by
    :meth:`feed`, which knows which name the loader is on (:attr:`current`) and
    which sent tensor (or a view of one) a ``weight_loader`` was given
    (:meth:`source_of`). ``problems``: the names whose dtype torch does not know."""

    def __init__(self, names: Iterable[str], dtype_names: Iterable[str], shapes: Iterable[Iterable[int]]) -> None:
        self.tensors: list[tuple[str, torch.Tensor]] = []
        self.problems: list[str] = []
        self.current: str | None = None
        self._names: dict[int, str] = {}  # id of a sent meta tensor -> its name
        for name, dtype_name, shape in zip(names, dtype_names, shapes):
            dtype = torch_dtype(dtype_name)
            if dtype is None:
                self.problems.append(f"{name!r}: dtype {dtype_name!r} is not a torch dtype")
                continue
            t = torch.empty([int(d) for d in shape], dtype=dtype, device="meta")
            self._names[id(t)] = name
            self.tensors.append((name, t))
        self.by_name: dict[str, torch.Tensor] = dict(self.tensors)

    @classmethod
    def of(cls, update_info: Mapping[str, Any]) -> MetaUpdate:
        """The update an update_info describes."""
        return cls(update_info.get("names", ()), update_info.get("dtype_names", ()), update_info.get("shapes", ()))

    @property
    def names(self) -> list[str]:
        return [name for name, _ in self.tensors]

    def feed(self) -> Iterator[tuple[str, torch.Tensor]]:
        """The tensors, in order, for ``load_weights``; :attr:`current` follows."""
        for name, t in self.tensors:
            self.current = name
            yield name, t
        self.current = None

    def source_of(self, values: Iterable[Any]) -> str | None:
        """The name of the sent tensor among ``values`` (a loader's arguments; a
        view or slice of one counts), else the name the loader is on."""
        for value in values:
            base = value
            while isinstance(base, torch.Tensor) and id(base) not in self._names and base._base is not None:
                base = base._base
            if isinstance(base, torch.Tensor) and id(base) in self._names:
                return self._names[id(base)]
        return self.current

    def run(self, load_weights: Callable[[Iterable[tuple[str, torch.Tensor]]], Any]) -> BaseException | None:
        """``load_weights(feed())``; what it raised (the refusal), else None."""
        try:
            load_weights(self.feed())
        except Exception as e:  # noqa: BLE001 - the loader's refusal, returned to be quoted
            return e
        return None


def known_names(model: torch.nn.Module) -> set[str]:
    """Every name the model answers to: its parameters and buffers, tied aliases
    (``lm_head.weight``) included."""
    known = {n for n, _ in model.named_parameters(remove_duplicate=False)}
    known |= {n for n, _ in model.named_buffers(remove_duplicate=False)}
    return known


def unloaded(update: MetaUpdate, loaded: Callable[[str], bool], known: set[str] | frozenset[str]) -> list[str]:
    """The names of ``update`` the loader took into nothing (``loaded(name)``
    false) that are not ``known`` either: a trainer's model that is not the served
    one (a loader drops what it does not expect)."""
    return [name for name in update.names if not loaded(name) and name not in known]


def first_sentence(text: str, limit: int = 300) -> str:
    """A loader's message up to its first sentence (vLLM's goes on to list every
    parameter of the module), at most ``limit`` characters."""
    text = text.splitlines()[0] if text else text
    end = text.find(". ")
    if end > 0:
        text = text[:end]
    return text if len(text) <= limit else text[: limit - 3] + "..."


class Undo:
    """A host copy of the parameters an apply is about to write, to put back if
    it (or another rank's) fails: :meth:`capture` before, :meth:`restore` after."""

    def __init__(self) -> None:
        self.saved: dict[str, torch.Tensor] = {}

    @classmethod
    def capture(cls, params: Mapping[str, torch.Tensor], names: Iterable[str]) -> Undo:
        undo = cls()
        undo.saved = {p: params[p].detach().to("cpu", copy=True) for p in sorted(set(names) & params.keys())}
        return undo

    def __len__(self) -> int:
        return len(self.saved)

    def restore(self, params: Mapping[str, torch.Tensor]) -> int:
        """Every captured parameter back as it was; returns how many."""
        with torch.no_grad():
            for name, saved in self.saved.items():
                params[name].data.copy_(saved)
        return len(self.saved)
