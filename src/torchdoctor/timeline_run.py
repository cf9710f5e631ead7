"""``torchdoctor numerics``: look at a numerics recording (``run --numerics --record DIR`` or
``NumericsMonitor(record=DIR)``) -- ``show`` draws it as one HTML page, ``diff`` finds where two runs part.

Only the arguments live here (``torchdoctor --help`` imports no torch); the work is in
:mod:`torchdoctor.numerics.timeline.commands`.
"""

from __future__ import annotations

import argparse

from .cli_args import number_list

EXIT_OK, EXIT_PROBLEMS, EXIT_USAGE = 0, 1, 2

EXAMPLES = [
    ("torchdoctor run --numerics --record rec -- python train.py", "record every step's module values"),
    ("torchdoctor numerics show rec -o report.html", "the recording as one page: heatmaps, the first inf/nan"),
    ("torchdoctor numerics diff fp32-rec bf16-rec", "where two runs part: step, module, phase, rank"),
    ("torchdoctor numerics SUBCOMMAND --help", "a subcommand's options, examples and exit codes"),
]
EXIT_CODES = [(EXIT_OK, "nothing non-finite / the runs agree"), (EXIT_PROBLEMS, "a non-finite value recorded / the "
              "runs diverge"), (EXIT_USAGE, "bad usage or a folder that is not a recording"), (130, "interrupted")]

SHOW_EXAMPLES = [
    ("torchdoctor numerics show rec", "write rec/timeline.html and say what it shows"),
    ("torchdoctor numerics show rec -o report.html --columns 600", "a smaller page: 600 step columns at most"),
    ("torchdoctor numerics show rec --json", "what the page shows, as JSON"),
]
SHOW_EXIT_CODES = [(EXIT_OK, "no non-finite value recorded"), (EXIT_PROBLEMS, "a non-finite value (or a report) "
                   "recorded"), (EXIT_USAGE, "bad usage or a folder that is not a recording"), (130, "interrupted")]
DIFF_EXAMPLES = [
    ("torchdoctor numerics diff run-a run-b", "the first step, module, phase and rank where they part"),
    ("torchdoctor numerics diff fp32 bf16 --rtol 0.02", "a looser tolerance (bf16 rounds at ~0.4%)"),
    ("torchdoctor numerics diff a b -o diff.html", "also draw both runs and their ratio"),
    ("torchdoctor numerics diff a b --json", "the verdict and the values, as JSON"),
]
DIFF_EXIT_CODES = [(EXIT_OK, "the runs agree within tolerance"), (EXIT_PROBLEMS, "they diverge"),
                   (EXIT_USAGE, "bad usage or a folder that is not a recording"), (130, "interrupted")]


class _Sub:
    """A subcommand's help ending (cli.describe reads EXAMPLES / EXIT_CODES off a module-like object)."""

    def __init__(self, examples: list[tuple[str, str]], exit_codes: list[tuple[int, str]]) -> None:
        self.EXAMPLES = examples
        self.EXIT_CODES = exit_codes


def _positive(text: str) -> int:
    try:
        n = int(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"expected a whole number, got {text!r}") from None
    if n < 1:
        raise argparse.ArgumentTypeError(f"expected a number >= 1, got {text!r}")
    return n


def _ranks(text: str) -> list[int]:
    return sorted(set(number_list(text, "rank numbers", "0,3")))


def _tolerance(text: str) -> float:
    try:
        x = float(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"expected a number like 1e-3, got {text!r}") from None
    if not x >= 0 or x == float("inf"):
        raise argparse.ArgumentTypeError(f"expected a finite number >= 0, got {text!r}")
    return x


def add_arguments(parser: argparse.ArgumentParser) -> None:
    from .cli import describe

    sub = parser.add_subparsers(dest="numerics_command", metavar="SUBCOMMAND")
    show = sub.add_parser("show", help="draw a recording as one self-contained HTML page",
                          description="Draw a recording as one self-contained HTML page (nothing fetched when viewed): "
                                      "per rank a module x step heatmap of each output's abs max and one of the "
                                      "gradients at them, coloured by the headroom to the dtype's max, the first "
                                      "non-finite value marked, exact values on hover, the text report below.")
    show.add_argument("run_dir", metavar="RUN_DIR", help="the folder given to --record (or one rank<r>/ inside it)")
    show.add_argument("-o", "--output", metavar="FILE", default=None,
                      help="the page to write (default: RUN_DIR/timeline.html)")
    show.add_argument("--columns", metavar="N", type=_positive, default=None,
                      help="at most N step columns (default 1200, fewer for many modules or ranks: the page stays "
                           "under ~20 MB); a column holds its steps' largest abs max, the first non-finite step one "
                           "of its own")
    show.add_argument("--ranks", metavar="LIST", type=_ranks, default=None,
                      help="draw only these ranks, e.g. 0,3 (default: every rank recorded; many ranks share the "
                           "page's size budget, so each gets fewer columns)")
    show.add_argument("--json", action="store_true", help="print what the page shows as JSON")
    show.set_defaults(_numerics_run="show", _sub_parser=show)
    describe(show, _Sub(SHOW_EXAMPLES, SHOW_EXIT_CODES))

    diff = sub.add_parser("diff", help="the first step, module, phase and rank where two recordings part",
                          description="Align two recordings by step, module output and phase (and rank, when both "
                                      "have the same ranks; else each run's ranks folded into one) and print the "
                                      "first value that differs beyond tolerance, what still agreed upstream of it "
                                      "that step, and how the difference grew after.")
    diff.add_argument("run_a", metavar="RUN_A", help="the reference recording (A)")
    diff.add_argument("run_b", metavar="RUN_B", help="the recording compared with it (B)")
    diff.add_argument("--rtol", metavar="R", type=_tolerance, default=1e-3,
                      help="relative tolerance: two values agree when |a-b| <= atol + R * max(|a|, |b|) (default "
                           "1e-3; identical seeded runs on one machine agree at 0)")
    diff.add_argument("--atol", metavar="A", type=_tolerance, default=0.0, help="absolute tolerance (default 0)")
    diff.add_argument("--stat", choices=("max", "min", "both"), default="max",
                      help="which statistic is compared: each output's abs max (default), abs min, or both")
    diff.add_argument("-o", "--output", metavar="FILE", default=None,
                      help="also write a page drawing both runs and their ratio, the first divergence marked")
    diff.add_argument("--columns", metavar="N", type=_positive, default=None,
                      help="at most N step columns on the page (default 1200 or fewer)")
    diff.add_argument("--json", action="store_true", help="print the verdict and the values as JSON")
    diff.set_defaults(_numerics_run="diff", _sub_parser=diff)
    describe(diff, _Sub(DIFF_EXAMPLES, DIFF_EXIT_CODES))
    parser.set_defaults(_numerics_parser=parser)


def run(args: argparse.Namespace) -> int:
    which = getattr(args, "_numerics_run", None)
    if which is None:
        args._numerics_parser.print_help()
        return EXIT_USAGE
    from .numerics.timeline import commands

    return commands.show(args) if which == "show" else commands.diff(args)
