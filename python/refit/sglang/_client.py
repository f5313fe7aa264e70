"""The trainer side: :class:`Client`, refit's updates of a running SGLang server."""

from __future__ import annotations

import base64
import io
import json
import socket
import time
import urllib.error
import urllib.parse
import urllib.request
import uuid
from collections.abc import Iterable, Mapping
from typing import Any

import refit
from refit.integration import Options, TrainerLink, route_address

LOAD_FORMAT = "refit.sglang.load_weights"


class ServerError(refit.Error):
    """SGLang's HTTP server refused or failed a call; the message is its answer."""


class Client:
    """Moves a trainer's weights into a running SGLang server over refit's engines.

    The server runs with ``--custom-weight-loader refit.sglang.load_weights`` (and
    refit installed). :meth:`connect` has every tensor-parallel rank of the server
    start a refit worker host and connects a :class:`refit.WorkerGroup` to them with
    this client's :class:`refit.Sender`; :meth:`update` then

    1. has every rank check the update with the model's own loader, on meta
       tensors, before a byte moves (names it routes nowhere, shapes it refuses:
       :class:`refit.InvalidArgumentError` naming them);
    2. sends the bytes over refit's engine into a host buffer on every rank, not
       into the model (a failed or abandoned transfer leaves the model as it was);
    3. has every rank load what it received whole through the model's
       ``load_weights`` between two forward passes, with SGLang's
       ``weight_version`` set to ``version``; a rank whose load fails restores
       what it touched, and then every rank does and the version goes back.

    Every call to the server and every wait on a rank has a deadline,
    ``timeout_ms``. ``address``: where the ranks reach this trainer (default: the
    local address that routes to the server); ``listen_address``: where the ranks
    listen for refit (default: the server's host). ``trainer_args``: more of
    refit's ``Sender.prepare`` arguments (``buffer_bytes``, ``checksums``, ...).
    ``pause``: SGLang's ``/pause_generation`` mode around the apply (default
    ``"retract"``: running requests go back to the queue and resume on the new
    weights, so the cache the old ones made is flushed); None applies between two
    forward passes without pausing (SGLang then refuses to flush the cache while
    requests run, and the update fails and is rolled back). ``device``: where the
    sender reads the tensors (``"cuda:N"`` for the GPU engines, nccl and cuda_ipc,
    whose buckets land in each rank's GPU memory; written, not yet run on a GPU).
    ``options``: a :class:`refit.integration.Options` in place of ``engine``,
    ``timeout_ms``, ``auth_secret_file`` and ``device``, with refit's wire options
    (``buffer_bytes``, ``checksums``, ...). Bad values raise
    :class:`refit.InvalidArgumentError` here.
    """

    def __init__(
        self,
        url: str,
        *,
        engine: str = "tcp",
        timeout_ms: int = 60000,
        address: str | None = None,
        listen_address: str | None = None,
        auth_secret_file: str | None = None,
        api_key: str | None = None,
        trainer_args: Mapping[str, Any] | None = None,
        load_format: str = LOAD_FORMAT,
        pause: str | None = "retract",
        device: str = "cpu",
        options: Options | None = None,
    ) -> None:
        parsed = urllib.parse.urlparse(url)
        if parsed.scheme not in ("http", "https") or not parsed.hostname:
            raise refit.InvalidArgumentError(f"refit.sglang.Client: url: expected http://HOST:PORT, got {url!r}")
        if pause not in (None, "retract", "in_place", "abort"):
            raise refit.InvalidArgumentError(f"refit.sglang.Client: pause: expected None, 'retract', 'in_place' or "
                                             f"'abort' (SGLang's /pause_generation modes), got {pause!r}")
        self.options = options or Options(engine=engine, timeout_ms=timeout_ms, auth_secret_file=auth_secret_file,
                                          device=None if device == "cpu" else device, owner="refit.sglang.Client")
        self.pause = pause
        self.device = self.options.resolved_device()
        self.url = url.rstrip("/")
        self.engine, self.timeout_ms, self.load_format = self.options.engine, self.options.timeout_ms, load_format
        server_host = parsed.hostname
        self.listen_address = listen_address or ("127.0.0.1" if server_host in ("localhost", "::1") else server_host)
        self.address = address or route_address(self.listen_address)
        self.auth_secret_file, self.api_key = self.options.auth_secret_file, api_key
        self.trainer_args = dict(trainer_args or {})
        self.tp_size = 0
        self._link = TrainerLink(self.options, address=self.address)

    # ------------------------------------------------------------------ HTTP

    def _http(self, method: str, path: str, body: Any = None) -> Any:
        data = None if body is None else json.dumps(body).encode()
        req = urllib.request.Request(self.url + path, data=data, method=method,
                                     headers={"Content-Type": "application/json"})
        if self.api_key:
            req.add_header("Authorization", f"Bearer {self.api_key}")
        try:
            with urllib.request.urlopen(req, timeout=self.timeout_ms / 1000) as r:
                text = r.read().decode()
        except urllib.error.HTTPError as e:
            raise ServerError(f"{path}: HTTP {e.code}: {e.read().decode(errors='replace')[:2000]}") from None
        except (urllib.error.URLError, OSError) as e:
            reason = getattr(e, "reason", e)
            if isinstance(reason, (TimeoutError, socket.timeout)):
                raise refit.TimeoutError(f"{self.url}{path}: no answer within {self.timeout_ms} ms") from None
            raise refit.PeerLostError(f"{self.url}{path}: {reason}") from None
        try:
            return json.loads(text) if text else None
        except ValueError:
            return text

    def server_info(self) -> dict:
        """SGLang's ``/server_info`` (``weight_version``, ``tp_size``, ...)."""
        try:
            return self._http("GET", "/server_info")
        except ServerError:
            return self._http("GET", "/get_server_info")

    def weight_version(self) -> str | None:
        """The ``weight_version`` the server's answers carry now: ``/model_info``'s
        (``/server_info`` reports the startup setting, not the live version, so a
        rollback that read it set the server back to "default")."""
        try:
            info = self._http("GET", "/model_info")
        except ServerError:
            info = None
        if isinstance(info, dict) and "weight_version" in info:
            return info["weight_version"]
        return self.server_info().get("weight_version")

    def _ticket(self, op: str, *, weight_version: str | None = None, flush_cache: bool = False,
                tid: str | None = None, **fields: Any) -> str:
        """One ticket through ``/update_weights_from_tensor`` (inside SGLang's
        begin/end weight-update session); returns its id."""
        from multiprocessing.reduction import ForkingPickler

        import torch
        import torch.multiprocessing  # noqa: F401  (torch's reductions: an empty tensor pickles as such)

        tid = tid or uuid.uuid4().hex
        name = "refit:" + json.dumps({"op": op, "id": tid, **fields})
        buf = io.BytesIO()
        ForkingPickler(buf).dump([(name, torch.empty(0))])
        payload = base64.b64encode(buf.getvalue()).decode()
        body = {"serialized_named_tensors": [payload] * max(1, self.tp_size), "load_format": self.load_format,
                "flush_cache": flush_cache}
        if weight_version is not None:
            body["weight_version"] = weight_version
        try:
            self._http("POST", "/begin_weight_update", {})
        except ServerError as e:
            if "already open" not in str(e):
                raise
            # A session a lost trainer left open: closed, then ours.
            self._http("POST", "/end_weight_update", {})
            self._http("POST", "/begin_weight_update", {})
        try:
            self._http("POST", "/update_weights_from_tensor", body)
        finally:
            self._http("POST", "/end_weight_update", {})
        return tid

    def _outcomes(self, tid: str, what: str) -> list[dict]:
        answers = self._group.call_all("refit_sglang_outcome", {"ticket": tid})
        outcomes = []
        for rank, a in enumerate(answers):
            out = (a or {}).get("outcome")
            if out is None:
                raise refit.ProtocolError(f"refit.sglang: {what}: tp rank {rank} did not run it (is "
                                          f"{self.load_format} in the server's --custom-weight-loader?)")
            outcomes.append(out)
        return outcomes

    # ------------------------------------------------------------------ refit

    def connect(self) -> list[tuple[str, int]]:
        """Every rank's refit host, connected and initialized; returns their
        endpoints. Called again, it reconnects (a restarted server)."""
        self.close()
        info = self.server_info()
        self.tp_size = int(info.get("tp_size") or 1)
        deadline = time.monotonic() + self.timeout_ms / 1000
        with socket.create_server((self.address, 0), backlog=max(64, self.tp_size)) as reg:
            port = reg.getsockname()[1]
            self._ticket("connect", engine=self.engine, address=self.listen_address, timeout_ms=self.timeout_ms,
                         auth_secret_file=self.auth_secret_file, register=f"{self.address}:{port}")
            ranks: dict[int, tuple[str, int]] = {}
            while len(ranks) < self.tp_size:
                left = deadline - time.monotonic()
                if left <= 0:
                    missing = sorted(set(range(self.tp_size)) - ranks.keys())
                    raise refit.TimeoutError(f"refit.sglang: tp ranks {missing} of {self.url} did not say where they "
                                             f"listen within {self.timeout_ms} ms (is refit installed in the server, "
                                             f"and {self.load_format} in its --custom-weight-loader?)")
                reg.settimeout(left)
                try:
                    conn, _ = reg.accept()
                except TimeoutError:
                    continue
                with conn:
                    conn.settimeout(max(0.1, deadline - time.monotonic()))
                    me = json.loads(conn.makefile().readline())
                ranks[int(me["tp_rank"])] = (me["address"], int(me["port"]))
        endpoints = [ranks[r] for r in range(self.tp_size)]
        self._link.open(endpoints, **self.trainer_args)
        return endpoints

    def update(self, tensors: Mapping[str, Any] | Iterable[tuple[str, Any]], version: int) -> dict:
        """One update of the server to ``version`` (module docstring: the steps).
        Returns {"version", "seconds", "check_s", "transfer_s", "apply_s"}."""
        if not self._link.is_open:
            self.connect()
        items = list(tensors.items()) if isinstance(tensors, Mapping) else list(tensors)
        items = [(n, t.detach().to(self.device).contiguous()) for n, t in items]
        t0 = time.monotonic()
        tid = self._ticket("check", update_info=refit.describe(items))
        problems = [f"tp rank {o['tp_rank']}: {o.get('error')}" for o in self._outcomes(tid, "check") if not o["ok"]]
        if problems:
            raise refit.InvalidArgumentError("refit.sglang: the served model's loader refuses the update, nothing "
                                             "was sent: " + "; ".join(problems))
        t1 = time.monotonic()
        self._group.update(self._sender, items, int(version), verify=False)
        t2 = time.monotonic()
        old = self.weight_version()
        # Generation paused (running requests retracted, so the cache the old
        # weights made can be flushed), the apply, and generation resumed.
        if self.pause:
            # Every rank resumes generation itself if this client is lost before
            # it does (the guard's deadline: this client's).
            self._group.call_all("refit_sglang_guard", {"arm": True, "ms": self.timeout_ms, "url": self.url,
                                                        "api_key": self.api_key})
            self._http("POST", "/pause_generation", {"mode": self.pause})
        try:
            tid = uuid.uuid4().hex
            try:
                self._ticket("apply", tid=tid, version=int(version), weight_version=str(version), flush_cache=True)
                failed = [f"tp rank {o['tp_rank']}: {o.get('error')}" for o in self._outcomes(tid, "apply")
                          if not o["ok"]]
            except refit.Error as e:  # the call failed: whatever a rank applied goes back
                failed = [str(e)]
            if failed:
                # Every rank back to what it served, and the version with it.
                self._ticket("rollback", weight_version=old, flush_cache=True)
                raise refit.Error(f"refit.sglang: update {version} not applied (every rank restored, "
                                  f"weight_version {old!r}): " + "; ".join(failed))
        finally:
            if self.pause:
                self._http("POST", "/continue_generation", {})
                self._group.call_all("refit_sglang_guard", {"arm": False})
        t3 = time.monotonic()
        return {"version": int(version), "seconds": t3 - t0, "check_s": t1 - t0, "transfer_s": t2 - t1,
                "apply_s": t3 - t2}

    def close(self) -> None:
        """Closes refit's connections (the ranks' hosts stay for the next client)."""
        self._link.close()

    @property
    def _group(self) -> refit.WorkerGroup:
        assert self._link.group is not None, "refit.sglang.Client: not connected"
        return self._link.group

    @property
    def _sender(self) -> refit.Sender:
        assert self._link.sender is not None, "refit.sglang.Client: not connected"
        return self._link.sender

    def __enter__(self) -> Client:
        return self

    def __exit__(self, *exc: Any) -> None:
        self.close()
