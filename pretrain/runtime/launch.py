"""`omniloom launch`: `accelerate launch` with the exit codes and signals a scheduler relies on.

    omniloom launch --config_file cpu_2proc -m omniloom.pretrain.train \
        --config tiny --run-dir runs/t1 ...            # every `accelerate launch` option works

`--config_file` takes a file, or the name of a config shipped in configs/accelerate/ (`cpu_2proc`,
`fsdp2`, ...; `configs/accelerate/NAME.yaml` also finds it from any folder); a name that is
neither is one line naming the shipped ones, exit 2.

It runs accelerate's launcher in this process and changes these things:

- Several machines (`num_machines > 1`; configs/accelerate/multi_node.yaml fills its `${VAR}`
  placeholders from the environment: MASTER_ADDR, MASTER_PORT, NUM_MACHINES, NUM_PROCESSES,
  MACHINE_RANK) first meet on main_process_ip:main_process_port, saying which machines they wait
  for; past `--rdzv_timeout SECONDS` (OMNILOOM_RDZV_TIMEOUT, default 300) one line names the missing
  ones and the launch exits 1, and a signal ends the wait at once. Settings the machines must agree
  on (num_processes a multiple of num_machines, machine_rank in range, one address) are checked
  first: one line, exit 2. A signal while torch's own rendezvous then waits in C++, where Python
  runs no handler, still ends the launch within seconds. On one machine, a launch that names no
  port gets a free one.
- SIGTERM / SIGINT (Slurm preemption, `kill`, Ctrl-C): the first one is passed to every rank as
  SIGTERM; the ranks finish their step, save a checkpoint together and exit 0, and so does the
  launcher. torchrun's agent would instead raise `SignalException`, give the ranks
  TORCH_ELASTIC_SHUTDOWN_TIMEOUT (30 s) and exit 1 with a traceback. A second signal to the
  launcher kills the ranks at once (exit 128 + signal number).
- A user error in the ranks (exit 2: bad config, bad data, an unsafe checkpoint) is printed once,
  as one line, and the launcher exits 2 (3 for a run stopped by non-finite losses), instead of a
  line per rank and torchrun's traceback.
- Any other failure of a rank (its own traceback is above) ends the launcher with exit 1 and one
  line naming the rank, its exit code or signal.

The ranks learn they run under it from OMNILOOM_LAUNCHED (a repeated signal is the same stop, not
a hard one) and OMNILOOM_LAUNCH_ERRORS (where `omniloom.pretrain.train` leaves its one line). A
rank stops (saving, with the others) when the launcher dies, SIGKILL included: pretrain/runtime/lifeline.py.
"""

from __future__ import annotations

import argparse
import logging
import os
import signal
import sys
import tempfile
import threading
import time
from pathlib import Path

from . import machines, rendezvous
from .lifeline import LAUNCHER_PID_ENV

log = logging.getLogger("omniloom.launch")

_GRACEFUL = (signal.SIGTERM, signal.SIGINT)


def register(sub) -> None:
    p = sub.add_parser(
        "launch",
        help="accelerate launch with clean exits: SIGTERM -> checkpoint + exit 0, user errors -> one line + exit 2",
        description="Run `accelerate launch` with the same arguments, in this process, for several processes "
        "or machines. SIGTERM/SIGINT make every rank finish its step, save a checkpoint and exit 0 (a second "
        "signal kills the ranks); a user error in the ranks prints one line once and exits 2. Example: "
        "omniloom launch --config_file cpu_2proc -m omniloom.pretrain.train "
        "--config tiny --run-dir runs/t1 data.sources='[{path: shards/train}]' data.tokenizer=tok. "
        "--config_file takes a file or a shipped config's name (cpu_2proc, fsdp2, multi_gpu, ...).",
        add_help=False,
        prefix_chars="+",  # every option belongs to accelerate launch; nothing is parsed here
    )
    p.add_argument("accelerate_args", nargs=argparse.REMAINDER,
                   help="`accelerate launch` options, then the script or -m module and its arguments")
    p.set_defaults(func=_launch_cli)


def _launch_cli(args) -> int:
    argv = list(args.accelerate_args)
    if not argv or argv[0] in ("-h", "--help"):
        print("usage: omniloom launch [accelerate launch options] (SCRIPT | -m MODULE) [ARGS ...]\n\n"
              "Every `accelerate launch` option works (`accelerate launch --help` lists them).\n")
        print(__doc__.split("\n\n", 2)[2].strip())
        return 0 if argv else 2
    verbose = bool(getattr(args, "verbose", 0))
    return launch(argv, quiet_agent=not verbose, verbose=verbose)


