"""The fleet protocol's rules for drivers written in Python: the same functions
refit's C++ ``worker_group`` runs (lib/control/fleet.h), so every driver of a
fleet decides alike (docs/control-plane.md describes the protocol).

* :func:`settle_failed_commit`: after a fleet-atomic update failed at a commit,
  where each member stands (``rolled_back``, ``failed``, ``in_doubt``,
  ``fenced``) and what that leaves the fleet;
* :func:`plan_reconcile`: how to bring a fleet a lost trainer left at two
  versions back to one (each member's ``none``, ``roll_back`` or ``fence``);
* :func:`outcome_of`: how a call that decides a member's version ended.
"""

from __future__ import annotations

import builtins
import sys
from collections.abc import Iterable, Mapping
from typing import Any, cast

from .. import _refit


def outcome_of(error: BaseException | None) -> str:
    """``"ok"`` for no error; ``"unknown"`` when the call got no answer (a
    timeout, a lost or refused connection, refit's or requests': it may still run,
    or have ended either way); ``"failed"`` when the member answered failure."""
    if error is None:
        return "ok"
    if isinstance(error, (builtins.TimeoutError, ConnectionError)):  # refit's TimeoutError and PeerLostError too
        return "unknown"
    requests = sys.modules.get("requests")  # its transport errors, where a driver uses it
    if requests is not None and isinstance(error, (requests.ConnectionError, requests.Timeout)):
        return "unknown"
    return "failed"


def settle_failed_commit(commits: Iterable[str], rollbacks: Iterable[str]) -> dict[str, Any]:
    """``commits[i]``: member i's commit (``"ok"``, ``"failed"``, ``"unknown"``);
    ``rollbacks[i]``: its rollback, for the members that committed. Returns
    ``{"phases": [...], "summary": "..."}``."""
    return cast(dict[str, Any], _refit._fleet_settle_failed_commit(commits=list(commits), rollbacks=list(rollbacks)))


def plan_reconcile(members: Iterable[Mapping[str, Any]]) -> dict[str, Any]:
    """``members``: ``{"name", "session_open", "clean", "version", "holds_undo",
    "undo_version"}`` each (an unknown undo version is None). Returns
    ``{"version", "actions": [...]}``; raises :class:`refit.InvalidStateError`
    while a session is open, or when no version every member holds or can roll
    back to exists (naming each member)."""
    return cast(dict[str, Any], _refit._fleet_plan_reconcile(members=[dict(m) for m in members]))
