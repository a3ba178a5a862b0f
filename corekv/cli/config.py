"""``corekv config``: the effective configuration as YAML (the file, then ``COREKV_*`` environment
overrides, with defaults filled in), or with ``--reference`` the configuration reference."""
from __future__ import annotations

import argparse

from corekv.cli.args import config_named, parser_kwargs, read_config_arg


def add_config_command(commands, common) -> None:
    p = commands.add_parser("config", parents=[common], help="print the effective config",
                            **parser_kwargs(
                                "Print the effective configuration (file, then COREKV_* environment "
                                "overrides, with defaults filled in) as YAML.",
                                "  corekv config --config cache.yaml\n"
                                "  COREKV_ENGINE__BLOCK_SIZE=32 corekv config\n"
                                "  corekv config --reference > docs/config.md\n"))
    p.add_argument("--reference", action="store_true",
                   help="print the configuration reference (markdown) instead")
    p.set_defaults(handler=cmd_config)


def cmd_config(args: argparse.Namespace) -> int:
    import yaml

    from corekv.config import config_reference, dump_config
    from corekv.plugin import make_plugin_manager

    if args.reference:
        # NOTE: a named config's plugins: add their options; the manager it was read with has them
        manager = read_config_arg(args)[1] if config_named(args) else make_plugin_manager()
        print(config_reference(manager), end="")
        return 0
    cfg, manager = read_config_arg(args)
    data = dump_config(cfg, plugin_manager=manager)
    print(yaml.safe_dump(data, sort_keys=False), end="")
    return 0