class _Stopped(Exception):
    """A signal reached the launcher before any rank was running."""

    def __init__(self, sigval: int):
        super().__init__(f"stopped by {signal.Signals(sigval).name} before the ranks started")
        self.sigval = sigval


class _Forwarder:
    """The launcher's SIGTERM/SIGINT handling: the first signal goes on to the ranks as SIGTERM,
    a second one kills them. Installed for accelerate's single-process launcher directly and put
    in place of torchrun's `_terminate_process_handler` for its agent."""

    def __init__(self):
        self.received: list[int] = []
        self.killed = False
        self._contexts: list = []

    # -- which processes are the ranks ------------------------------------------------------
    def ranks(self) -> list[int]:
        pids = set()
        for ctx in self._contexts:  # torchrun: the agent's process context knows its ranks
            try:
                pids.update(int(p) for p in ctx.pids().values())
            except Exception:  # a context already closed
                pass
        try:  # accelerate's single-process launcher: our own children
            for task in Path("/proc/self/task").iterdir():
                pids.update(int(c) for c in (task / "children").read_text().split())
        except OSError:
            pass
        return sorted(pids)

    def _send(self, sig: int, group: bool) -> None:
        for pid in self.ranks():
            try:
                # torchrun starts each rank in its own session: the group is the rank and its loader workers
                if group and os.getpgid(pid) == pid:
                    os.killpg(pid, sig)
                else:
                    os.kill(pid, sig)
            except (ProcessLookupError, PermissionError):
                pass

    # -- the handler ----------------------------------------------------------------------------
    def handle(self, signum: int, frame) -> None:
        self.received.append(signum)
        name = signal.Signals(signum).name
        if len(self.received) == 1 and not self.ranks():
            # nothing started yet, so nothing to save: stop the launch itself (torchrun's agent
            # then shuts down whatever it was starting)
            raise _Stopped(signum)
        if len(self.received) == 1:
            print(f"omniloom launch: {name}: every rank finishes its step and saves a checkpoint "
                  f"(send it again to stop at once)", file=sys.stderr, flush=True)
            self._send(signal.SIGTERM, group=False)
        else:
            print(f"omniloom launch: second {name}: killing the ranks without a checkpoint", file=sys.stderr, flush=True)
            self.killed = True
            self._send(signal.SIGKILL, group=True)

    # -- a signal the main thread cannot see ---------------------------------------------------
    def _watch_wakeups(self, read_fd: int, grace_s: float) -> None:
        """Python runs a signal handler only between bytecodes: while the main thread waits in C++
        (torchrun's TCPStore constructor waits for every machine, up to the rendezvous timeout) a
        SIGTERM or SIGINT would sit unhandled. The interpreter's C handler writes each signal's
        number to the wakeup fd at once; when the Python handler has not run `grace_s` later and no
        rank was started, nothing needs saving: end the launch here, as the handler would have."""
        delivered = 0
        while True:
            try:
                data = os.read(read_fd, 64)
            except OSError:
                return
            if not data:
                return
            for sig in data:
                if sig not in _GRACEFUL:
                    continue
                delivered += 1
                deadline = time.monotonic() + grace_s
                while len(self.received) < delivered and time.monotonic() < deadline:
                    time.sleep(0.05)
                if len(self.received) >= delivered or self.ranks():
                    delivered = len(self.received)
                    continue
                print(f"omniloom launch: stopped by {signal.Signals(sig).name} while torch's rendezvous was waiting for "
                      "the other machines; no checkpoint was written", file=sys.stderr, flush=True)
                os._exit(128 + sig)

    def _arm_watchdog(self, grace_s: float = 3.0) -> None:
        try:
            read_fd, write_fd = os.pipe()
            os.set_blocking(write_fd, False)
            self._old_wakeup = signal.set_wakeup_fd(write_fd, warn_on_full_buffer=False)
        except (ValueError, OSError):  # not the main thread: no signals to watch here
            return
        self._wakeup = (read_fd, write_fd)
        threading.Thread(target=self._watch_wakeups, args=(read_fd, grace_s), name="omniloom-launch-signals",
                         daemon=True).start()

    def install(self):
        """Our handler now (single-process launcher) and in place of torchrun's (its agent
        registers `_terminate_process_handler` by name when it starts the ranks)."""
        self._previous = {sig: signal.signal(sig, self.handle) for sig in _GRACEFUL}
        self._arm_watchdog()
        try:
            from torch.distributed.elastic.multiprocessing import api as mp_api
        except ImportError:
            return self
        if not (hasattr(mp_api, "_terminate_process_handler") and hasattr(mp_api, "PContext")):
            log.warning("this torch has no torchrun signal handler to replace: SIGTERM gets torchrun's own handling")
            return self
        self._mp_api = mp_api
        self._orig_handler = mp_api._terminate_process_handler
        self._orig_start = mp_api.PContext.start
        forwarder = self

        def terminate_handler(signum, frame):
            if signum in _GRACEFUL:
                return forwarder.handle(signum, frame)
            return forwarder._orig_handler(signum, frame)  # SIGHUP/SIGQUIT: torchrun's own shutdown

        def start(ctx):
            forwarder._contexts.append(ctx)
            return forwarder._orig_start(ctx)

        mp_api._terminate_process_handler = terminate_handler
        mp_api.PContext.start = start
        return self

    def uninstall(self) -> None:
        for sig, handler in getattr(self, "_previous", {}).items():
            signal.signal(sig, handler)
        if hasattr(self, "_wakeup"):
            signal.set_wakeup_fd(self._old_wakeup)
            os.close(self._wakeup[1])  # the watching thread reads EOF and ends
            del self._wakeup
        if hasattr(self, "_mp_api"):
            self._mp_api._terminate_process_handler = self._orig_handler
            self._mp_api.PContext.start = self._orig_start


