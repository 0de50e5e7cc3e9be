"""How many CPU threads torch uses in this process (train, eval, generate), and how they wait.

torch's default is one thread per core for every process. With several processes on one machine
(`accelerate launch`, torchrun) or DataLoader workers decoding beside the trainer, that
oversubscribes the cores. So each process takes its share of the cores it may run on, less one
core per DataLoader worker it feeds, and never less than one thread:

    threads = max(1, cores // processes_on_this_machine - num_workers)

`cores` is the CPU affinity of this process (os.sched_getaffinity), capped by a cgroup CPU quota
when the container has one; `processes_on_this_machine` is LOCAL_WORLD_SIZE (set by accelerate
launch and torchrun), else 1. An explicit choice wins: the config value (`train.num_threads`,
`--threads`), else an OMP_NUM_THREADS set in the environment. Under a launcher (LOCAL_WORLD_SIZE
set, or accelerate's one-process launcher's ACCELERATE_* variables) OMP_NUM_THREADS=1 is what
accelerate launch and torchrun put there when nobody asked, so it is not taken as a choice: pass
train.num_threads=1 to force one thread there. DataLoader workers get one thread each
(`omniloom.data.stream` gives them a worker_init_fn).

Waiting threads sleep (`apply_wait_policy`). The OpenMP runtime torch ships (libgomp) lets a
thread that waits for the others spin for about 300,000 rounds before it sleeps. When other work
shares the cores, a spinning thread burns the time slice the thread it waits for needs, and every
parallel region waits for its slowest thread: on 2 shared cores, eval ran 17x, generate 14x and a
training step 16x slower with 2 threads than with 1. With OMP_WAIT_POLICY=PASSIVE a waiting
thread sleeps at once, and 2 threads beside 2 busy processes ran 2-3x *faster* than 1 (the
scheduler gives every runnable thread its share). So `import omniloom.pretrain` (the `omniloom`
command, `python -m omniloom.pretrain.train` and the ranks `omniloom launch` starts all come
through it) puts OMP_WAIT_POLICY=PASSIVE in the environment before torch is imported, unless the
user set OMP_WAIT_POLICY, GOMP_SPINCOUNT or KMP_BLOCKTIME (OMP_WAIT_POLICY=ACTIVE brings the
spinning back on a dedicated machine). Capping the count at the cores other work leaves free was
measured too and is not done: with one busy process per core it chose 1 thread, 2-3x slower than 2.

The count from the cores is where a run starts, not always where it stays. On a quiet 2-core
machine the `tiny` model's eval, generate and train steps ran 1.06-1.57x faster on 1 thread
than on 2 (small matrices: waking the second thread costs more than it saves), while beside busy
processes 2 threads were up to 2.2x faster than 1. No fixed count wins both, so when nobody
chose the count (no --threads, train.num_threads or OMP_NUM_THREADS) and it is above 1 on a
machine without CUDA, the command times its first units of real work (decode steps, eval
documents, optimizer steps) at 1 thread and at the count from the cores in turn, and keeps the
faster (`ThreadTuner`; one log line says what it measured and kept). It costs a few units at the
slower count.

`omniloom bench threads` measures the default against every --threads value, idle and with one
busy process per core beside it (figures in BENCHMARKS.md).
"""

from __future__ import annotations

import contextlib
import logging
import math
import os
import statistics
import time
from dataclasses import dataclass
from pathlib import Path

log = logging.getLogger("omniloom.threads")

# Any of these set by the user is a choice about how OpenMP threads wait: left alone.
WAIT_POLICY_VARS = ("OMP_WAIT_POLICY", "GOMP_SPINCOUNT", "KMP_BLOCKTIME")


