"""The ranks of one ``vllm serve`` (tensor parallel) agreeing on each step of an update.

vLLM runs each route of an update (``init_weight_transfer_engine``,
``start_weight_update``, ``update_weights``, ``finish_weight_update``, refit's
fleet verbs) on every worker of the server through its executor's
``collective_rpc``, which reads the workers' answers in rank order and raises at
the first failed one (vLLM 0.32 and 0.33 alike). The answers of the later ranks
are then never read: the next route reads them instead of its own, and from then
on every route of the server answers the one before it (a refusal's text at the
next ``start_weight_update``, then "already active" for ever).

So at more than one rank refit's worker engine never lets a step fail on one rank
alone: after each step the ranks exchange their outcomes (a few bytes over vLLM's
gloo group of the server's ranks), every rank settles the same way (a failed
update ends everywhere, the stage dropped), and only the server's last rank, the
last answer the executor reads, raises, naming each rank that failed and why.
The others return normally and close vLLM's worker session as a failing rank
does, so that every rank's next ``start_weight_update`` is taken.
"""

from __future__ import annotations

import logging
from dataclasses import dataclass
from typing import Any

logger = logging.getLogger("refit.vllm")


@dataclass(frozen=True)
class ServerRanks:
    """This worker's place among the ranks of its ``vllm serve`` replica."""

    rank: int
    size: int
    group: Any  # torch.distributed ProcessGroup (gloo)

    @property
    def last(self) -> bool:
        """Whether this rank's answer is the executor's last read."""
        return self.rank == self.size - 1

    def outcomes(self, failure: str | None) -> list[str | None]:
        """Every rank's failure (None: it succeeded), indexed by rank."""
        import torch.distributed as dist

        gathered: list[Any] = [None] * self.size
        dist.all_gather_object(gathered, failure, group=self.group)
        return gathered


def of_server(parallel_config: Any) -> ServerRanks | None:
    """The ranks of this worker's replica (tensor times pipeline parallel, one
    data-parallel replica), or None for a server of one rank (or a layout whose
    group refit cannot name: then each rank answers for itself, as before)."""
    world = int(getattr(parallel_config, "world_size", 1) or 1)
    if world <= 1:
        return None
    try:
        from vllm.distributed import parallel_state as ps

        pp = int(getattr(parallel_config, "pipeline_parallel_size", 1) or 1)
        dp = int(getattr(parallel_config, "data_parallel_size", 1) or 1)
        if pp == 1:
            group = ps.get_tp_group()
        elif dp == 1:
            group = ps.get_world_group()
        else:
            logger.warning("refit: the ranks of a server with pipeline and data parallelism do not agree on an "
                           "update's outcome; a step that fails on one rank can desynchronise vLLM's executor")
            return None
        if group.world_size != world:
            logger.warning("refit: vLLM's group has %d ranks, the server %d; ranks do not agree on outcomes",
                           group.world_size, world)
            return None
        return ServerRanks(rank=group.rank_in_group, size=group.world_size, group=group.cpu_group)
    except (ImportError, AssertionError, AttributeError) as e:
        logger.warning("refit: cannot find the server's rank group (%s); ranks do not agree on outcomes", e)
        return None


def describe(step: str, outcomes: list[str | None]) -> str:
    """The failures of a step, each rank named."""
    failed = [f"rank {r}: {why}" for r, why in enumerate(outcomes) if why is not None]
    return f"{step} failed on {len(failed)} of the server's {len(outcomes)} ranks: " + "; ".join(failed)
