"""`omniloom config ...`: inspect presets and resolved configs."""

from __future__ import annotations


def register(sub) -> None:
    p = sub.add_parser("config", help="show presets and resolved run configs")
    csub = p.add_subparsers(dest="config_command", metavar="ACTION", required=True)
    show = csub.add_parser(
        "show",
        help="print the resolved config of a preset with overrides, as YAML",
        description="Print the resolved run config as YAML that loads back to an equal object. "
        "PRESET is a shipped preset name (see `omniloom config list`) or a YAML path; overrides "
        "are dotted key=value pairs, e.g. model.num_layers=4 optim.lr=1e-3.",
    )
    show.add_argument("preset", nargs="?", default=None, help="preset name or YAML path (default: built-in defaults)")
    show.add_argument("overrides", nargs="*", help="dotted overrides, key.path=value")
    show.set_defaults(func=_show)
    lst = csub.add_parser("list", help="list shipped presets")
    lst.set_defaults(func=_list)


def _show(args) -> int:
    from .run import load_config, to_yaml

    preset, overrides = args.preset, list(args.overrides)
    if preset is not None and "=" in preset:  # only overrides were given
        overrides.insert(0, preset)
        preset = None
    print(to_yaml(load_config(preset, overrides)), end="")
    return 0


def _list(args) -> int:
    from .run import list_presets, presets_dir

    for name in list_presets():
        print(f"{name}\t{presets_dir() / (name + '.yaml')}")
    return 0