def apply_wait_policy(env=None) -> bool:
    """Put OMP_WAIT_POLICY=PASSIVE in `env` (os.environ) unless one of WAIT_POLICY_VARS is set;
    True when it did. OpenMP reads it once, when torch loads it: call this before `import torch`
    (`import omniloom.pretrain` does). Processes started from this one inherit it."""
    env = os.environ if env is None else env
    if any(env.get(k, "").strip() for k in WAIT_POLICY_VARS):
        return False
    env["OMP_WAIT_POLICY"] = "PASSIVE"
    return True


def wait_policy(env=None) -> str:
    """How OpenMP threads wait, in words, from the environment (as torch was loaded with it)."""
    env = os.environ if env is None else env
    chosen = [f"{k}={env[k].strip()}" for k in WAIT_POLICY_VARS if env.get(k, "").strip()]
    return ", ".join(chosen) if chosen else "OpenMP's default (spin, then sleep)"


def available_cores() -> int:
    """Cores this process may run on: its CPU affinity, capped by a cgroup v2/v1 CPU quota."""
    try:
        cores = len(os.sched_getaffinity(0))
    except (AttributeError, OSError):  # not Linux
        cores = os.cpu_count() or 1
    quota = _cgroup_quota()
    if quota is not None:
        cores = min(cores, quota)
    return max(1, cores)


def _cgroup_quota() -> int | None:
    try:
        v2 = Path("/sys/fs/cgroup/cpu.max")
        if v2.is_file():
            limit, period = v2.read_text().split()[:2]
            return None if limit == "max" else max(1, math.ceil(int(limit) / int(period)))
        q, p = Path("/sys/fs/cgroup/cpu/cpu.cfs_quota_us"), Path("/sys/fs/cgroup/cpu/cpu.cfs_period_us")
        if q.is_file() and p.is_file():
            limit, period = int(q.read_text()), int(p.read_text())
            return None if limit <= 0 else max(1, math.ceil(limit / period))
    except (OSError, ValueError):
        return None
    return None


def local_processes(env=None) -> int:
    """Training processes on this machine: LOCAL_WORLD_SIZE (accelerate launch / torchrun), else 1."""
    env = os.environ if env is None else env
    try:
        return max(1, int(env.get("LOCAL_WORLD_SIZE", "1")))
    except ValueError:
        return 1


@dataclass(frozen=True)
class ThreadChoice:
    threads: int
    reason: str
    explicit: bool = False  # set by the user (config, --threads, OMP_NUM_THREADS), not from the cores


