"""What a vLLM model loads: the tensors of the checkpoint vLLM built it from.

refit checks every update against this before a byte of it moves, so that a name
the model lacks, a wrong shape or a wrong dtype is refused while the model still
serves its old weights (vLLM's own loader finds such errors only halfway through a
reload, with the model's layers already on the meta device).

The checkpoint is the model's safetensors files (every tensor's name, dtype and
shape are in their headers, read without loading any data): in
``model_config.model`` when it is a folder, else in the Hugging Face cache's
snapshot of that repository (never downloaded here). A model vLLM loaded from
anything else (dummy weights, another format) has no index; its updates are
checked by vLLM's loader only.
"""

from __future__ import annotations

import glob
import json
import logging
import os
import struct
from collections.abc import Iterable, Mapping
from dataclasses import dataclass
from typing import Any

logger = logging.getLogger(__name__)

# safetensors' dtype codes in vLLM's spelling (what update infos carry).
_SAFETENSORS_DTYPES = {
    "BF16": "bfloat16",
    "F16": "float16",
    "F32": "float32",
    "F64": "float64",
    "I8": "int8",
    "U8": "uint8",
    "I16": "int16",
    "I32": "int32",
    "I64": "int64",
    "BOOL": "bool",
    "F8_E4M3": "float8_e4m3fn",
    "F8_E5M2": "float8_e5m2",
}

# At most this many problems are listed in one refusal.
_MAX_LISTED = 8


@dataclass(frozen=True)
class CheckpointTensor:
    dtype: str  # vLLM's spelling ("bfloat16")
    shape: tuple[int, ...]


def read_safetensors_header(path: str) -> dict[str, CheckpointTensor]:
    """The tensors one ``.safetensors`` file declares (its JSON header only)."""
    with open(path, "rb") as f:
        raw = f.read(8)
        if len(raw) != 8:
            raise ValueError(f"{path}: not a safetensors file (shorter than its 8-byte header length)")
        (n,) = struct.unpack("<Q", raw)
        if n > 100 << 20:
            raise ValueError(f"{path}: safetensors header of {n} bytes is implausibly large")
        header = json.loads(f.read(n))
    out: dict[str, CheckpointTensor] = {}
    for name, entry in header.items():
        if name == "__metadata__":
            continue
        code = entry.get("dtype")
        out[name] = CheckpointTensor(_SAFETENSORS_DTYPES.get(code, str(code).lower()), tuple(entry.get("shape", ())))
    return out


def _checkpoint_folder(model_config: Any) -> str | None:
    model = getattr(model_config, "model", None)
    if not isinstance(model, str) or not model:
        return None
    if os.path.isdir(model):
        return model
    try:  # a repository id: its snapshot in the local cache, if any
        from huggingface_hub import snapshot_download

        return snapshot_download(
            repo_id=model,
            revision=getattr(model_config, "revision", None),
            local_files_only=True,
            allow_patterns=["*.safetensors", "*.json"],
        )
    except Exception:  # noqa: BLE001 - not cached, not a repository: no index
        return None


