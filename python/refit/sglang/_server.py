"""The server side: :func:`load_weights`, SGLang's custom weight loader.

SGLang calls it as ``load_weights(model, named_tensors)`` on every tensor-parallel
rank, in the scheduler, between forward passes, when a request to
``/update_weights_from_tensor`` names ``refit.sglang.load_weights`` as its
``load_format`` (the server lists it in ``--custom-weight-loader``). refit's client
sends one *ticket* that way: an empty tensor whose name is ``"refit:" + JSON``.
The ticket says what to do at this safe point:

* ``connect``: start (or keep) this rank's :class:`refit.WorkerHost`, which
  receives updates into a host buffer, never into the model, and tell the
  client where it listens (a connection to the client's registration address);
* ``check``: run the model's own ``load_weights`` on meta tensors of the next
  update's names, shapes and dtypes, every parameter's ``weight_loader`` applied
  to a meta copy of the parameter: names it routes nowhere, shapes its loaders
  refuse, are the problems; nothing of the model is written;
* ``apply``: load the update this rank's host received whole (version ``v``)
  through the model's ``load_weights``, after a host copy of every parameter it
  touches (the undo); if loading raises, every one of them is restored;
* ``rollback``: restore the undo of the last apply (another rank failed its own).

SGLang ends the server's scheduler when a custom loader raises, and reports
success otherwise, so this loader never raises: each ticket's outcome is kept
per rank and the client reads it over refit's control plane (the host's
``refit_sglang_outcome`` method) before it goes on. Only ``apply`` names a
``weight_version`` in its request, and the client rolls back (restoring the old
version too) when any rank's apply failed.
"""

from __future__ import annotations

import json
import logging
import socket
import threading
import traceback
import urllib.request
from typing import Any

import torch

import refit
from refit.integration import Options
from refit.integration.model import MetaUpdate, Undo, unloaded

logger = logging.getLogger("refit.sglang")

TICKET = "refit:"
_MISSING = object()


def load_weights(model: torch.nn.Module, named_tensors: list[tuple[str, Any]]) -> None:
    """SGLang's custom weight loader (``--custom-weight-loader
    refit.sglang.load_weights``): runs refit's tickets. Never raises."""
    others = [name for name, _ in named_tensors if not name.startswith(TICKET)]
    if others:
        # Weights sent through SGLang's own path to refit's loader: not loaded
        # (a load here could raise into the scheduler); said, naming them.
        logger.error("refit.sglang: %d tensors that are not refit tickets were not loaded (send weights with "
                     "refit.sglang.Client, or without load_format): %s", len(others), others[:8])
    for name, _ in named_tensors:
        if not name.startswith(TICKET):
            continue
        try:
            ticket = json.loads(name[len(TICKET):])
        except ValueError as e:
            logger.error("refit.sglang: a ticket that is not JSON: %s", e)
            continue
        _RANK.run(model, ticket)


def _tp() -> tuple[int, int]:
    """This process's tensor-parallel rank and size in SGLang."""
    try:
        from sglang.srt.distributed import get_tensor_model_parallel_rank, get_tensor_model_parallel_world_size

        return get_tensor_model_parallel_rank(), get_tensor_model_parallel_world_size()
    except Exception:  # another SGLang layout: torch's process group
        if torch.distributed.is_available() and torch.distributed.is_initialized():
            return torch.distributed.get_rank(), torch.distributed.get_world_size()
        return 0, 1


