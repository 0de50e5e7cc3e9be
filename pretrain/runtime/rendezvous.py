"""The machines of a multi-node launch meet here first, where a signal and a timeout still work.

torchrun's static rendezvous (what `accelerate launch` runs for `num_machines > 1`) blocks inside
the C++ constructor of a TCPStore until every machine has connected: no line says who it waits
for, SIGTERM and SIGINT wait until the constructor returns (Python runs signal handlers only
between bytecodes), and the wait is torch's default of 900 s. A machine that was never started,
or a mistyped `main_process_ip`, looked like a hang that only `kill -9` ended.

So `omniloom launch` runs this small rendezvous of its own first, on the same address and port,
in Python, with short socket timeouts:

- machine_rank 0 listens on `main_process_port` (every interface, as the TCPStore will), says
  "waiting for 1 of 2 machines at ADDR:PORT (missing: machine_rank 1)" at once and every
  `REPORT_EVERY_S`, and tells every machine to go when all have checked in;
- every other machine connects to `main_process_ip:main_process_port` until it answers, says what
  it waits for the same way, checks in with its `num_machines` and `machine_rank` (a machine that
  disagrees is refused with the reason, on both sides), then waits for the go;
- past `timeout_s` each side ends with a RendezvousError naming the address, the port and the
  machines still missing; a signal ends the wait at once (the launcher's handler raises).

Then torchrun's own rendezvous runs on the same port, bounded by the same timeout (`rdzv_conf
timeout=`). Machine 0 stops listening before it sends the go, so a machine's torchrun never
reaches this listener by mistake; the others close first, so no port is left in TIME_WAIT on
machine 0.

Protocol (one line each): `omniloom-rendezvous/1 num_machines=N machine_rank=R host=H` from a
machine, then from machine 0 `ok`, `wait R1,R2` (still missing, when it reports), `go`, or
`error MESSAGE`. No torch here.
"""

from __future__ import annotations

import errno
import select
import socket
import sys
import time
from dataclasses import dataclass

DEFAULT_TIMEOUT_S = 300.0
TIMEOUT_ENV = "OMNILOOM_RDZV_TIMEOUT"
REPORT_EVERY_S = 15.0
_HELLO = "omniloom-rendezvous/1"
_POLL_S = 0.25


class RendezvousError(Exception):
    """The machines did not all meet: one line for the user, and the launcher's exit code
    (2: the machines' settings disagree; 1: one is missing or unreachable)."""

    def __init__(self, message: str, code: int = 1):
        super().__init__(message)
        self.code = code


@dataclass(frozen=True)
class Machines:
    """Where and how many: what every machine of one launch must agree on."""

    num_machines: int
    machine_rank: int
    main_process_ip: str
    main_process_port: int

    @property
    def where(self) -> str:
        host = f"[{self.main_process_ip}]" if ":" in self.main_process_ip else self.main_process_ip
        return f"{host}:{self.main_process_port}"


def _say(line: str) -> None:
    print(f"omniloom launch: {line}", file=sys.stderr, flush=True)


def _ranks(ranks) -> str:
    ranks = sorted(ranks)
    return f"machine_rank {ranks[0]}" if len(ranks) == 1 else "machine_ranks " + ", ".join(map(str, ranks))


def rendezvous(machines: Machines, timeout_s: float, *, report_every_s: float = REPORT_EVERY_S) -> None:
    """Return once every machine of the launch has checked in; RendezvousError past `timeout_s`."""
    if machines.machine_rank == 0:
        _Host(machines, timeout_s, report_every_s).run()
    else:
        _join(machines, timeout_s, report_every_s)


