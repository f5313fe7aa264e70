"""The tiny model's weights as a trainer holds them: the checkpoint's tensors
(names as vLLM's loader takes them), optionally perturbed deterministically."""

from __future__ import annotations

import glob
import os

import torch
from safetensors.torch import load_file


def checkpoint_tensors(model_dir: str, seed: int | None = None, scale: float = 0.05) -> dict[str, torch.Tensor]:
    """The checkpoint's tensors in file order; with ``seed``, every floating
    tensor plus ``scale`` times normal noise from that seed (other weights that
    give other completions)."""
    tensors: dict[str, torch.Tensor] = {}
    for path in sorted(glob.glob(os.path.join(model_dir, "*.safetensors"))):
        tensors.update(load_file(path))
    if seed is None:
        return tensors
    g = torch.Generator().manual_seed(seed)
    out = {}
    for name, t in tensors.items():
        if t.is_floating_point():
            noise = torch.randn(t.shape, generator=g, dtype=torch.float32) * scale
            t = (t.float() + noise).to(t.dtype)
        out[name] = t.contiguous()
    return out


def update_info(tensors: dict[str, torch.Tensor]) -> dict:
    """vLLM's update_info members for these tensors."""
    return {
        "names": list(tensors),
        "dtype_names": [str(t.dtype).split(".")[-1] for t in tensors.values()],
        "shapes": [list(t.shape) for t in tensors.values()],
    }


class DictSource:
    """A vLLM WeightSource over a {name: tensor} dict, for the API of the vLLM in
    this environment (0.32: metadata() and iteration; 0.33: metadata and
    iter_full())."""

    @staticmethod
    def make(tensors: dict[str, torch.Tensor]):
        from vllm.distributed.weight_transfer.base import ParamMeta, WeightSource

        meta = [ParamMeta(n, t.dtype, tuple(t.shape)) for n, t in tensors.items()]
        if isinstance(getattr(WeightSource, "metadata", None), property):  # 0.33
            from functools import cached_property

            class Source(WeightSource):
                @cached_property
                def metadata(self):
                    return meta

                def iter_full(self):
                    return iter(tensors.items())
        else:  # 0.32

            class Source(WeightSource):
                def metadata(self):
                    return meta

                def __iter__(self):
                    return iter(tensors.items())

        return Source()