def choose_threads(requested: int = 0, *, num_workers: int = 0, env=None, cores: int | None = None,
                   option: str = "train.num_threads") -> ThreadChoice:
    """The torch intra-op thread count for this process and why (see the module doc).
    `requested` > 0 is an explicit choice (`option` names where it came from)."""
    env = os.environ if env is None else env
    if requested < 0:
        raise ValueError(f"{option} must be >= 0 (0 picks from the cores), got {requested}")
    if requested > 0:
        return ThreadChoice(requested, f"set by {option}", explicit=True)
    omp = env.get("OMP_NUM_THREADS", "").strip()
    if omp == "1" and ("LOCAL_WORLD_SIZE" in env or "ACCELERATE_DYNAMO_BACKEND" in env):
        omp = ""  # torchrun and accelerate launch (its one-process launcher too) put 1 there by default: no choice
    if omp:
        try:
            n = int(omp)
        except ValueError:
            n = 0
        if n > 0:
            return ThreadChoice(n, "set by OMP_NUM_THREADS", explicit=True)
    cores = available_cores() if cores is None else cores
    procs = local_processes(env)
    share = max(1, cores // procs)
    n = max(1, share - max(0, num_workers))
    why = f"{cores} core(s) / {procs} process(es) on this machine"
    if num_workers:
        why += f", less 1 per DataLoader worker ({num_workers})"
    return ThreadChoice(n, why)


class ThreadTuner:
    """Keeps the fastest of `candidates` thread counts, timed on the first units of real work.

    Each `with tuner.unit(work):` block runs at the next candidate in turn (round robin); the
    first unit at each candidate is a warm-up and not counted; once every candidate has `trials`
    timed units, the count with the least median time per unit of `work` (tokens, documents,
    steps) is set for good and logged. After that `unit()` does nothing."""

    def __init__(self, candidates: list[int], *, trials: int = 3, quiet: bool = False,
                 clock=time.perf_counter, set_threads=None):
        if not candidates or min(candidates) < 1 or trials < 1:
            raise ValueError(f"ThreadTuner needs thread counts >= 1 and trials >= 1, got {candidates}, {trials}")
        if set_threads is None:
            import torch

            set_threads = torch.set_num_threads
        self.candidates = sorted(set(candidates))
        self.trials, self.quiet, self._clock, self._set = trials, quiet, clock, set_threads
        self.times: dict[int, list[float]] = {n: [] for n in self.candidates}
        self._warm: set[int] = set()
        self._turn = 0
        self._inside = False
        self.chosen: int | None = self.candidates[0] if len(self.candidates) == 1 else None
        if self.chosen is not None:
            self._set(self.chosen)

    @contextlib.contextmanager
    def unit(self, work: float = 1.0):
        if self.chosen is not None or self._inside:  # settled, or a unit inside a unit: the outer one times it
            yield
            return
        n = self.candidates[self._turn % len(self.candidates)]
        self._turn += 1
        self._set(n)
        self._inside = True
        t0 = self._clock()
        try:
            yield
        finally:
            self._inside = False
        dt = self._clock() - t0
        if n in self._warm:
            self.times[n].append(dt / max(work, 1e-9))
        else:
            self._warm.add(n)
        if all(len(v) >= self.trials for v in self.times.values()):
            medians = {k: statistics.median(v) for k, v in self.times.items()}
            self.chosen = min(self.candidates, key=lambda k: (medians[k], k))
            self._set(self.chosen)
            if not self.quiet:
                log.info("torch threads per process: kept %d, the fastest on this machine now (median per unit of work: %s; "
                         "%d units timed at each; --threads N or OMP_NUM_THREADS fixes the count)", self.chosen,
                         ", ".join(f"{k} thread(s) {1e3 * m:.3g} ms" for k, m in medians.items()), self.trials)


_TUNER: ThreadTuner | None = None


def end_tuning() -> None:
    """The command that started the timing is done: whatever count is set stays, and later work
    in this process (another command, a test) is not timed by it."""
    global _TUNER
    _TUNER = None


def tuned(work: float = 1.0):
    """Wrap one unit of a command's hot loop: times it while the thread count is being chosen
    (configure_threads(..., tune=True) without an explicit count), else does nothing."""
    return _TUNER.unit(work) if _TUNER is not None else contextlib.nullcontext()


def tune_candidates(threads: int) -> list[int]:
    """The counts a tuner compares: 1 and the count from the cores."""
    return sorted({1, threads})


def configure_threads(requested: int = 0, *, num_workers: int = 0, quiet: bool = False,
                      option: str = "train.num_threads", tune: bool = False) -> int:
    """Choose (choose_threads) and apply the thread count; log it in one line. Returns it.
    With `tune`, a count from the cores (not an explicit one) above 1 on a machine without CUDA
    is only the start: `tuned()` units then time 1 thread against it and keep the faster."""
    import torch

    global _TUNER
    choice = choose_threads(requested, num_workers=num_workers, option=option)
    torch.set_num_threads(choice.threads)
    _TUNER = None
    if tune and not choice.explicit and choice.threads > 1 and not torch.cuda.is_available():
        _TUNER = ThreadTuner(tune_candidates(choice.threads), quiet=quiet)
    if not quiet:
        how = f"{option} N" if option.startswith("--") else f"{option}=N"
        then = (f", timing 1 and {choice.threads} on the first units of work and keeping the faster" if _TUNER is not None else "")
        log.info("torch threads per process: %d (%s%s; override with %s or OMP_NUM_THREADS); waiting threads: %s",
                 choice.threads, choice.reason, then, how, wait_policy())
    return choice.threads