def _rank_reports(folder: str) -> dict[int, tuple[int, str]]:
    out = {}
    for f in sorted(Path(folder).glob("rank*.txt")):
        try:
            code, line = f.read_text().split("\n", 1)
            out[int(f.stem[4:])] = (int(code), line.strip())
        except (OSError, ValueError):
            continue
    return out


def _exit_codes(err: BaseException) -> dict[int, int]:
    """Rank -> exit code (negative: killed by that signal) from the launcher's exception."""
    import subprocess

    failures = getattr(err, "failures", None)
    if failures:
        return {int(rank): int(f.exitcode) for rank, f in failures.items()}
    if isinstance(err, subprocess.CalledProcessError):
        return {0: int(err.returncode)}
    return {}


def _summarise(err: BaseException, reports: dict[int, tuple[int, str]], forwarder: _Forwarder, *,
               verbose: bool = False) -> int:
    """Print one line for a failed launch and return the launcher's exit code (`verbose`: with the
    traceback of a launcher failure above it)."""
    if forwarder.killed:
        sig = forwarder.received[-1]
        print(f"omniloom launch: ranks killed by a second {signal.Signals(sig).name}; "
              "resume from the last complete checkpoint", file=sys.stderr)
        return 128 + sig
    if getattr(err, "sigval", None) is not None:  # before the ranks started, or SIGHUP/SIGQUIT (torchrun's shutdown)
        sig = int(err.sigval)
        print(f"omniloom launch: stopped by {signal.Signals(sig).name} "
              f"{'before the ranks started' if isinstance(err, _Stopped) else 'and the ranks were shut down'}; "
              "no checkpoint was written", file=sys.stderr)
        return 128 + sig
    if reports:  # a rank said why: bad config, bad data, an unsafe checkpoint, non-finite losses
        rank = min(reports)
        code, line = reports[rank]
        print(line, file=sys.stderr)
        return code
    codes = _exit_codes(err)
    if not codes:
        if verbose:
            import traceback

            traceback.print_exception(err, file=sys.stderr)
        detail = str(err).strip().splitlines()[0] if str(err).strip() else ""
        print(f"omniloom launch: the launcher failed: {type(err).__name__}{': ' + detail if detail else ''}"
              f"{'' if verbose else ' (omniloom -v launch ... shows the traceback)'}", file=sys.stderr)
        return 1
    rank = min(codes, key=lambda r: (codes[r] < 0, r))  # a rank that exited beats one killed in the aftermath
    code = codes[rank]
    if code < 0 and forwarder.received and -code in (signal.SIGTERM, signal.SIGINT):
        sig = forwarder.received[0]
        print(f"omniloom launch: stopped by {signal.Signals(sig).name} while the ranks were still starting; "
              "no checkpoint was written", file=sys.stderr)
        return 128 + sig
    how = f"was killed by {signal.Signals(-code).name}" if code < 0 else f"exited with code {code}"
    print(f"omniloom launch: rank {rank} {how} (its own output is above); "
          f"{len(codes)} rank(s) failed", file=sys.stderr)
    return code if code in (2, 3) else 1  # 2: a user error the rank printed itself (argparse, `omniloom train`)


