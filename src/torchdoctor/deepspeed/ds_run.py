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


EXAMPLES = [
    ("torchdoctor ds check ds_config.json --world-size 8", "lint a config for 8 data-parallel ranks"),
    ("torchdoctor ds memory --params 7B --gpus-per-node 8 --gpu-mem 80GiB", "will a 7B model fit, and how?"),
    ("torchdoctor ds SUBCOMMAND --help", "a subcommand's options, examples and exit codes"),
]
EXIT_CODES = [(0, "nothing failed"), (1, "a check failed"),
              (2, "bad usage or an unreadable file"), (130, "interrupted (Ctrl-C)")]


def add_arguments(parser: argparse.ArgumentParser) -> None:
    from ..cli import describe

    sub = parser.add_subparsers(dest="ds_command", metavar="SUBCOMMAND")
    for name, (module, summary) in SUBCOMMANDS.items():
        p = sub.add_parser(name, help=summary, description=summary)
        p.set_defaults(_ds_module=module, _sub_parser=p)  # _sub_parser: whose usage an unknown argument gets
        mod = importlib.import_module(module)
        mod.add_arguments(p)
        describe(p, mod)
    parser.set_defaults(_ds_parser=parser)


def run(args: argparse.Namespace) -> int:
    module = getattr(args, "_ds_module", None)
    if module is None:
        args._ds_parser.print_help()
        return 2
    return importlib.import_module(module).run(args)
