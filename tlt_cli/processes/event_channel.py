"""The event channel from launched ranks to the driver: authenticated TCP, across nodes.

Workers report to the driver with `put(event)` (step reports, a failure, a finish; see
tlt_cli/training/worker_loop.py) and the driver reads with `get(timeout)`, which raises `queue.Empty` when nothing
came. Workers the driver spawns on its own machine use a multiprocessing queue, which offers
exactly these two calls (local_workers.py). Ranks the DeepSpeed launcher starts may
run on other nodes, so for them the driver opens an `EventListener`, a TCP socket of
`multiprocessing.connection` authenticated with a secret of the run (no other process can make
the driver unpickle its data), and each rank connects with `connect_to_driver`.

The connection also carries the driver's life: a rank whose driver exited or closed the channel
(the run failed, `tlt train` was killed) exits at once instead of training on for nobody.

Anything may connect to the port (a port scan, a stray client), so the driver never lets one
connection hold up another: the accept loop only accepts; each connection's HMAC handshake runs
in a thread of its own under a deadline (HANDSHAKE_SECONDS), and a peer that closes, stays silent
or fails the handshake is dropped and reported to `on_rejected` (the launcher's log). A rank
retries its connection until CONNECT_SECONDS have passed, each attempt under its own deadline,
then stops with one sentence naming the address.
"""

from __future__ import annotations

import os
import queue
import socket
import threading
import time
from collections.abc import Callable
from multiprocessing import AuthenticationError
from multiprocessing.connection import Connection, Listener, answer_challenge, deliver_challenge
from typing import Any

# exit status of a rank that lost its driver
DRIVER_GONE_EXIT_CODE = 1
# seconds a new connection has to complete the handshake, on either side
HANDSHAKE_SECONDS = 10.0
# seconds a rank keeps trying to reach the driver (its launcher started after the driver listened,
# so this covers a slow network or a driver busy accepting, not a driver that is not there)
CONNECT_SECONDS = 120.0
RETRY_SECONDS = 1.0
# connections the kernel queues before the accept loop takes them (every rank connects at start-up)
LISTEN_BACKLOG = 128


class DriverUnreachable(ConnectionError):
    """A rank could not connect to the driver's event channel; the message names the address."""


class EventListener:
    """The driver's end: accepts every rank's connection and queues what they send, in arrival order."""

    def __init__(self, host: str, authkey: bytes, on_rejected: Callable[[str], None] = lambda line: None):
        """Listen on `host` only (an ephemeral port); on_rejected gets one line per dropped connection."""
        # no authkey here: Listener.accept would run the handshake in the accept loop, where one silent
        # peer blocks every rank behind it; each connection's handshake runs in its own thread instead
        self.listener = Listener((host, 0), backlog=LISTEN_BACKLOG)
        self.authkey, self.on_rejected = authkey, on_rejected
        self.inbox: queue.Queue[Any] = queue.Queue()
        self.connections: list[Connection] = []
        self.readers: list[threading.Thread] = []
        self.closed = threading.Event()
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
        self.closed.set()
        self.listener.close()
        for connection in self.connections:
            _shut_down(connection)

    def _accept(self) -> None:
        while True:
            try:
                connection = self.listener.accept()
            except OSError:
                return  # the listener was closed
            peer = self.listener.last_accepted
            threading.Thread(
                target=self._admit, args=(connection, peer), name="tlt-event-handshake", daemon=True
            ).start()

    def _admit(self, connection: Connection, peer: Any) -> None:
        """Run the handshake of one connection; a rank of this run is read from, anything else dropped."""
        try:
            _handshake(
                connection,
                lambda: (deliver_challenge(connection, self.authkey), answer_challenge(connection, self.authkey)),
            )
        except (AuthenticationError, EOFError, OSError, TimeoutError) as error:
            _shut_down(connection)
            self.on_rejected(f"event channel: dropped a connection from {_address(peer)}: {_why(error)}")
            return
        if self.closed.is_set():  # the run ended during the handshake
            _shut_down(connection)
            return
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


def connect_to_driver(
    host: str, port: int, authkey: bytes, deadline_seconds: float = CONNECT_SECONDS
) -> DriverConnection:
    """Connect this rank to the driver's EventListener, retrying for deadline_seconds; DriverUnreachable then.

    A wrong secret is not retried: it will not get right.
    """
    deadline = time.monotonic() + deadline_seconds
    while True:
        try:
            return DriverConnection(_connect(host, port, authkey))
        except AuthenticationError as error:
            last_error: BaseException = error
            break
        except (EOFError, OSError, TimeoutError) as error:
            last_error = error
        if time.monotonic() + RETRY_SECONDS > deadline:
            break
        time.sleep(RETRY_SECONDS)
    raise DriverUnreachable(
        f"cannot reach the tlt train driver's event channel at {host}:{port} within {deadline_seconds:g} s "
        f"({_why(last_error)}); every node must reach the machine running tlt train on that port."
    )


def _connect(host: str, port: int, authkey: bytes) -> Connection:
    """One attempt: connect and answer the handshake, each step within HANDSHAKE_SECONDS."""
    with socket.create_connection((host, port), timeout=HANDSHAKE_SECONDS) as plain:
        plain.settimeout(None)  # a Connection reads its descriptor in blocking mode; _handshake bounds it
        connection = Connection(plain.detach())
    try:
        _handshake(connection, lambda: (answer_challenge(connection, authkey), deliver_challenge(connection, authkey)))
    except BaseException:
        connection.close()
        raise
    return connection


def _handshake(connection: Connection, exchange: Callable[[], Any]) -> None:
    """Run `exchange` (the HMAC challenge both ways) on `connection`; TimeoutError if it takes HANDSHAKE_SECONDS.

    A Connection has no timeout of its own: a watchdog shuts its socket down at the deadline, which
    ends a read blocked on a silent peer.
    """
    expired = threading.Event()

    def expire() -> None:
        expired.set()
        _shut_down_socket(connection)

    watchdog = threading.Timer(HANDSHAKE_SECONDS, expire)
    watchdog.daemon = True
    watchdog.start()
    try:
        exchange()
    except (EOFError, OSError) as error:
        if expired.is_set():
            raise TimeoutError(f"no handshake within {HANDSHAKE_SECONDS:g} s") from error
        raise
    finally:
        watchdog.cancel()
    if expired.is_set():
        raise TimeoutError(f"no handshake within {HANDSHAKE_SECONDS:g} s")


def _address(peer: Any) -> str:
    return f"{peer[0]}:{peer[1]}" if isinstance(peer, tuple) and len(peer) >= 2 else str(peer)


def _why(error: BaseException) -> str:
    """A short reason for a failed connection: the error's words, or what its type means."""
    if isinstance(error, EOFError):
        return "it closed before the handshake"
    if isinstance(error, AuthenticationError):
        return "it failed the handshake (not a rank of this run)"
    return str(error) or type(error).__name__


def _shut_down(connection: Connection) -> None:
    """Shut the socket down (waking a thread blocked reading it, which close alone does not), then close it."""
    _shut_down_socket(connection)
    connection.close()


def _shut_down_socket(connection: Connection) -> None:
    try:
        with socket.socket(fileno=os.dup(connection.fileno())) as duplicate:
            duplicate.shutdown(socket.SHUT_RDWR)
    except OSError:
        pass  # already closed or reset by the other end