class _Rank:
    """This tensor-parallel rank's refit state (one per scheduler process)."""

    def __init__(self) -> None:
        self.lock = threading.Lock()
        self.host: refit.WorkerHost | None = None
        self.host_key: Any = None
        self.outcomes: dict[str, dict] = {}  # ticket id -> outcome (the last few)
        self.receiving: list[tuple[str, torch.Tensor]] = []  # the update being received
        self.pending: dict[int, list[tuple[str, torch.Tensor]]] = {}  # version -> received whole
        self.undo: Undo | None = None  # the parameters the last apply wrote, as they were before
        self.touches: dict[str, list[str]] = {}  # update name -> the parameters the check saw it load
        self.guard: threading.Timer | None = None  # resumes generation a lost client left paused

    # ---------------------------------------------------------------- tickets

    def run(self, model: torch.nn.Module, ticket: dict) -> None:
        op, tid = ticket.get("op"), str(ticket.get("id", ""))
        try:
            out = getattr(self, "_" + str(op))(model, ticket) if op in _OPS else {"error": f"unknown op {op!r}"}
        except Exception as e:  # never into SGLang's scheduler
            out = {"error": f"{type(e).__name__}: {e}", "trace": traceback.format_exc(limit=8)}
        out.setdefault("ok", "error" not in out)
        rank, size = _tp()
        out.update(op=op, tp_rank=rank, tp_size=size)
        with self.lock:
            self.outcomes[tid] = out
            while len(self.outcomes) > 64:
                self.outcomes.pop(next(iter(self.outcomes)))
        if not out["ok"]:
            logger.warning("refit.sglang: ticket %s (%s) on tp rank %d: %s", tid, op, rank, out["error"])

    def _connect(self, model: torch.nn.Module, t: dict) -> dict:
        rank, size = _tp()
        key = (t.get("engine", "tcp"), t.get("address"), t.get("timeout_ms"), t.get("auth_secret_file"))
        if self.host is None or key != self.host_key:
            if self.host is not None:
                self.host.stop()
            # The client's options, checked here as there. The GPU engines land
            # buckets in this rank's GPU memory (torch's current device); what is
            # received is still kept on the host until the apply (_received).
            options = Options(engine=key[0], timeout_ms=int(t.get("timeout_ms") or 60000),
                              auth_secret_file=t.get("auth_secret_file"), owner="refit.sglang")
            self.host = refit.WorkerHost(
                **options.worker_args(), host=t.get("address") or "127.0.0.1", port=0, load_weights=self._received,
                on_update_started=lambda owner: self._started(),
                on_update_finished=lambda version, stats: self._finished(version),
                on_update_failed=lambda reason: self._failed(),
            )
            self.host.add_method("refit_sglang_outcome", self._outcome)
            self.host.add_method("refit_sglang_guard", self._guard)
            self.host_key = key
        me = {"tp_rank": rank, "tp_size": size, "address": t.get("address") or "127.0.0.1",
              "port": self.host.port, "id": str(t.get("id", ""))}
        host, _, port = str(t["register"]).rpartition(":")
        deadline_s = min(10.0, int(t.get("timeout_ms") or 60000) / 1000)
        with socket.create_connection((host, int(port)), timeout=deadline_s) as s:
            s.sendall((json.dumps(me) + "\n").encode())
        return {"port": self.host.port}

    def _check(self, model: torch.nn.Module, t: dict) -> dict:
        with self.lock:
            self.pending.clear()  # an update left unapplied is not this one
        self.undo = None
        info = t["update_info"]
        problems, touches = loader_problems(model, info["names"], info["dtype_names"], info["shapes"])
        self.touches = touches
        return {"problems": problems} if not problems else {"problems": problems, "error": "; ".join(problems[:8])}

    def _apply(self, model: torch.nn.Module, t: dict) -> dict:
        version = int(t["version"])
        with self.lock:
            tensors = self.pending.pop(version, None)
            self.pending.clear()
        if tensors is None:
            return {"error": f"this rank holds no whole update at version {version} (none arrived, or it failed)"}
        params = dict(model.named_parameters())
        undo = Undo.capture(params, (p for name, _ in tensors for p in self.touches.get(name, ())))
        try:
            model.load_weights(tensors)
        except Exception as e:
            undo.restore(params)
            return {"error": f"the model's load_weights raised {type(e).__name__}: {e}; every parameter it touched "
                             "was restored"}
        self.undo = undo
        return {"version": version, "tensors": len(tensors), "parameters": len(undo)}

    def _rollback(self, model: torch.nn.Module, t: dict) -> dict:
        if self.undo is None:
            return {"restored": 0}  # this rank applied nothing: nothing to undo
        undo, self.undo = self.undo, None
        return {"restored": undo.restore(dict(model.named_parameters()))}

    # ------------------------------------------------- refit's host (its threads)

    def _started(self) -> None:
        with self.lock:
            self.receiving = []

    def _received(self, batch: list[tuple[str, Any]]) -> None:
        # The views are refit's buffers (host or device): copied to the host.
        copies = [(name, tensor.to("cpu", copy=True)) for name, tensor in batch]
        with self.lock:
            self.receiving.extend(copies)

    def _finished(self, version: int) -> None:
        with self.lock:
            self.pending[int(version)] = self.receiving
            self.receiving = []

    def _failed(self) -> None:
        with self.lock:
            self.receiving = []

    def _outcome(self, args: dict) -> dict:
        with self.lock:
            out = self.outcomes.get(str(args.get("ticket")))
        return {"outcome": out}

    def _guard(self, args: dict) -> dict:
        """Armed by the client before it pauses generation, disarmed once it
        resumed it: a client lost in between (killed, cut off) leaves the server
        paused only until ``ms`` passed; then this rank resumes it."""
        with self.lock:
            if self.guard is not None:
                self.guard.cancel()
                self.guard = None
            if args.get("arm"):
                self.guard = threading.Timer(int(args["ms"]) / 1000, _resume, (str(args["url"]), args.get("api_key")))
                self.guard.daemon = True
                self.guard.start()
        return {"armed": bool(args.get("arm"))}