def _parser():
    from accelerate.commands.launch import launch_command_parser

    parser = launch_command_parser()
    parser.add_argument("--rdzv_timeout", "--rdzv-timeout", type=float, default=None, metavar="SECONDS",
                        help=f"(omniloom) how long the machines of a multi-machine launch wait for each other "
                             f"before one line names the missing ones and the launch exits 1 "
                             f"(default: ${rendezvous.TIMEOUT_ENV} or {rendezvous.DEFAULT_TIMEOUT_S:g})")
    return parser


def launch(argv: list[str], *, quiet_agent: bool = True, verbose: bool = False) -> int:
    """Run `accelerate launch ARGV` in this process; return the exit code the job should have.
    quiet_agent: keep torchrun's agent from logging each failure with its own traceback (the
    summary says it once; `omniloom -v launch` shows them). verbose: a launcher failure shows its
    traceback. A multi-machine launch first meets the other machines (pretrain/runtime/rendezvous.py)."""
    from accelerate.commands.launch import launch_command

    from omniloom.pretrain.config.run import resolve_accelerate_config

    args = _parser().parse_args(argv)
    rdzv_timeout = rendezvous.timeout_from(args.rdzv_timeout, os.environ)
    del args.rdzv_timeout  # ours, not accelerate's
    getattr(args, "nondefault", set()).discard("rdzv_timeout")
    shipped = given = found = None
    if args.config_file:  # a shipped config by name, from any folder; a missing file is one line (exit 2)
        found = resolve_accelerate_config(args.config_file)
        shipped = str(found) != args.config_file
        args.config_file, given = str(found), args.config_file
    forwarder = _Forwarder()
    with tempfile.TemporaryDirectory(prefix="omniloom-launch-") as errors:
        source = Path(args.config_file).name if args.config_file else "the default accelerate config"
        cfg, origins = machines.fill_placeholders(args, errors, os.environ)  # user errors: one line, exit 2
        meet = machines.settle(args, cfg, source, origins)
        if shipped:
            log.info("--config_file %s: the shipped accelerate config %s", given, found)
        if meet is not None:  # torchrun's own rendezvous then waits no longer than ours
            conf = [kv for kv in (args.rdzv_conf or "").split(",") if kv and not kv.startswith("timeout=")]
            args.rdzv_conf = ",".join(conf + [f"timeout={max(1, round(rdzv_timeout))}"])
        old_env = {k: os.environ.get(k) for k in ("OMNILOOM_LAUNCHED", "OMNILOOM_LAUNCH_ERRORS", LAUNCHER_PID_ENV)}
        # the ranks stop when this process dies, even by SIGKILL (pretrain/runtime/lifeline.py)
        os.environ.update(OMNILOOM_LAUNCHED="1", OMNILOOM_LAUNCH_ERRORS=errors, **{LAUNCHER_PID_ENV: str(os.getpid())})
        if quiet_agent:  # torchrun's agent logs every failure with a traceback of its own
            logging.getLogger("torch.distributed.elastic").setLevel(logging.CRITICAL)
        forwarder.install()
        try:
            if meet is not None:
                rendezvous.rendezvous(meet, rdzv_timeout)
            launch_command(args)
            code = 0
        except rendezvous.RendezvousError as err:
            print(f"omniloom launch: error: {err}", file=sys.stderr)
            code = err.code
        except SystemExit as err:  # accelerate's launcher exits 1 itself with --quiet
            code = _summarise(err, _rank_reports(errors), forwarder, verbose=verbose) if err.code else 0
        except Exception as err:  # ChildFailedError (torchrun), CalledProcessError (single process), SignalException
            code = _summarise(err, _rank_reports(errors), forwarder, verbose=verbose)
        finally:
            forwarder.uninstall()
            for k, v in old_env.items():
                if v is None:
                    os.environ.pop(k, None)
                else:
                    os.environ[k] = v
    if code == 0 and forwarder.received:
        print(f"omniloom launch: stopped by {signal.Signals(forwarder.received[0]).name}; every rank saved a "
              "checkpoint (resume with --resume auto)", file=sys.stderr)
    return code


def main(argv: list[str] | None = None) -> int:
    try:
        return launch(sys.argv[1:] if argv is None else argv)
    except ValueError as err:  # a user mistake in the launcher's own arguments (--config_file)
        print(f"omniloom launch: error: {err}", file=sys.stderr)
        return 2


if __name__ == "__main__":
    sys.exit(main())
