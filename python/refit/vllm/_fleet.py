"""Several ``vllm serve`` replicas driven as one: :class:`FleetClient`.

A ``VLLMWeightSyncClient`` (vLLM's trainer engines take one) over the RLHF HTTP
routes of several servers: each call goes to every replica at once and waits for
all of them, and each replica's workers get their own ranks in refit's group
(``rank_offset``). With refit's trainer engine's ``fleet_atomic=True`` it also
drives refit's two phases, so that the fleet ends every update at one version:

1. ``start_weight_update`` and ``update_weights`` on every replica: each stages
   the whole update (the model untouched) and refuses it before a byte moves when
   it could not undo it;
2. ``prepare_weight_update``: every worker votes; a failed vote or any failure
   before it aborts the update on every replica (each keeps its weights);
3. ``finish_weight_update``: every replica commits, keeping its previous version.
   If any replica's commit fails, every replica that committed rolls back (and its
   ``/weight_info`` is set back to the version it had); a replica whose own commit
   failed loads its previous version back itself. :class:`FleetUpdateError` names
   every replica with its phase and error. A replica whose rollback failed is
   fenced: its ``/weight_info`` says ``"refit-fenced"``, never a version; one
   whose commit or rollback did not answer is in doubt.

Where each replica stands after a failed commit, and what :meth:`reconcile` does,
are the fleet protocol's rules (:mod:`refit.integration.fleet`), the functions
refit's C++ ``worker_group`` runs: one protocol, whatever carries its calls.

A trainer lost between two replicas' commits leaves them at two versions; a new
trainer's :meth:`FleetClient.reconcile` brings them back to one.

The extra verbs go through vLLM's dev-mode ``/collective_rpc`` route to refit's
``RefitWorkerExtension``: serve each replica with ``VLLM_SERVER_DEV_MODE=1`` and
``--worker-extension-cls refit.vllm.RefitWorkerExtension``.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from concurrent.futures import ThreadPoolExecutor
from typing import Any

import refit
from refit.integration import fleet

from ._trainer import InferenceServerError, error_text

__all__ = ["FENCED", "FleetClient", "FleetUpdateError"]

# The version a replica that could not be brought back to one is set to.
FENCED = "refit-fenced"


class FleetUpdateError(InferenceServerError):
    """A fleet update failed. ``outcomes`` is {replica url: {"phase": ..., ...}}:
    ``"failed"`` with ``error`` (the replica's own failure and its phase in
    ``at``), ``"rolled_back"`` (it had committed and is back at ``version``),
    ``"aborted"`` (its staged update was dropped), ``"fenced"`` (it holds no
    whole version; ``error`` says why), ``"in_doubt"`` (its commit or rollback,
    named in ``at``, did not answer: it may still run; :meth:`FleetClient.reconcile`
    brings it to the fleet's version once it answers)."""

    def __init__(self, message: str, outcomes: dict[str, dict[str, Any]]) -> None:
        super().__init__(message)
        self.outcomes = outcomes


class FleetClient:
    """vLLM's weight-sync client over ``urls`` (one per ``vllm serve`` replica)."""

    def __init__(self, urls: Sequence[str], timeout: float = 300) -> None:
        if not urls:
            raise ValueError("FleetClient needs at least one replica's url")
        self.urls = [u.rstrip("/") for u in urls]
        self.timeout = timeout
        self._fleet_atomic = False
        self._versions: dict[str, str | None] = {}  # each replica's version at start_weight_update

    # -- HTTP --------------------------------------------------------------------

    def _request(self, method: str, url: str, route: str, body: dict[str, Any] | None = None) -> Any:
        """One HTTP call to one replica; its JSON answer (None when it has none). An
        answer other than 200 raises InferenceServerError with the server's message."""
        import requests

        r = requests.request(method, f"{url}/{route}", json=body if method == "POST" else None,
                             timeout=self.timeout)
        if r.status_code != 200:
            raise InferenceServerError(f"{url}: {route}: HTTP {r.status_code}: {error_text(r)}")
        try:
            return r.json()
        except ValueError:
            return None

    def _post(self, url: str, route: str, body: dict[str, Any] | None = None) -> Any:
        return self._request("POST", url, route, body if body is not None else {})

    def _rpc(self, url: str, method: str, *args: str) -> list[Any]:
        """``method`` on every worker of one replica (vLLM's ``/collective_rpc``)."""
        out = self._post(url, "collective_rpc", {"method": method, "args": list(args), "timeout": self.timeout})
        return list((out or {}).get("results", []))

    def weight_version(self, url: str) -> str | None:
        return self._request("GET", url, "weight_info").get("weight_version")

    def _each(self, fn: Callable[[str], Any]) -> tuple[dict[str, Any], dict[str, BaseException]]:
        """fn(url) for every replica at once: ({url: result}, {url: exception})."""
        with ThreadPoolExecutor(max_workers=len(self.urls), thread_name_prefix="refit-fleet") as pool:
            futures = {url: pool.submit(fn, url) for url in self.urls}
        results: dict[str, Any] = {}
        failed: dict[str, BaseException] = {}
        for url, f in futures.items():
            error = f.exception()
            if error is None:
                results[url] = f.result()
            else:
                failed[url] = error
        return results, failed

    def _all(self, verb: str, fn: Callable[[str], Any]) -> dict[str, Any]:
        """fn(url) for every replica at once; raises naming each that failed."""
        results, failed = self._each(fn)
        if failed:
            self._raise_failed(verb, failed)
        return results

    def _raise_failed(self, verb: str, failed: dict[str, BaseException]) -> None:
        outcomes = {u: {"phase": "failed", "at": verb, "error": str(e)} for u, e in failed.items()}
        raise FleetUpdateError(f"{verb} failed on {len(failed)} of {len(self.urls)} replicas: " +
                               "; ".join(f"{u}: {e}" for u, e in failed.items()), outcomes) \
            from next(iter(failed.values()))

    # -- vLLM's VLLMWeightSyncClient ------------------------------------------------

    def world_sizes(self) -> list[int]:
        """Each replica's worker count (TP * PP * DP)."""
        return [int(self._request("GET", url, "get_world_size")["world_size"]) for url in self.urls]

    def init_weight_transfer_engine(self, init_info: dict[str, Any]) -> None:
        """Every replica's init, each with its workers' ranks: the trainer's
        ``rank_offset`` plus the workers of the replicas before it."""
        inner = init_info.get("init_info")
        payloads: dict[str, dict[str, Any]] = {}
        offset = int(inner.get("rank_offset", 1)) if isinstance(inner, dict) else 0
        sizes = self.world_sizes() if isinstance(inner, dict) else [0] * len(self.urls)
        for url, size in zip(self.urls, sizes):
            payload = dict(init_info)
            if isinstance(inner, dict):
                payload["init_info"] = dict(inner, rank_offset=offset)
            payloads[url] = payload
            offset += size
        self._all("init_weight_transfer_engine",
                  lambda url: self._post(url, "init_weight_transfer_engine", {"init_info": payloads[url]}))

    def shutdown_weight_transfer_engine(self) -> None:
        self._all("shutdown_weight_transfer_engine", lambda url: self._post(url, "shutdown_weight_transfer_engine"))

    def start_weight_update(self) -> None:
        self._fleet_atomic = False
        self._versions = {url: self.weight_version(url) for url in self.urls}
        self._all("start_weight_update", lambda url: self._post(url, "start_weight_update"))

    def update_weights(self, update_info: Any) -> None:
        if isinstance(update_info, dict) and update_info.get("fleet_atomic"):
            self._fleet_atomic = True
        self._all("update_weights", lambda url: self._post(url, "update_weights", {"update_info": update_info}))

    # -- refit's two phases -----------------------------------------------------------

    def prepare_weight_update(self) -> None:
        """Every worker's vote. A failed vote aborts the update on every replica
        (each keeps its weights) and raises :class:`FleetUpdateError`."""
        _, failed = self._each(lambda url: self._rpc(url, "refit_prepare_weight_update"))
        if not failed:
            return
        why = "; ".join(f"{u}: {e}" for u, e in failed.items())
        outcomes = self._abort_all(f"a replica voted no: {why}")
        for u, e in failed.items():
            outcomes[u] = dict(outcomes.get(u, {}), phase="failed", at="prepare", error=str(e))
        raise FleetUpdateError(f"prepare failed; the update was aborted on every replica: {why}", outcomes) \
            from next(iter(failed.values()))

    def abort_weight_update(self, why: str = "") -> dict[str, dict[str, Any]]:
        """Drops the open update on every replica (each keeps its weights)."""
        return self._abort_all(why or "the trainer aborted the update")

    def _abort_all(self, why: str) -> dict[str, dict[str, Any]]:
        done, failed = self._each(lambda url: self._rpc(url, "refit_abort_weight_update", why))
        return {url: {"phase": "aborted"} if url in done else
                {"phase": "failed", "at": "abort", "error": str(failed[url])} for url in self.urls}

    def finish_weight_update(self, weight_version: str | None = None) -> None:
        """Every replica commits. In a fleet-atomic update, a commit that fails on
        any replica rolls back every replica that committed (see the module); where
        each replica stands then is the fleet protocol's rule
        (:func:`refit.integration.fleet.settle_failed_commit`), the same as
        refit's C++ ``worker_group``: a replica whose commit or rollback did not
        answer is ``in_doubt`` (it may still run; :meth:`reconcile` brings it to
        the fleet's version once it answers), never reported at a version."""
        body = {"weight_version": weight_version} if weight_version is not None else None
        _, failed = self._each(lambda url: self._post(url, "finish_weight_update", body))
        if not failed:
            return
        if not self._fleet_atomic:  # no undo: each replica is left as its commit left it
            self._raise_failed("commit", failed)
        why = "; ".join(f"{u}: {e}" for u, e in failed.items())
        rollbacks = {url: self._roll_back_call(url) for url in self.urls if url not in failed}
        settled = fleet.settle_failed_commit([fleet.outcome_of(failed.get(u)) for u in self.urls],
                                             [fleet.outcome_of(rollbacks.get(u)) for u in self.urls])
        outcomes = {url: self._settled(url, phase, failed.get(url), rollbacks.get(url))
                    for url, phase in zip(self.urls, settled["phases"])}
        raise FleetUpdateError(
            f"the commit failed on {len(failed)} of {len(self.urls)} replicas ({why}); {settled['summary']} " +
            ", ".join(f"{u}: {o['phase']}" for u, o in outcomes.items()), outcomes) from next(iter(failed.values()))

    def _settled(self, url: str, phase: str, commit_error: BaseException | None,
                 rollback_error: BaseException | None) -> dict[str, Any]:
        """What the rule's ``phase`` for ``url`` does and reports."""
        if phase == "failed":
            return self._settle_failed(url, str(commit_error))
        if phase == "fenced":
            return self._fence(url, {"phase": "failed", "at": "rollback", "error": str(rollback_error)})
        if phase == "in_doubt":
            at, error = ("commit", commit_error) if commit_error is not None else ("rollback", rollback_error)
            return {"phase": "in_doubt", "at": at, "error": str(error)}
        return {"phase": "rolled_back", "version": self._versions.get(url)}

    def _settle_failed(self, url: str, error: str) -> dict[str, Any]:
        """A replica whose own commit failed: its refit engine loaded the previous
        version back (or is dirty: then it is fenced); vLLM's session is ended."""
        outcome: dict[str, Any] = {"phase": "failed", "at": "commit", "error": error,
                                   "version": self._versions.get(url)}
        try:
            states = self._rpc(url, "refit_abort_weight_update", "its commit failed")
            dirty = [s["state"].get("dirty_reason") for s in states if s["state"].get("weights_dirty")]
        except BaseException as e:  # noqa: BLE001 - the replica is not known to hold one version
            dirty = [f"its state could not be read: {e}"]
        if dirty:
            return self._fence(url, dict(outcome, error=f"{error}; not back at one version: {dirty[0]}"))
        return outcome

    def _roll_back_call(self, url: str, held_only: bool = False) -> BaseException | None:
        """Rolls ``url`` back to its version before the update (and says that
        version again in ``/weight_info``); the error, if any. ``held_only``: only
        its ranks that hold the undo (the others did not commit)."""
        before = self._versions.get(url)
        try:
            self._rpc(url, "refit_rollback_weight_update", *(("1",) if held_only else ()))
            if before is not None:
                self._post(url, "update_weight_version", {"new_version": before})
        except BaseException as e:  # noqa: BLE001 - settled by the rule
            return e
        return None

    def _roll_back(self, url: str, held_only: bool = False) -> dict[str, Any]:
        error = self._roll_back_call(url, held_only)
        if error is not None:
            return self._fence(url, {"phase": "failed", "at": "rollback", "error": str(error)})
        return {"phase": "rolled_back", "version": self._versions.get(url)}

    def _fence(self, url: str, outcome: dict[str, Any]) -> dict[str, Any]:
        try:
            self._post(url, "update_weight_version", {"new_version": FENCED})
        except BaseException as e:  # noqa: BLE001
            outcome["error"] = f"{outcome.get('error', '')}; fencing its version failed too: {e}"
        return dict(outcome, phase="fenced")

    def rollback_weight_update(self) -> None:
        """Every replica back to the version before the last fleet-atomic finish
        (each holds that version's undo until the next update starts)."""
        outcomes = {url: self._roll_back(url) for url in self.urls}
        bad = {u: o for u, o in outcomes.items() if o["phase"] != "rolled_back"}
        if bad:
            raise FleetUpdateError("rollback failed on " + ", ".join(bad), outcomes)

    def reconcile(self) -> dict[str, dict[str, Any]]:
        """Brings the replicas back to one version after a trainer was lost in the
        middle of a fleet-atomic update (call it from the new trainer before its
        first update). First, an update still open on a replica (its trainer is
        gone: prepared, or not yet) is aborted; staged, so nothing of it reached
        the model. Then the fleet protocol's rule
        (:func:`refit.integration.fleet.plan_reconcile`, the same as refit's C++
        ``worker_group``): the replicas that committed the lost update (they hold
        the undo, at another version than the rest) roll back to the version the
        others hold, and ``/weight_info`` says it again; a replica whose workers
        are dirty, or whose rollback fails, is fenced.

        Returns {url: {"action": "none" | "aborted" | "rolled_back" | "fenced",
        "version": ...}}. Raises :class:`FleetUpdateError` when no version every
        replica holds or can roll back to exists (the replicas that did not commit
        disagree: a full update brings them together)."""
        states = self._all("refit_weight_state", lambda url: self._rpc(url, "refit_weight_state"))
        versions = {url: self.weight_version(url) for url in self.urls}
        report: dict[str, dict[str, Any]] = {}
        for url, workers in states.items():
            if any(w.get("update_open") or w.get("session_active") for w in workers):
                self._rpc(url, "refit_abort_weight_update", "reconcile: the trainer that opened this update is gone")
                report[url] = {"action": "aborted", "version": versions[url]}
        members = [{
            "name": url,
            "clean": not any(w.get("weights_dirty") for w in states[url]),
            "version": versions[url],
            # vLLM's labels: a replica's undo does not know the label it goes back to.
            # Each rank is a unit: a replica counts as holding the lost update's
            # undo when any of its ranks does (those ranks committed it; the
            # rollback below rolls back exactly them).
            "holds_undo": url not in report and any(w.get("holds_undo") for w in states[url]),
        } for url in self.urls]
        try:
            plan = fleet.plan_reconcile(members)
        except refit.InvalidStateError as e:
            raise FleetUpdateError(f"reconcile: {e.message}",
                                   {u: {"action": "none", "version": versions[u]} for u in self.urls}) from e
        for url, action in zip(self.urls, plan["actions"]):
            if action == "roll_back":
                self._versions[url] = plan["version"]
                outcome = self._roll_back(url, held_only=True)
                rolled = outcome["phase"] == "rolled_back"
                report[url] = {**outcome, "action": "rolled_back" if rolled else "fenced",
                               "version": plan["version"] if rolled else FENCED}
            elif action == "fence":
                dirty = [w.get("dirty_reason") for w in states[url] if w.get("weights_dirty")]
                report[url] = self._fence(url, {"action": "fenced", "error": dirty[0] if dirty else "dirty"})
            elif url not in report:
                report[url] = {"action": "none", "version": versions[url]}
        return report

    def release_weight_undo(self) -> None:
        self._all("release_weight_undo", lambda url: self._rpc(url, "refit_release_weight_undo"))

    def refit_states(self) -> dict[str, list[dict[str, Any]]]:
        """{url: every worker's refit state}."""
        return self._all("refit_weight_state", lambda url: self._rpc(url, "refit_weight_state"))
