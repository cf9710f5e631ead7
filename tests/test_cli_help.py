"""Every command's --help ends the same way (examples, exit codes), and a bad argument is reported by the command
it was given to, with that command's usage line: real CLI runs through ``cli.main``."""

from __future__ import annotations

import importlib
import re

import pytest

from torchdoctor import cli
from torchdoctor.deepspeed.ds_run import SUBCOMMANDS

COMMANDS = [[name] for name in cli.COMMANDS] + [["ds", name] for name in SUBCOMMANDS]


def run_main(argv, capsys):
    try:
        rc = cli.main(argv)
    except SystemExit as e:  # argparse's --help and usage errors
        rc = e.code
    out, err = capsys.readouterr()
    return rc, out, err


@pytest.mark.parametrize("command", COMMANDS, ids=" ".join)
def test_every_help_has_examples_and_exit_codes(command, capsys):
    rc, out, _ = run_main([*command, "--help"], capsys)
    assert rc == 0
    tail = out[out.rindex("\nexit codes: "):]
    codes = [int(c) for c in re.findall(r"(?:: |; |;\n  )(\d+) ", tail)]
    assert 2 in codes  # bad usage, which every command has
    assert 130 in codes or command == ["run"]  # run's Ctrl-C is the command's own exit status (128 + 2)
    heading = "\nexamples:\n"
    examples = out[out.index(heading) + len(heading): out.rindex("\nexit codes: ")].splitlines()
    commands = [ln.strip() for ln in examples if ln.startswith("  ") and not ln.startswith("      ")]
    assert commands and all(c.split()[0] in ("torchdoctor", "torchrun", "srun", "kubectl") for c in commands), examples
    assert any(" ".join(command) in c for c in commands)  # an example of this very command


def test_the_epilog_comes_from_the_module_that_owns_the_command():
    parser = cli.build_parser()
    sub = next(a for a in parser._actions if a.dest == "command").choices
    for name, (module, _) in cli.COMMANDS.items():
        mod = importlib.import_module(module)
        if hasattr(mod, "EXAMPLES"):
            assert sub[name].epilog == cli.epilog(mod.EXAMPLES, getattr(mod, "EXIT_CODES", cli.EXIT_CODES))


def test_the_top_level_help_has_examples_and_the_project_exit_codes(capsys):
    rc, out, _ = run_main(["--help"], capsys)
    assert rc == 0 and "\nexamples:\n  torchdoctor demo\n" in out
    assert "exit codes: 0 healthy; 1 problems found; 2 bad usage or unreadable input" in out


@pytest.mark.parametrize("argv, usage", [
    (["ds", "check", "--bogus", "x.json"], "usage: torchdoctor ds check "),
    (["ds", "memory", "--params", "7B", "--bogus"], "usage: torchdoctor ds memory "),
    (["ds", "--bogus"], "usage: torchdoctor ds "),
    (["demo", "--level", "x"], "usage: torchdoctor demo "),
    (["env", "--bogus"], "usage: torchdoctor env "),
    (["report", "--bogus"], "usage: torchdoctor report "),
    (["logs", "x.log", "--bogus"], "usage: torchdoctor logs "),
    (["comm", "--bogus"], "usage: torchdoctor comm "),
    (["run", "--bogus", "--", "true"], "usage: torchdoctor run "),
    (["--bogus"], "usage: torchdoctor [-h]"),
])
def test_an_unknown_argument_shows_that_commands_usage(argv, usage, capsys):
    rc, out, err = run_main(argv, capsys)
    assert rc == 2 and out == ""
    assert err.startswith(usage), err
    prog = usage[len("usage: "):].split(" [")[0].strip()
    assert err.rstrip().splitlines()[-1].startswith(f"{prog}: error: unrecognized arguments: ")
    assert "Traceback" not in err


def test_epilog_puts_long_examples_on_two_lines():
    short = cli.epilog([("torchdoctor x", "does x"), ("torchdoctor yy", "does y")], [(0, "ok"), (2, "bad usage")])
    assert short.splitlines() == ["examples:", "  torchdoctor x   does x", "  torchdoctor yy  does y",
                                  "exit codes: 0 ok; 2 bad usage"]
    long = cli.epilog([("torchdoctor " + "x" * 60, "does x")], [(2, "bad usage")])
    assert long.splitlines()[1:3] == ["  torchdoctor " + "x" * 60, "      does x"]