# -- machine_rank 0 -----------------------------------------------------------------------------
class _Host:
    def __init__(self, machines: Machines, timeout_s: float, report_every_s: float):
        self.m, self.timeout_s, self.report_every_s = machines, timeout_s, report_every_s
        self.joined: dict[int, tuple[socket.socket, str]] = {}
        self.start = time.monotonic()

    def missing(self) -> list[int]:
        return [r for r in range(1, self.m.num_machines) if r not in self.joined]

    def run(self) -> None:
        _warn_if_not_local(self.m.main_process_ip)
        server = self._listen()
        try:
            next_report = self.start
            while self.missing():
                now = time.monotonic()
                if now - self.start > self.timeout_s:
                    self._fail(RendezvousError(
                        f"{len(self.missing())} of {self.m.num_machines} machines did not join at {self.m.where} "
                        f"within {self.timeout_s:g} s (missing: {_ranks(self.missing())}): start them with the same "
                        "main_process_ip, main_process_port and num_machines, or give them longer with --rdzv_timeout"))
                if now >= next_report:
                    _say(f"waiting for {len(self.missing())} of {self.m.num_machines} machines at {self.m.where} "
                         f"(missing: {_ranks(self.missing())}; {now - self.start:.0f} s of {self.timeout_s:g} s)")
                    self._broadcast(f"wait {','.join(map(str, self.missing()))}")
                    next_report = now + self.report_every_s
                self._accept_one(server)
                self._drop_departed()
        finally:
            server.close()  # before the go: a machine's torchrun must never reach this listener
        self._broadcast("go")
        self._wait_closed()
        _say(f"all {self.m.num_machines} machines joined at {self.m.where} "
             f"after {time.monotonic() - self.start:.0f} s")

    def _listen(self) -> socket.socket:
        family = socket.AF_INET6 if socket.has_dualstack_ipv6() else socket.AF_INET
        try:
            server = socket.create_server(("", self.m.main_process_port), family=family,
                                          dualstack_ipv6=family == socket.AF_INET6, backlog=64)
        except OSError as err:
            if err.errno == errno.EADDRINUSE:
                raise RendezvousError(f"port {self.m.main_process_port} is in use on this machine (machine_rank 0; "
                                      "another run?): give every machine another --main_process_port", code=2) from err
            raise RendezvousError(f"cannot listen on port {self.m.main_process_port}: {err}", code=2) from err
        server.settimeout(_POLL_S)
        return server

    def _accept_one(self, server: socket.socket) -> None:
        try:
            conn, addr = server.accept()
        except socket.timeout:
            return
        conn.settimeout(5.0)
        try:
            hello = _read_line(conn)
        except OSError:
            conn.close()
            return
        fields = dict(f.split("=", 1) for f in hello.split()[1:] if "=" in f) if hello.startswith(_HELLO) else None
        try:
            rank, num = int(fields["machine_rank"]), int(fields["num_machines"])
        except (TypeError, KeyError, ValueError):
            conn.close()  # not one of ours (a port scanner, a stale torchrun): ignore it
            return
        host = fields.get("host", addr[0])
        if num != self.m.num_machines:
            self._refuse(conn, f"machine_rank {rank} on {host} has num_machines {num} and machine_rank 0 has "
                               f"{self.m.num_machines}: give every machine the same config")
        if not 0 < rank < self.m.num_machines:
            self._refuse(conn, f"{host} checked in as machine_rank {rank}, but with num_machines "
                               f"{self.m.num_machines} the others are 1..{self.m.num_machines - 1} (machine_rank 0 "
                               "is the one at main_process_ip)")
        if rank in self.joined:
            self._refuse(conn, f"two machines checked in as machine_rank {rank} ({self.joined[rank][1]} and "
                               f"{host}): give each machine its own --machine_rank")
        conn.settimeout(None)
        _send(conn, "ok")
        self.joined[rank] = (conn, host)

    def _drop_departed(self) -> None:
        """A machine that checked in and then went away (stopped, killed) is missing again."""
        conns = {conn: rank for rank, (conn, _) in self.joined.items()}
        if not conns:
            return
        readable, _, _ = select.select(list(conns), [], [], 0)
        for conn in readable:
            try:
                gone = conn.recv(1, socket.MSG_PEEK | socket.MSG_DONTWAIT) == b""
            except BlockingIOError:
                gone = False
            except OSError:
                gone = True
            if gone:
                rank = conns[conn]
                _say(f"machine_rank {rank} ({self.joined[rank][1]}) left before every machine joined")
                conn.close()
                del self.joined[rank]

    def _refuse(self, conn: socket.socket, message: str) -> None:
        _send(conn, f"error {message}")
        conn.close()
        self._fail(RendezvousError(message, code=2))

    def _fail(self, err: RendezvousError) -> None:
        self._broadcast(f"error machine_rank 0 stopped waiting: {err}")
        for conn, _ in self.joined.values():
            conn.close()
        raise err

    def _broadcast(self, line: str) -> None:
        for rank, (conn, _) in list(self.joined.items()):
            if not _send(conn, line):  # it left (stopped, killed): it is missing again
                conn.close()
                del self.joined[rank]

    def _wait_closed(self) -> None:
        """The others close first (so the port is not left in TIME_WAIT here); bounded."""
        deadline = time.monotonic() + 5.0
        for conn, _ in self.joined.values():
            try:
                conn.settimeout(max(0.1, deadline - time.monotonic()))
                while conn.recv(256):
                    pass
            except OSError:
                pass
            conn.close()


