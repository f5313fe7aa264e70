""":class:`TrainerLink`: a trainer's connections to the workers of one topology."""

from __future__ import annotations

import socket
from collections.abc import Hashable, Iterable
from typing import Any

from .._group import WorkerGroup
from .._sender import Sender
from ._options import Options


def route_address(peer: str | None = None) -> str:
    """This machine's address on the route to ``peer`` (no packet is sent); with no
    peer, the address of its default route: where peers reach this host. The
    loopback address when there is no route."""
    try:
        with socket.socket(socket.AF_INET, socket.SOCK_DGRAM) as s:
            s.connect((peer or "10.255.255.255", 1))
            return s.getsockname()[0]
    except OSError:
        return "127.0.0.1"


class TrainerLink:
    """A trainer's :class:`refit.WorkerGroup` and :class:`refit.Sender` to a set of
    workers, connected and initialized once and kept while the topology's ``key``
    is unchanged (no process came or went): :meth:`open` with the same key is free.

    ``address`` is where the workers reach the trainer (default: this host's
    address on the route to the first worker); ``options`` give the engine, the
    deadlines, the secret and the wire options (:meth:`Options.trainer_args`).
    """

    def __init__(self, options: Options, *, address: str | None = None) -> None:
        self.options = options
        self.address = address
        self.key: Hashable = None
        self.group: WorkerGroup | None = None
        self.sender: Sender | None = None
        self.connects = 0  # topologies connected (one while no process came or went)

    @property
    def is_open(self) -> bool:
        return self.group is not None

    def open(self, endpoints: Iterable[tuple[str, int]], key: Hashable = None, **trainer_args: Any) -> bool:
        """Connects and initializes every worker at ``endpoints`` (in rank order)
        unless the link is open at ``key`` already; True when it (re)connected. A
        failure closes whatever it opened and raises refit's error."""
        endpoints = list(endpoints)
        if self.is_open and key is not None and key == self.key:
            return False
        self.close()
        opts = self.options
        address = self.address or route_address(endpoints[0][0] if endpoints else None)
        group = WorkerGroup([f"{a}:{p}" for a, p in endpoints], timeout_ms=opts.timeout_ms,
                            auth_secret_file=opts.auth_secret_file)
        sender = Sender(opts.engine, device=opts.resolved_device(), timeout_ms=opts.timeout_ms,
                        auth_secret_file=opts.auth_secret_file)
        try:
            group.connect()
            group.init(sender, opts.trainer_args(address, **trainer_args))
        except BaseException:
            group.close()
            sender.shutdown()
            raise
        self.group, self.sender, self.key = group, sender, key
        self.connects += 1
        return True

    def close(self) -> None:
        """Closes the connections (the workers keep serving); idempotent."""
        if self.group is not None:
            self.group.close()
        if self.sender is not None:
            self.sender.shutdown()
        self.group = self.sender = None
        self.key = None
