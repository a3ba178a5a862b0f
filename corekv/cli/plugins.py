"""``corekv plugins``: every registered backend and tier, and every plugin, with the distribution
it comes from (the config's ``plugins:`` too, when a config is named)."""
from __future__ import annotations

import argparse
import json

from corekv.cli.args import config_plugins, parser_kwargs
from corekv.cli.output import print_table


def add_plugins_command(commands, common) -> None:
    p = commands.add_parser("plugins", parents=[common], help="list backends, tiers, policies and plugins",
                            **parser_kwargs(
                                "List every registered backend, tier, eviction and admission "
                                "policy, and every plugin, with the distribution it comes from.",
                                "  corekv plugins\n  corekv plugins --json\n"
                                "  corekv plugins --config cache.yaml   # also the config's plugins:\n"))
    p.add_argument("--json", action="store_true", help="print JSON (with each option schema)")
    p.set_defaults(handler=cmd_plugins)


def cmd_plugins(args: argparse.Namespace) -> int:
    from corekv.plugin import available_plugins

    info = available_plugins(config_plugins(args))
    if args.json:
        print(json.dumps(info, indent=2))
        return 0
    for title, key in (("Backends", "backends"), ("Tiers", "tiers"), ("Eviction", "eviction_policies"),
                       ("Admission", "admission_policies")):
        rows = [(name, d["distribution"] or "-", d["plugin"], d["description"])
                for name, d in info[key].items()]
        print_table(title, ("NAME", "DISTRIBUTION", "PLUGIN", "DESCRIPTION"), rows)
    rows = [(name, d["distribution"] or "-") for name, d in info["plugins"].items()]
    print_table("Plugins", ("NAME", "DISTRIBUTION"), rows)
    return 0