# -- every other machine ------------------------------------------------------------------------
def _join(m: Machines, timeout_s: float, report_every_s: float) -> None:
    start = time.monotonic()
    next_report = start
    conn = None
    while conn is None:
        now = time.monotonic()
        try:
            conn = socket.create_connection((m.main_process_ip, m.main_process_port),
                                            timeout=min(2.0, max(0.1, timeout_s - (now - start))))
            break
        except socket.gaierror as err:
            why = f"{m.main_process_ip} is not a known host: {err.strerror}"
        except OSError as err:
            why = err.strerror or type(err).__name__
        now = time.monotonic()
        if now - start > timeout_s:
            raise RendezvousError(
                f"machine_rank 0 did not answer at {m.where} within {timeout_s:g} s ({why}): check main_process_ip "
                f"and main_process_port (MASTER_ADDR, MASTER_PORT) and that machine_rank 0 was started, or give it "
                f"longer with --rdzv_timeout")
        if now >= next_report:
            _say(f"waiting for machine_rank 0 at {m.where} ({why}; {now - start:.0f} s of {timeout_s:g} s)")
            next_report = now + report_every_s
        time.sleep(_POLL_S)
    with conn:
        conn.settimeout(_POLL_S)
        why = "connected; machine_rank 0 has not answered yet"  # "joined" only once it says ok
        _send(conn, f"{_HELLO} num_machines={m.num_machines} machine_rank={m.machine_rank} "
                    f"host={socket.gethostname()}")
        buffer = b""
        while True:
            if time.monotonic() - start > timeout_s:
                raise RendezvousError(f"machine_rank {m.machine_rank} reached machine_rank 0 at {m.where}, but not every "
                                      f"machine had joined within {timeout_s:g} s ({why}); see machine_rank 0's output")
            try:
                chunk = conn.recv(4096)
            except socket.timeout:
                continue
            except OSError as err:  # a reset: machine_rank 0 stopped, or another program holds the port
                raise RendezvousError(f"machine_rank 0 at {m.where} dropped the connection before every machine joined "
                                      f"({err.strerror or type(err).__name__}; it was stopped, or it is another program "
                                      "on that port)") from None
            if not chunk:
                raise RendezvousError(f"machine_rank 0 at {m.where} closed the connection before every machine joined "
                                      "(it was stopped, or it is another program on that port)")
            buffer += chunk
            while b"\n" in buffer:
                raw, buffer = buffer.split(b"\n", 1)
                line = raw.decode(errors="replace").strip()
                if line == "go":
                    return
                if line == "ok":
                    why, next_report = "joined; waiting for the other machines", time.monotonic()
                if line.startswith("error "):
                    raise RendezvousError(line[6:], code=2 if "stopped waiting" not in line else 1)
                if line.startswith("wait ") and line[5:].replace(",", "").isdigit():
                    missing = _ranks(int(r) for r in line[5:].split(","))
                    why, now = f"joined; machine_rank 0 still waits for {missing}", time.monotonic()
                    if now >= next_report:
                        _say(f"joined machine_rank 0 at {m.where}; waiting for {missing} "
                             f"({now - start:.0f} s of {timeout_s:g} s)")
                        next_report = now + report_every_s


# -- helpers ------------------------------------------------------------------------------------
def _send(conn: socket.socket, line: str) -> bool:
    try:
        conn.sendall(line.encode() + b"\n")
        return True
    except OSError:
        return False


def _read_line(conn: socket.socket, limit: int = 4096) -> str:
    data = b""
    while b"\n" not in data and len(data) < limit:
        chunk = conn.recv(limit)
        if not chunk:
            break
        data += chunk
    return data.split(b"\n", 1)[0].decode(errors="replace").strip()


def _warn_if_not_local(ip: str) -> None:
    """machine_rank 0 runs on the machine at main_process_ip: say so when that address is not one of
    this machine's (a typo; behind NAT it can still be right, so only a warning)."""
    try:
        infos = socket.getaddrinfo(ip, None, type=socket.SOCK_STREAM)
    except socket.gaierror as err:
        _say(f"warning: main_process_ip {ip} is not a known host here ({err.strerror}); the other machines look "
             "for machine_rank 0 there")
        return
    for family, _, _, _, addr in infos:
        try:
            with socket.socket(family, socket.SOCK_STREAM) as probe:
                probe.bind((addr[0], 0))
            return
        except OSError:
            continue
    _say(f"warning: main_process_ip {ip} is not an address of this machine, where machine_rank 0 runs; the other "
         "machines look for it there (a typo? behind NAT this can be right)")


def timeout_from(flag: float | None, environ) -> float:
    """--rdzv_timeout, else OMNILOOM_RDZV_TIMEOUT, else DEFAULT_TIMEOUT_S (seconds, > 0)."""
    raw = flag if flag is not None else environ.get(TIMEOUT_ENV)
    if raw is None or raw == "":
        return DEFAULT_TIMEOUT_S
    try:
        value = float(raw)
    except ValueError:
        raise ValueError(f"{TIMEOUT_ENV}={raw!r}: give the rendezvous timeout in seconds, e.g. 300") from None
    if not value > 0:
        raise ValueError(f"--rdzv_timeout {raw}: the rendezvous timeout must be > 0 seconds")
    return value
