"""tests/verl's venv is usable: verl's checkpoint-engine registry and torch import."""

import torch
from verl.checkpoint_engine.base import CheckpointEngineRegistry

assert "naive" in CheckpointEngineRegistry._registry, "verl's registry has none of its own engines"
print("verl venv: torch", torch.__version__)
