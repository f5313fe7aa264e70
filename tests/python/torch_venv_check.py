"""python/venv.sh's check of the round-trip venvs (python/requirements-torch.txt):
numpy and torch import, and torch computes."""

import numpy
import torch

x = torch.arange(6, dtype=torch.float32).to(torch.bfloat16)
assert x.sum().item() == 15.0
print("torch venv ok: torch", torch.__version__, "numpy", numpy.__version__)
