"""The event channel from launched ranks to the driver: authenticated TCP, across nodes.

Workers report to the driver with `put(event)` (step reports, a failure, a finish; see
tlt_cli/worker.py) and the driver reads with `get(timeout)`, which raises `queue.Empty` when nothing
came. Workers the driver spawns on its own machine use a multiprocessing queue, which offers
exactly these two calls (local_workers.py). Ranks the DeepSpeed launcher starts may
run on other nodes, so for them the driver opens an `EventListener`, a TCP socket of
`multiprocessing.connection` authenticated with a secret of the run (no other process can make
the driver unpickle its data), and each rank connects with `connect_to_driver`.

The connection also carries the driver's life: a rank whose driver exited or closed the channel
(the run failed, `tlt train` was killed) exits at once instead of training on for nobody.
"""

from __future__ import annotations

import os
import queue
import socket
import threading
from multiprocessing import AuthenticationError
from multiprocessing.connection import Client, Connection, Listener
from typing import Any

# exit status of a rank that lost its driver
DRIVER_GONE_EXIT_CODE = 1


class DriverUnreachable(ConnectionError):
    """A rank could not connect to the driver's event channel; the message names the address."""


class EventListener:
    """The driver's end: accepts every rank's connection and queues what they send, in arrival order."""

    def __init__(self, host: str, authkey: bytes):
        self.listener = Listener((host, 0), authkey=authkey)
        self.inbox: queue.Queue[Any] = queue.Queue()
        self.connections: list[Connection] = []
        self.readers: list[threading.Thread] = []
        threading.Thread(target=self._accept, name="tlt-event-accept", daemon=True).start()

    @property
    def port(self) -> int:
        return self.listener.address[1]

    def get(self, timeout: float) -> Any:
        """The next event; queue.Empty after `timeout` seconds without one."""
        return self.inbox.get(timeout=timeout)

    def pending(self) -> bool:
        """Whether events are queued that `get` has not returned yet."""
        return not self.inbox.empty()

    def wait_for_senders(self, timeout: float) -> None:
        """Wait (at most `timeout` s) until every connected rank has closed its end, so all it sent is queued."""
        for reader in list(self.readers):
            reader.join(timeout)

    def close(self) -> None:
        """Stop accepting and drop every connection: ranks still running see their driver gone and exit."""
        self.listener.close()
        for connection in self.connections:
            _shut_down(connection)

    def _accept(self) -> None:
        while True:
            try:
                connection = self.listener.accept()
            except AuthenticationError:
                continue  # not one of this run's ranks
            except OSError:
                return  # the listener was closed
            self.connections.append(connection)
            reader = threading.Thread(target=self._read, args=(connection,), name="tlt-event-read", daemon=True)
            self.readers.append(reader)
            reader.start()

    def _read(self, connection: Connection) -> None:
        while True:
            try:
                self.inbox.put(connection.recv())
            except (EOFError, OSError):
                return


class DriverConnection:
    """A rank's end: `put` sends one event; losing the driver ends the process."""

    def __init__(self, connection: Connection):
        self.connection = connection
        self.closing = threading.Event()
        threading.Thread(target=self._exit_when_driver_gone, name="tlt-driver-watch", daemon=True).start()

    def put(self, event: Any) -> None:
        self.connection.send(event)

    def close(self) -> None:
        """This rank is done: close its end (the driver then knows everything it sent has arrived)."""
        self.closing.set()
        _shut_down(self.connection)

    def _exit_when_driver_gone(self) -> None:
        # the driver never sends: recv returns only by failing, when the driver's end is closed
        try:
            self.connection.recv()
        except (EOFError, OSError):
            pass
        if not self.closing.is_set():
            os._exit(DRIVER_GONE_EXIT_CODE)


def connect_to_driver(host: str, port: int, authkey: bytes) -> DriverConnection:
    """Connect this rank to the driver's EventListener; DriverUnreachable names the address on failure."""
    try:
        return DriverConnection(Client((host, port), authkey=authkey))
    except (OSError, AuthenticationError) as error:
        raise DriverUnreachable(
            f"cannot reach the tlt train driver's event channel at {host}:{port} ({error}); "
            "every node must reach the machine running tlt train on that port."
        ) from None


def _shut_down(connection: Connection) -> None:
    """Shut the socket down (waking a thread blocked reading it, which close alone does not), then close it."""
    try:
        with socket.socket(fileno=os.dup(connection.fileno())) as duplicate:
            duplicate.shutdown(socket.SHUT_RDWR)
    except OSError:
        pass  # already closed or reset by the other end
    connection.close()
