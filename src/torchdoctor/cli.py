"""The ``torchdoctor`` command line: a thin layer that parses arguments and calls the packages.

Subcommands are registered in ``COMMANDS`` (name -> (module, summary)); a command module keeps its
heavy imports (torch) inside ``run()``, so ``torchdoctor --help`` does not import torch. A module's ``EXAMPLES``
(command, what it does) and ``EXIT_CODES`` (code, meaning) become the end of its ``--help`` (:func:`describe`), so
every command's help ends the same way.
Exit codes: 0 success, 1 problems found (for ``demo``: the demo did not go as shown), 2 bad usage.
"""

from __future__ import annotations

import argparse
import contextlib
import errno
import importlib
import os
import sys
import warnings
from collections.abc import Iterable
from types import ModuleType

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
    "precision": (
        "torchdoctor.precision.precision_run",
        "before training: will the model overflow in fp16 (or bf16), where, the loss scale, the fp32 fix, verified",
    ),
    "numerics": (
        "torchdoctor.timeline_run",
        "numerics recordings: `numerics show` draws one as an HTML page, `numerics diff` finds where two runs part",
    ),
    "run": (
        "torchdoctor.run.command",
        "run a training command, pass its output through, and explain how it ended (SIGKILL: peak RAM, OOM)",
    ),
}


EXAMPLES = [
    ("torchdoctor demo", "an fp16 overflow found, explained and fixed, on CPU"),
    ("torchdoctor env", "will CUDA extensions (DeepSpeed ops) build here?"),
    ("torchdoctor ds check ds_config.json --world-size 8", "lint a DeepSpeed config"),
    ("torchdoctor logs train.log", "why did this run break?"),
    ("torchdoctor run -- torchrun --nproc_per_node 8 train.py", "run training and explain how it ended"),
    ("torchdoctor precision ./my-model", "will it overflow in fp16? where, and the fix"),
    ("torchdoctor COMMAND --help", "a command's options, examples and exit codes"),
]
EXIT_CODES = [(EXIT_OK, "healthy"), (EXIT_PROBLEMS, "problems found"),
              (EXIT_USAGE, "bad usage or unreadable input"), (130, "interrupted (Ctrl-C)")]
_EXAMPLE_WIDTH = 48  # past this, every example of the command puts what it does on the line below it
_HELP_WIDTH = 100


def epilog(examples: Iterable[tuple[str, str]], exit_codes: list[tuple[int | str, str]]) -> str:
    """The end of a command's ``--help``: its examples (what each does beside it, or below it when one is long), then
    the exit codes."""
    examples = list(examples)
    width = max((len(c) for c, _ in examples), default=0)
    lines = ["examples:"] if examples else []
    for command, what in examples:
        if width > _EXAMPLE_WIDTH:
            lines += [f"  {command}"] + ([f"      {what}"] if what else [])
        else:
            lines.append(f"  {command:<{width}}  {what}".rstrip())
    line = "exit codes:"
    for i, (code, meaning) in enumerate(exit_codes):  # a long list wraps between codes, never inside one
        entry = f"{code} {meaning}" + (";" if i < len(exit_codes) - 1 else "")
        if len(line) + 1 + len(entry) > _HELP_WIDTH and line.strip() != "exit codes:":
            lines.append(line)
            line = " "
        line += " " + entry
    lines.append(line)
    return "\n".join(lines)


def describe(parser: argparse.ArgumentParser, module: ModuleType) -> None:
    """End ``parser``'s help with ``module``'s ``EXAMPLES`` and ``EXIT_CODES``. A module without them keeps the
    epilog it set itself (``comm``'s launch lines and exit codes)."""
    examples, codes = getattr(module, "EXAMPLES", None), getattr(module, "EXIT_CODES", None)
    if examples is None and codes is None:
        return
    parser.formatter_class = argparse.RawDescriptionHelpFormatter
    parser.epilog = epilog(examples or [], codes or EXIT_CODES)


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(
        prog="torchdoctor",
        description="Tells you why a PyTorch training run broke and how to fix it.",
        formatter_class=argparse.RawDescriptionHelpFormatter,
        epilog=epilog(EXAMPLES, EXIT_CODES),
    )
    from . import __version__

    parser.add_argument("--version", action="version", version=f"torchdoctor {__version__}")
    sub = parser.add_subparsers(dest="command", metavar="COMMAND")
    for name, (module, summary) in COMMANDS.items():
        p = sub.add_parser(name, help=summary, description=summary)
        # _parser: the parser whose usage an unknown argument is reported with (a nested one sets _sub_parser)
        p.set_defaults(_module=module, _parser=p)
        mod = importlib.import_module(module)
        mod.add_arguments(p)
        describe(p, mod)
    return parser


def parse(parser: argparse.ArgumentParser, argv: list[str] | None) -> argparse.Namespace:
    """``parser.parse_args``, except that an unknown argument is reported by the (sub)command it was given to, with
    that command's usage line (argparse's own reports it at the top level, with ``torchdoctor``'s usage)."""
    args, extra = parser.parse_known_args(argv)
    if extra:
        leaf = getattr(args, "_sub_parser", None) or getattr(args, "_parser", None) or parser
        leaf.error(f"unrecognized arguments: {' '.join(extra)}")
    return args


def main(argv: list[str] | None = None) -> int:
    """The command line; returns the exit code. A Ctrl-C anywhere in it -- parsing, a command, the handling of an
    error -- is "interrupted", exit 130, once: never a traceback, never the interpreter's own death by SIGINT."""
    try:
        return _main(argv)
    except KeyboardInterrupt:
        with contextlib.suppress(KeyboardInterrupt, OSError, ValueError):
            print("interrupted", file=sys.stderr)
        return 130


def _main(argv: list[str] | None) -> int:
    # torch warns "Failed to initialize NumPy" at import when numpy is absent (`make demo` installs torch alone);
    # torchdoctor never hands torch a numpy array, so the warning says nothing to its users.
    warnings.filterwarnings("ignore", message=r"Failed to initialize NumPy", category=UserWarning)
    parser = build_parser()
    args = parse(parser, argv)
    if not getattr(args, "_module", None):
        parser.print_help()
        return EXIT_USAGE
    try:
        return importlib.import_module(args._module).run(args)
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
