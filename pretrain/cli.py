"""The `omniloom` command: one CLI whose subcommands each package registers.

A package takes part by having a `cli.py` with `register(subparsers)` (adds its commands, each with
`set_defaults(func=handler)`) and optionally `register_bench(bench_subparsers)` (adds an
`omniloom bench NAME` entry). Handlers take the parsed args and return an exit code or None.
CLI modules import heavy dependencies (torch, av) inside their handlers so `--help` stays fast.

User errors (ValueError and its subclasses, missing files) print one line and exit 2; `-v` shows
the traceback. A reader that closes the pipe early (`| head`) ends any command quietly (exit 141).
Anything else is a bug and keeps its traceback.
"""

from __future__ import annotations

import argparse
import importlib
import io
import logging
import os
import sys

from .console import USER_ERRORS, setup_logging, user_error_line, version

# Order is the order in `omniloom --help`.
COMMAND_MODULES = (
    "omniloom.data.cli",
    "omniloom.tokenizers.cli",
    "omniloom.pretrain.train.cli",
    "omniloom.pretrain.export.cli",
    "omniloom.pretrain.inference.cli",
    "omniloom.pretrain.report",
    "omniloom.pretrain.demo",
    "omniloom.pretrain.config.cli",
    "omniloom.model.cli",
    "omniloom.kernels.cli",
    "omniloom.pretrain.bench.cli",
)


log = logging.getLogger("omniloom")


def _cli_modules():
    for name in COMMAND_MODULES:
        try:
            yield importlib.import_module(name)
        except ModuleNotFoundError as err:
            if err.name != name:  # a real missing dependency inside the module: surface it
                raise


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(
        prog="omniloom",
        description="Pretrain native multimodal sparse-attention MoE models from scratch: "
        "prepare shards, train tokenizers, train with accelerate, export, evaluate.",
    )
    parser.add_argument("--version", action="version", version=f"omniloom {version()}")
    parser.add_argument("-v", "--verbose", action="count", default=0, help="more logging; -v also shows tracebacks for user errors")
    parser.add_argument("-q", "--quiet", action="count", default=0, help="less logging (-qq: errors only)")
    sub = parser.add_subparsers(dest="command", metavar="COMMAND")
    bench = sub.add_parser(
        "bench",
        help="run benchmarks and print figures",
        description="Benchmarks print figures as ratios against a reference measured in the same run. "
        "`omniloom bench` alone runs every benchmark with its defaults (several minutes) and ends with "
        "one summary table; `--out FILE.md` also writes every benchmark's output and the table there.",
    )
    bench.add_argument("--out", default=None, help="with no NAME: write all outputs and the summary table to this Markdown file")
    bench_sub = bench.add_subparsers(dest="bench", metavar="NAME")
    bench.set_defaults(func=lambda args: _bench_all(args, bench_sub))
    for module in _cli_modules():
        register = getattr(module, "register", None)
        if register is not None:
            register(sub)
        register_bench = getattr(module, "register_bench", None)
        if register_bench is not None:
            register_bench(bench_sub)
    return parser


class _Tee(io.TextIOBase):
    """Write to the terminal and keep a copy (for `omniloom bench --out`)."""

    def __init__(self, stream):
        self.stream, self.copy = stream, io.StringIO()

    def write(self, text):
        self.stream.write(text)
        self.copy.write(text)
        return len(text)

    def flush(self):
        self.stream.flush()


def _bench_all(args, bench_sub) -> int:
    """`omniloom bench` with no name: run every registered benchmark with its defaults, then print
    one summary table (and write everything to --out)."""
    import contextlib
    import time

    names = list(bench_sub.choices)
    if not names:
        print("no benchmarks are registered")
        return 1
    rows, sections, status = [], [], 0
    for name in names:
        sub_args = bench_sub.choices[name].parse_args([])
        if not getattr(sub_args, "in_bench_all", True):  # an experiment of its own (bench arch: many trainings)
            print(f"\n== omniloom bench {name} == skipped: it runs on its own (omniloom bench {name})", flush=True)
            continue
        print(f"\n== omniloom bench {name} ==", flush=True)
        sub_args.verbose, sub_args.quiet = args.verbose, args.quiet
        tee = _Tee(sys.stdout)
        start = time.perf_counter()
        try:
            with contextlib.redirect_stdout(tee):
                code = int(sub_args.func(sub_args) or 0)
        except Exception as err:  # one broken benchmark must not hide the others' figures
            log.error("bench %s failed: %s", name, err)
            code = 1
        rows.append((name, code, time.perf_counter() - start))
        sections.append((name, tee.copy.getvalue()))
        status = max(status, code)
    table = ["| benchmark | status | seconds |", "|---|---|---|"]
    table += [f"| `omniloom bench {n}` | {'ok' if c == 0 else f'exit {c}'} | {sec:.1f} |" for n, c, sec in rows]
    print("\n" + "\n".join(table))
    if args.out:
        from pathlib import Path

        body = [f"# omniloom bench ({version()})", ""]
        for name, text in sections:
            body += [f"## omniloom bench {name}", "", "```", text.rstrip(), "```", ""]
        body += ["## Summary", "", *table, ""]
        Path(args.out).write_text("\n".join(body), encoding="utf-8")
        print(f"written: {args.out}")
    return status


def parse_args(parser: argparse.ArgumentParser, argv: list[str] | None) -> argparse.Namespace:
    """`parser.parse_args`, except that a command taking dotted overrides also takes them after its
    options: argparse fills positionals once, so in `omniloom train tiny --resume auto
    train.num_steps=50` the last word would be "unrecognized"."""
    args, extra = parser.parse_known_args(argv)
    if extra:
        overrides = getattr(args, "overrides", None)
        if not isinstance(overrides, list) or any(a.startswith("-") for a in extra):
            parser.error(f"unrecognized arguments: {' '.join(extra)}")
        overrides.extend(extra)
    return args


def main(argv: list[str] | None = None) -> int:
    """Run one command. Output cut short by its reader (`omniloom tokenizer encode ... | head`) ends
    the command quietly, as a command killed by SIGPIPE would (exit 141), whichever command printed:
    stdout is flushed here, inside the handler, not at interpreter exit."""
    try:
        try:
            return _main(argv)
        finally:
            sys.stdout.flush()
    except BrokenPipeError:
        try:  # later writes (and Python's own flush at exit) go nowhere instead of failing again
            devnull = os.open(os.devnull, os.O_WRONLY)
            os.dup2(devnull, sys.stdout.fileno())
        except (OSError, ValueError, AttributeError):  # a stdout without a file descriptor
            pass
        return 141


def _main(argv: list[str] | None) -> int:
    parser = build_parser()
    args = parse_args(parser, argv)
    verbosity = args.verbose - args.quiet
    setup_logging(verbosity)
    if getattr(args, "func", None) is None:
        parser.print_help()
        return 2
    try:
        return int(args.func(args) or 0)
    except (*USER_ERRORS, OSError) as err:
        line = user_error_line(err)
        if args.verbose or line is None:
            raise
        print(f"omniloom: {line}", file=sys.stderr)
        return 2
    except KeyboardInterrupt:
        print("omniloom: interrupted", file=sys.stderr)
        return 130


if __name__ == "__main__":
    sys.exit(main())
