"""The ``torchdoctor`` command line: a thin layer that parses arguments and calls the packages.

Subcommands are registered in ``COMMANDS`` (name -> (module, summary)); a command module keeps its
heavy imports (torch) inside ``run()``, so ``torchdoctor --help`` does not import torch.
Exit codes: 0 success, 1 problems found (for ``demo``: the demo did not go as shown), 2 bad usage.
"""

from __future__ import annotations

import argparse
import errno
import importlib
import os
import sys

EXIT_OK, EXIT_PROBLEMS, EXIT_USAGE = 0, 1, 2

# name -> (module providing add_arguments(parser) and run(args) -> int, one-line summary)
COMMANDS: dict[str, tuple[str, str]] = {
    "demo": (
        "torchdoctor.demo.run",
        "train a tiny T5 in fp16 on CPU: the monitor finds the overflow, explains it, and the fix works",
    ),
    "comm": (
        "torchdoctor.comm.run",
        "prove every rank can talk (torchrun, srun or --local N); name the rank that cannot; --bench bandwidth",
    ),
    "env": (
        "torchdoctor.env.run",
        "CUDA-build doctor: torch vs toolkits, PATH order, host gcc, GPU arch; --prebuild for DeepSpeed",
    ),
    "report": (
        "torchdoctor.env.report_run",
        "the bundle a DeepSpeed bug report needs: versions, findings, DS config, non-default TrainingArguments",
    ),
    "ds": (
        "torchdoctor.deepspeed.ds_run",
        "DeepSpeed: `ds check CONFIG.json` lints a config, `ds memory` estimates ZeRO memory per node and GPU",
    ),
    "logs": (
        "torchdoctor.logs.logs_run",
        "read training logs (DeepSpeed, HF Trainer, torchrun, NCCL): loss-scale collapse, NaN loss, kills, OOM",
    ),
    "run": (
        "torchdoctor.logs.wrap_run",
        "run a training command, pass its output through, and explain how it ended (SIGKILL: peak RAM, OOM)",
    ),
}


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(
        prog="torchdoctor",
        description="Tells you why a PyTorch training run broke and how to fix it.",
    )
    from . import __version__

    parser.add_argument("--version", action="version", version=f"torchdoctor {__version__}")
    sub = parser.add_subparsers(dest="command", metavar="COMMAND")
    for name, (module, summary) in COMMANDS.items():
        p = sub.add_parser(name, help=summary, description=summary)
        p.set_defaults(_module=module)
        importlib.import_module(module).add_arguments(p)
    return parser


def main(argv: list[str] | None = None) -> int:
    parser = build_parser()
    args = parser.parse_args(argv)
    if not getattr(args, "_module", None):
        parser.print_help()
        return EXIT_USAGE
    try:
        return importlib.import_module(args._module).run(args)
    except KeyboardInterrupt:
        print("interrupted", file=sys.stderr)
        return 130
    except BrokenPipeError:  # `torchdoctor ... | head`: the reader left; say nothing more
        devnull = os.open(os.devnull, os.O_WRONLY)
        os.dup2(devnull, sys.stdout.fileno())
        return 141
    except OSError as e:
        if e.filename is not None or not _is_output_error(e):
            raise
        # `torchdoctor logs x > /dev/full`: our own output could not be written; say so once, not a traceback
        devnull = os.open(os.devnull, os.O_WRONLY)
        os.dup2(devnull, sys.stdout.fileno())
        print(f"torchdoctor: cannot write the output: {e.strerror or e}", file=sys.stderr)
        return EXIT_USAGE


def _is_output_error(e: OSError) -> bool:
    """An error writing standard output (a full disk, a closed or broken descriptor), not one about a file."""
    return e.errno in (errno.ENOSPC, errno.EIO, errno.EBADF, errno.EDQUOT, errno.EFBIG)


if __name__ == "__main__":
    sys.exit(main())
