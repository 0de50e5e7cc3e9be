"""Which machines a launch spans, settled before accelerate sees the arguments.

`omniloom launch` reads the accelerate config the way accelerate will (a command-line flag beats
the file, the file beats accelerate's defaults) and:

- fills `${NAME}` and `${NAME:-DEFAULT}` placeholders in the file's values from the environment
  (DEFAULT may itself be a placeholder: `${MACHINE_RANK:-${SLURM_NODEID}}`), so one shipped
  `multi_node.yaml` serves every cluster; a placeholder whose flag is given is not needed, and one
  that nothing fills is a one-line error naming the variable and the flag;
- refuses, with one line saying what disagrees, a multi-machine launch whose `num_processes` is not
  a whole number of processes per machine, whose `machine_rank` is out of range, or that has no
  `main_process_ip` (accelerate's AssertionError said none of it);
- on one machine, picks a free port when neither the flag nor the file chose one, instead of
  accelerate's 29500 and its "Port 29500 is already in use" warning when another run holds it.

No torch here.
"""

from __future__ import annotations

import os
import re
import socket
from pathlib import Path

from omniloom.pretrain.config.io import ConfigError

from .rendezvous import Machines

# the launchers that run torchrun's rendezvous on main_process_ip:port (prepare_multi_gpu_env)
_TORCHRUN_TYPES = ("MULTI_GPU", "MULTI_NPU", "MULTI_XPU", "MULTI_MLU", "MULTI_SDAA", "MULTI_MUSA", "MULTI_HPU", "FSDP")
_NAME = re.compile(r"[A-Za-z_][A-Za-z0-9_]*")


class _Unset(Exception):
    def __init__(self, names: list[str]):
        super().__init__(", ".join(names))
        self.names = names


def expand(text: str, environ) -> str:
    """`${NAME}` and `${NAME:-DEFAULT}` (DEFAULT may hold placeholders) filled from `environ`; an
    empty variable counts as unset, as in the shell's `:-`. _Unset names the chain that was missing."""
    out, i = [], 0
    while True:
        j = text.find("${", i)
        if j < 0:
            return "".join(out) + text[i:]
        out.append(text[i:j])
        depth, k = 1, j + 2
        while k < len(text) and depth:
            if text.startswith("${", k):
                depth, k = depth + 1, k + 2
                continue
            depth -= text[k] == "}"
            k += 1
        if depth:
            raise ConfigError(f"unclosed placeholder in {text!r}")
        body = text[j + 2:k - 1]
        name, sep, default = body.partition(":-")
        if not _NAME.fullmatch(name):
            raise ConfigError(f"{text!r}: a placeholder is ${{NAME}} or ${{NAME:-DEFAULT}}, not ${{{body}}}")
        value = environ.get(name, "")
        if value == "":
            if not sep:
                raise _Unset([name])
            try:
                value = expand(default, environ)
            except _Unset as unset:
                raise _Unset([name, *unset.names]) from None
        out.append(value)
        i = k


def _load(path: str | None) -> dict:
    import yaml

    if path is None:
        from accelerate.commands.config import default_config_file

        path = default_config_file if os.path.isfile(default_config_file) else None
    if path is None:
        return {}
    data = yaml.safe_load(Path(path).read_text(encoding="utf-8")) or {}
    if not isinstance(data, dict):
        raise ConfigError(f"--config_file {path}: an accelerate config is a mapping of keys, not {type(data).__name__}")
    return data


