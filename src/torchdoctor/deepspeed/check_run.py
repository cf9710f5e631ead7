"""``torchdoctor ds check CONFIG.json``: lint a DeepSpeed config before the run.

Reads the config (:func:`~torchdoctor.deepspeed.config_check.load`), probes the two machine facts the rules need --
the GPUs' compute capabilities (``nvidia-smi``, else torch) and whether libaio is installed -- and prints the
findings of :func:`~torchdoctor.deepspeed.config_check.check`. Exit 0 when nothing failed, 1 when a check failed,
2 when the config cannot be read or an argument is wrong (a message, never a traceback).
"""

from __future__ import annotations

import argparse
import sys

from ..findings import render_text, use_color
from ..jsonfile import dumps

EXIT_OK, EXIT_PROBLEMS, EXIT_USAGE = 0, 1, 2
EXAMPLES = [
    ("torchdoctor ds check ds_config.json", "lint a config for deepspeed.initialize"),
    ("torchdoctor ds check ds_config.json --world-size 8", "... and its batch sizes for 8 data-parallel ranks"),
    ("torchdoctor ds check ds_config.json --for hf", "a config passed to the HF Trainer (it fills \"auto\")"),
    ("torchdoctor ds check - --json < ds_config.json", "from standard input, as JSON"),
]
EXIT_CODES = [(EXIT_OK, "nothing failed"), (EXIT_PROBLEMS, "a check failed (DeepSpeed would refuse the config or "
              "the run would break)"), (EXIT_USAGE, "bad usage or an unreadable config"), (130, "interrupted (Ctrl-C)")]


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("config", metavar="CONFIG.json", help="the DeepSpeed config file (-: read standard input)")
    parser.add_argument("--world-size", metavar="N", default=None,
                        help="data-parallel ranks of the run (GPUs / tensor x pipeline x sequence parallel): checks "
                             "train_batch_size = micro batch x gradient accumulation x N")
    parser.add_argument("--for", dest="for_", choices=("deepspeed", "hf"), default="deepspeed",
                        help='who reads the config: "deepspeed" (deepspeed.initialize, default) or "hf" (the HF '
                             'Trainer, which fills "auto" values)')
    parser.add_argument("--json", action="store_true", help='print {"config": ..., "findings": [...]} and the facts')


def _world_size(text: str | None) -> int | None:
    if text is None:
        return None
    try:
        n = int(str(text).strip())
    except ValueError:
        raise ValueError(f"--world-size: {text!r} is not a whole number") from None
    if n < 1:
        raise ValueError(f"--world-size: {n} is not a positive number of ranks")
    return n


def _is_terminal(stream) -> bool:
    try:
        return bool(stream is not None and stream.isatty())
    except (ValueError, OSError):  # closed
        return False


def _probe() -> tuple[list[str], str | None]:
    """(GPU compute capabilities, libaio path or None): cheap, torch is the only package imported."""
    from ..env import probe

    gpus, _, _ = probe.probe_gpus(probe.probe_torch(), probe._Errors())
    return [g.capability for g in gpus if g.capability], probe.probe_libaio()


def run(args: argparse.Namespace) -> int:
    from . import config_check
    from .hf_fill import hf_fill

    try:
        world_size = _world_size(getattr(args, "world_size", None))
    except ValueError as e:
        print(f"torchdoctor ds check: {e}", file=sys.stderr)
        return EXIT_USAGE
    for_ = getattr(args, "for_", "deepspeed") or "deepspeed"
    if for_ not in config_check.FOR_CHOICES:
        print(f"torchdoctor ds check: --for must be one of {', '.join(config_check.FOR_CHOICES)}", file=sys.stderr)
        return EXIT_USAGE
    if args.config == "-" and _is_terminal(sys.stdin):  # otherwise a newcomer's `ds check -` just sits there
        print("torchdoctor ds check: reading the config from standard input (end it with Ctrl-D)", file=sys.stderr)
    try:
        config = config_check.load(args.config)
    except config_check.ConfigError as e:
        print(f"torchdoctor ds check: {e}", file=sys.stderr)
        return EXIT_USAGE
    caps, libaio = _probe()
    findings = config_check.check(config, world_size=world_size, for_=for_, gpu_capabilities=caps, libaio=libaio,
                                  path="<stdin>" if args.config == "-" else args.config)
    sch = config_check.schema()
    hf = hf_fill(config).source if for_ == "hf" else None  # milliseconds: TrainingArguments are made once
    if getattr(args, "json", False):
        print(dumps({"config": args.config, "for": for_, "world_size": world_size, "gpu_capabilities": caps,
                     "libaio": libaio, "schema": sch.source, "hf_fill": hf,
                     "findings": [f.to_json() for f in findings]}, indent=1))
    else:
        gpus = ", ".join(f"sm {c}" for c in caps) or "none visible"
        print(f"torchdoctor ds check {args.config} (for {for_}; world size {world_size or 'not given'}; "
              f"GPUs: {gpus}; libaio: {libaio or 'not found'}; checked against {sch.source}"
              + (f'; "auto" filling read from {hf}' if hf else "") + ")")
        print()
        print(render_text(findings, color=use_color(sys.stdout)))
    return EXIT_PROBLEMS if any(f.severity == "fail" for f in findings) else EXIT_OK


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="torchdoctor ds check", description=__doc__.splitlines()[0])
    add_arguments(parser)
    return run(parser.parse_args(argv))


if __name__ == "__main__":
    sys.exit(main())