@dataclass
class CheckpointIndex:
    """Every tensor of a model's checkpoint, and which of them vLLM loads as one
    layer (see :meth:`layer_of`)."""

    folder: str
    tensors: dict[str, CheckpointTensor]
    model_dtype: str | None
    # vLLM's fused modules: {"q_proj": "qkv_proj", "k_proj": "qkv_proj", ...}
    fused: dict[str, str]

    @classmethod
    def load(cls, model_config: Any, model: Any) -> CheckpointIndex | None:
        """The index of the checkpoint ``model_config`` names, None when there is none."""
        folder = _checkpoint_folder(model_config)
        if folder is None:
            return None
        files = sorted(glob.glob(os.path.join(folder, "*.safetensors")))
        if not files:
            return None
        tensors: dict[str, CheckpointTensor] = {}
        for path in files:
            tensors.update(read_safetensors_header(path))
        dtype = getattr(model_config, "dtype", None)
        model_dtype = str(dtype).split(".")[-1] if dtype is not None else None
        return cls(folder, tensors, model_dtype, fused_modules(model))

    def layer_of(self, name: str) -> str:
        """The vLLM module ``name`` is loaded into: its parent module, with the
        checkpoint's separate projections mapped to the module vLLM fuses them
        into (``...q_proj.weight`` -> ``...qkv_proj``)."""
        parent, _, _ = name.rpartition(".")
        head, _, last = parent.rpartition(".")
        fused = self.fused.get(last)
        if fused is None:
            return parent
        return f"{head}.{fused}" if head else fused

    def problems(self, names: Iterable[str], dtype_names: Iterable[str], shapes: Iterable[Iterable[int]]) -> list[str]:
        """What keeps an update of these tensors from loading: names the checkpoint
        lacks, shapes that differ, dtypes that are neither the checkpoint's nor the
        model's, and vLLM layers the update carries only part of (vLLM reloads a
        layer once all of its tensors arrived; a layer left half-loaded cannot be
        served)."""
        problems: list[str] = []
        names = list(names)
        for name, dtype, shape in zip(names, dtype_names, shapes):
            want = self.tensors.get(name)
            if want is None:
                problems.append(
                    f"{name!r} is not a weight of this model (its checkpoint {self.folder} has no such tensor)"
                )
                continue
            shape = tuple(int(d) for d in shape)
            if shape != want.shape:
                problems.append(f"{name!r}: shape {list(shape)} sent, the model loads {list(want.shape)}")
            allowed = {want.dtype} | ({self.model_dtype} if self.model_dtype else set())
            if dtype not in allowed:
                problems.append(
                    f"{name!r}: dtype {dtype} sent, the model loads {' or '.join(sorted(allowed))}"
                )
        sent = set(names)
        wanted_layers = {self.layer_of(n) for n in sent if n in self.tensors}
        if wanted_layers:
            members: dict[str, list[str]] = {}
            for n in self.tensors:
                layer = self.layer_of(n)
                if layer in wanted_layers:
                    members.setdefault(layer, []).append(n)
            for layer in sorted(wanted_layers):
                missing = [n for n in members[layer] if n not in sent]
                if missing:
                    problems.append(
                        f"vLLM layer {layer!r} is loaded whole, but the update lacks {missing[:3]}"
                        + (f" and {len(missing) - 3} more" if len(missing) > 3 else "")
                        + " of its tensors (send every tensor of a layer in one update_weights call)"
                    )
        return problems

    def seed(self, base: Any) -> None:
        """Copies every checkpoint tensor into ``base`` (a ``refit.HostCopy``) as
        the model holds it: floating tensors in the model's dtype (vLLM casts them
        so at load), one file at a time."""
        import torch
        from safetensors import safe_open

        dtype = getattr(torch, self.model_dtype, None) if self.model_dtype else None
        for path in sorted(glob.glob(os.path.join(self.folder, "*.safetensors"))):
            tensors = {}
            with safe_open(path, framework="pt") as f:
                for name in f.keys():  # noqa: SIM118 - safe_open is not a mapping
                    t = f.get_tensor(name)
                    if isinstance(dtype, torch.dtype) and t.is_floating_point() and t.dtype != dtype:
                        t = t.to(dtype)
                    tensors[name] = t.contiguous()
            base.seed(tensors)

    def check(self, update: Mapping[str, Any]) -> None:
        """Raises ValueError naming what keeps ``update`` ({"names", "dtype_names",
        "shapes"}) from loading; returns when it loads."""
        refuse(self.problems(update.get("names", ()), update.get("dtype_names", ()), update.get("shapes", ())))


def refuse(problems: list[str]) -> None:
    """Raises ValueError listing ``problems`` (at most a few), if there are any."""
    if problems:
        more = f" (and {len(problems) - _MAX_LISTED} more)" if len(problems) > _MAX_LISTED else ""
        raise ValueError(
            "the update does not fit the served model, so it was refused before any byte moved (the model "
            "keeps its weights): " + "; ".join(problems[:_MAX_LISTED]) + more
        )


def fused_modules(model: Any) -> dict[str, str]:
    """{checkpoint module: vLLM module} from the model's ``packed_modules_mapping``
    (every vLLM model that fuses projections declares it)."""
    mapping = getattr(model, "packed_modules_mapping", None) or {}
    out: dict[str, str] = {}
    try:
        for fused, parts in dict(mapping).items():
            for part in parts:
                out[str(part)] = str(fused)
    except (TypeError, ValueError):
        logger.warning(
            "refit: the model's packed_modules_mapping is not a mapping of lists; layers are checked unfused"
        )
    return out