def fill_placeholders(args, workdir: str, environ) -> tuple[dict, dict]:
    """Expand the placeholders of args.config_file into a copy in `workdir` (args.config_file then
    names the copy); return the config as accelerate will read it, and key -> placeholder for the
    values that came from one."""
    import yaml

    cfg = _load(args.config_file)
    origins = {k: v for k, v in cfg.items() if isinstance(v, str) and "${" in v}
    if not origins:
        return cfg, origins
    name = Path(args.config_file).name
    for key, value in list(cfg.items()):
        if not (isinstance(value, str) and "${" in value):
            continue
        given = getattr(args, key, None)
        if given is not None:  # the flag wins anyway: the placeholder needs no variable
            cfg[key] = given
            continue
        try:
            cfg[key] = yaml.safe_load(expand(value, environ))
        except _Unset as unset:
            names = unset.names
            which = f"{names[0]} is not set" if len(names) == 1 else f"none of {', '.join(names)} is set"
            raise ConfigError(f"{name}: {key} is {value} and {which}: export {names[0]} or give --{key}") from None
    filled = Path(workdir) / "accelerate_config.yaml"
    filled.write_text(yaml.safe_dump(cfg, sort_keys=False), encoding="utf-8")
    args.config_file = str(filled)
    return cfg, origins


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def settle(args, cfg: dict, source: str, origins: dict | None = None) -> Machines | None:
    """Check what the machines must agree on; pick a port on one machine. The Machines of a launch
    that goes through torchrun's rendezvous on several machines, else None. `source` names the
    config file and `origins` the placeholders its values came from, for the error lines."""
    origins = origins or {}
    def pick(key, default=None):
        value = getattr(args, key, None)
        return value if value is not None else cfg.get(key, default)

    def as_int(key, value):
        try:
            return int(value)
        except (TypeError, ValueError):
            raise ConfigError(f"{key} {value!r} (from {source}): give a whole number") from None

    num_machines = as_int("num_machines", pick("num_machines", 1))
    if num_machines <= 1:
        if pick("main_process_port") is None:  # nobody chose: a free one, not a warning about 29500
            args.main_process_port = _free_port()
        return None
    flag = {k: getattr(args, k, None) is not None for k in ("num_processes", "num_machines", "machine_rank")}

    def said(key, value):
        if flag.get(key):
            return f"--{key} {value}"
        return f"{key} {value} (from {source}{', ' + origins[key] if key in origins else ''})"

    raw = pick("num_processes")
    num_processes = -1 if raw is None else as_int("num_processes", raw)
    if num_processes < 1:
        raise ConfigError(f"{said('num_machines', num_machines)} but no num_processes: give --num_processes, the "
                          f"processes of every machine together ({num_machines} for 1 per machine, "
                          f"{8 * num_machines} for 8 GPUs each)")
    if num_processes % num_machines:
        raise ConfigError(f"{said('num_processes', num_processes)} with {said('num_machines', num_machines)}: "
                          f"num_processes counts the processes of every machine together, so it must be a multiple "
                          f"of num_machines ({num_machines} for 1 process per machine, {8 * num_machines} for 8 each)")
    machine_rank = as_int("machine_rank", pick("machine_rank", 0))
    if not 0 <= machine_rank < num_machines:
        raise ConfigError(f"{said('machine_rank', machine_rank)} with {said('num_machines', num_machines)}: "
                          f"machine_rank is 0..{num_machines - 1}, 0 on the machine at main_process_ip")
    ip = pick("main_process_ip")
    if not ip:
        raise ConfigError(f"{said('num_machines', num_machines)} but no main_process_ip: give --main_process_ip, "
                          "the address of the machine with machine_rank 0 (the same on every machine)")
    port = as_int("main_process_port", pick("main_process_port", 29500))
    if not 0 < port < 65536:
        raise ConfigError(f"main_process_port {port}: several machines must agree on a port, give one in 1..65535")
    args.main_process_port = port
    kind = str(cfg.get("distributed_type", "")).upper()
    if getattr(args, "use_deepspeed", False) or getattr(args, "tpu", False) or getattr(args, "cpu", False):
        return None
    if not (getattr(args, "multi_gpu", False) or getattr(args, "use_fsdp", False) or kind in _TORCHRUN_TYPES):
        return None  # MULTI_CPU (MPI), DeepSpeed, TPU: their own launchers meet on their own
    return Machines(num_machines=num_machines, machine_rank=machine_rank, main_process_ip=str(ip),
                    main_process_port=port)
