"""``torchdoctor ds``: DeepSpeed's two questions before a run -- is the config right, and will it fit?

``ds check CONFIG.json`` lints a DeepSpeed config (typos, types, precision and loss-scale traps, batch
arithmetic, offload settings); ``ds memory`` estimates host and GPU memory for every ZeRO setup.
"""

from __future__ import annotations

import argparse
import importlib

# sub-command -> (module with add_arguments(parser) / run(args), summary)
SUBCOMMANDS = {
    "check": ("torchdoctor.deepspeed.check_run",
              "lint a DeepSpeed config: typos (did you mean), types, fp16/bf16 and loss-scale traps, batch sizes"),
    "memory": ("torchdoctor.deepspeed.memory_run",
               "host RAM per node and memory per GPU for every ZeRO stage and offload, vs what this machine has"),
}


def add_arguments(parser: argparse.ArgumentParser) -> None:
    sub = parser.add_subparsers(dest="ds_command", metavar="SUBCOMMAND")
    for name, (module, summary) in SUBCOMMANDS.items():
        p = sub.add_parser(name, help=summary, description=summary)
        p.set_defaults(_ds_module=module)
        importlib.import_module(module).add_arguments(p)
    parser.set_defaults(_ds_parser=parser)


def run(args: argparse.Namespace) -> int:
    module = getattr(args, "_ds_module", None)
    if module is None:
        args._ds_parser.print_help()
        return 2
    return importlib.import_module(module).run(args)