_OPS = ("connect", "check", "apply", "rollback")
_RANK = _Rank()


def _resume(url: str, api_key: str | None) -> None:
    """POST /continue_generation to the server a lost client left paused."""
    req = urllib.request.Request(url.rstrip("/") + "/continue_generation", data=b"{}", method="POST",
                                 headers={"Content-Type": "application/json"})
    if api_key:
        req.add_header("Authorization", f"Bearer {api_key}")
    try:
        with urllib.request.urlopen(req, timeout=30) as r:
            r.read()
        logger.warning("refit.sglang: the client that paused generation was lost; generation resumed")
    except Exception as e:  # nothing else can resume it: say so loudly
        logger.error("refit.sglang: the client that paused generation was lost, and resuming failed: %s", e)


def loader_problems(model: torch.nn.Module, names: list[str], dtype_names: list[str],
                    shapes: list[list[int]]) -> tuple[list[str], dict[str, list[str]]]:
    """The model's own ``load_weights`` on meta tensors of the update: returns the
    problems (empty: SGLang would load every tensor) and, per name, the parameters
    its loaders wrote. Every ``weight_loader`` runs on a meta copy of its parameter
    (shape checks included, no data); nothing of the model is written."""
    update = MetaUpdate(names, dtype_names, shapes)
    if update.problems:
        return update.problems, {}
    params = dict(model.named_parameters())
    touches: dict[str, list[str]] = {}
    problems: list[str] = []
    saved: dict[str, Any] = {}

    def recorder(pname: str, param: torch.Tensor, original: Any) -> Any:
        def record(_param: Any, loaded: torch.Tensor, *args: Any, **kwargs: Any) -> None:
            name = update.current or "?"
            touches.setdefault(name, []).append(pname)
            try:
                load = original if original is not _MISSING else _default_loader()
                load(_meta_twin(param), loaded, *args, **kwargs)
            except Exception as e:
                problems.append(f"{name}: shape {list(loaded.shape)} does not fit parameter {pname!r} "
                                f"{list(param.shape)} ({type(e).__name__}: {str(e)[:200]})")
        return record

    for pname, p in params.items():
        saved[pname] = p.__dict__.get("weight_loader", _MISSING)
        p.weight_loader = recorder(pname, p, saved[pname])
    try:
        refusal = update.run(model.load_weights)
    finally:
        for pname, p in params.items():
            if saved[pname] is _MISSING:
                del p.weight_loader
            else:
                p.weight_loader = saved[pname]
    if refusal is not None:
        problems.append(f"{update.current}: the model's load_weights raised {type(refusal).__name__}: "
                        f"{str(refusal)[:300]}")
    state = set(model.state_dict(keep_vars=True))  # tied aliases (lm_head.weight) included
    refused = {p.split(":", 1)[0] for p in problems}
    for name in unloaded(update, lambda n: n in touches or n in refused, state):
        problems.append(f"{name}: the model's loader takes it into no parameter (not a weight of the served "
                        "model)")
    return problems, touches


def _meta_twin(param: torch.Tensor) -> torch.nn.Parameter:
    """A meta copy of ``param`` with its attributes (the loader's own excepted)."""
    meta = torch.nn.Parameter(torch.empty_like(param, device="meta"), requires_grad=False)
    for k, v in vars(param).items():
        if k != "weight_loader":
            setattr(meta, k, v)
    return meta


def _default_loader() -> Any:
    try:
        from sglang.srt.model_loader.weight_utils import default_weight_loader

        return default_weight_loader
    except ImportError:  # the plain copy SGLang's default loader does
        def copy(param: torch.Tensor, loaded: torch.Tensor) -> None:
            param.data.copy_(loaded)

        return copy
