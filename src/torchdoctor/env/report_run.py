"""``torchdoctor report``: the bundle a DeepSpeed / transformers bug report needs, ready to paste.

Versions exactly as the packages print them, the environment findings, the DeepSpeed config, and only
the TrainingArguments that differ from transformers' defaults. Nothing is ever unpickled: pass
``trainer.args.to_json_string()`` output (a JSON file) or the command-line arguments, not training_args.bin.
"""

from __future__ import annotations

import argparse
import sys

from ..jsonfile import dumps

EXIT_OK, EXIT_USAGE = 0, 2
EXAMPLES = [
    ("torchdoctor report --ds-config ds.json --training-args args.json", "Markdown for a bug report"),
    ("torchdoctor report --training-args \"--learning_rate 3e-5 --fp16\" -o report.md", "arguments as typed, "
     "saved to a file too"),
    ("torchdoctor report --json", "the same as JSON"),
]
EXIT_CODES = [(EXIT_OK, "the report was printed (the findings are in it)"),
              (EXIT_USAGE, "bad usage, or a file that cannot be read or written"), (130, "interrupted (Ctrl-C)")]


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--ds-config", metavar="FILE", default=None,
                        help="the DeepSpeed config (JSON) of the run; -: read it from standard input")
    parser.add_argument("--training-args", metavar="FILE_OR_ARGS", default=None,
                        help="TrainingArguments as JSON (trainer.args.to_json_string() saved to a file) or the "
                             "command-line arguments in one string, e.g. \"--learning_rate 3e-5 --fp16\"")
    parser.add_argument("--json", action="store_true", help="print one JSON object instead of Markdown")
    parser.add_argument("--output", "-o", metavar="FILE", default=None, help="write the report to FILE too")


def run(args: argparse.Namespace) -> int:
    from .bundle import BundleError, load_ds_config
    from .bundle_render import render_markdown, to_json
    from .training_args import load_training_args, training_args_diff

    try:
        if args.ds_config is not None and not args.ds_config.strip():
            raise BundleError("--ds-config is empty; pass the DeepSpeed config file (or - for standard input)")
        ds = load_ds_config(args.ds_config) if args.ds_config is not None else None
        # an empty --training-args is refused (load_training_args says so), not taken for "not given"
        ta = training_args_diff(load_training_args(args.training_args)) if args.training_args is not None else None
    except BundleError as e:
        print(f"torchdoctor report: {e}", file=sys.stderr)
        return EXIT_USAGE
    from . import probe, rules
    from .bundle import uses_nvme
    from .progress import probing

    with probing("torchdoctor report"):  # stderr, and only when the probe takes over 2 s
        facts = probe.collect()
    findings = rules.judge(facts, nvme_offload=bool(ds and uses_nvme(ds)))
    text = (dumps(to_json(facts, findings, ds, ta), indent=1) if args.json
            else render_markdown(facts, findings, ds, ta))
    print(text)
    if args.output:
        try:
            with open(args.output, "w") as f:
                f.write(text + "\n")
        except OSError as e:
            print(f"torchdoctor report: cannot write {args.output}: {e}", file=sys.stderr)
            return EXIT_USAGE
    return EXIT_OK
