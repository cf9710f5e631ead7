"""What an exception inside a stage is: a failure of the communication the stage checks, or something else.

A stage expects the failures of what it runs: a collective that errors (torch.distributed's ``DistError`` family,
the ``RuntimeError`` a backend raises), a connection or a socket (``OSError``), a wrong result. Anything else is not
a network problem, and its fixes are not the network's: a module missing from the environment (an
``ImportError``, or a message naming a module that cannot be imported, as torch's "Numpy is not available" from
``tensor.numpy()``, torch/csrc/utils/tensor_numpy.cpp) is said with the ``pip install`` that brings it; another
Python error (a ``TypeError`` from a torch it does not fit) is said as the error it is, with where it was raised.
"""

from __future__ import annotations

import importlib.util
import re
import traceback

#: torch's own words for a Python module it needs and cannot import, where it raises no ImportError: message ->
#: module. "Numpy is not available": torch/csrc/utils/tensor_numpy.cpp (``tensor.numpy()``, ``torch.from_numpy``;
#: also torch/distributed/_local_tensor/__init__.py), torch 2.4 .. 2.13.
TORCH_MISSING_MODULE = {"Numpy is not available": "numpy"}
_NO_MODULE = re.compile(r"No module named '([A-Za-z_][\w.]*)'")  # Python's ImportError text, also quoted in others


def missing_module(e: BaseException) -> str | None:
    """The top-level module an exception says is missing, checked: it really cannot be imported here."""
    text = str(e)
    names = [e.name] if isinstance(e, ImportError) and e.name else []
    names += [m.group(1) for m in _NO_MODULE.finditer(text)]
    names += [module for words, module in TORCH_MISSING_MODULE.items() if words in text]
    for name in names:
        top = name.split(".")[0]
        try:
            if importlib.util.find_spec(top) is None:
                return top
        except (ImportError, ValueError):  # a broken package: importing it fails the same way
            return top
    return None


def raised_at(e: BaseException) -> str:
    """``file:line in function`` of the innermost Python frame of ``e``'s traceback."""
    frames = traceback.extract_tb(e.__traceback__)
    if not frames:
        return "?"
    f = frames[-1]
    return f"{f.filename}:{f.lineno} in {f.name}"


def classify(e: BaseException) -> tuple[str, str]:
    """(kind, text) of an exception raised inside a stage: ``"missing-module"`` (the text begins ``module NAME
    missing:``), ``"python-error"`` (not a communication failure: the text says where it was raised), or ``"error"``."""
    first = (str(e).strip().splitlines() or [""])[0]
    said = f"{type(e).__name__}: {first}" if first else type(e).__name__
    module = missing_module(e)
    if module is not None:
        return "missing-module", f"module {module} missing: {said}"
    if not isinstance(e, (RuntimeError, OSError)):  # (torch.distributed's DistError family are RuntimeErrors)
        return "python-error", f"{said} (raised at {raised_at(e)})"
    return "error", f"{type(e).__name__}: {str(e).strip()}"


#: the kinds :func:`classify` gives a failure that is not the communication's
OWN_KINDS = ("missing-module", "python-error")


def own_findings(broken: dict, ranks_of, describe_rank) -> list:
    """One finding per (kind, stage, error) among ``broken``'s final records of :data:`OWN_KINDS`, the ranks named
    with ``ranks_of(list)``; a single rank with ``describe_rank(r)``. Never a network fix: it is not the network."""
    from ..findings import Finding

    groups: dict[tuple[str, str, str], list[int]] = {}
    for r, f in sorted(broken.items()):
        if f.get("kind") in OWN_KINDS:
            groups.setdefault((f["kind"], f["stage"], f["error"].splitlines()[0]), []).append(r)
    out = []
    for (kind, stage, error), ranks in groups.items():
        who = describe_rank(ranks[0]) if len(ranks) == 1 else f"ranks {ranks_of(ranks)}"
        if kind == "missing-module":
            module, _, said = error.removeprefix("module ").partition(" missing: ")
            out.append(Finding(
                "comm.missing-module", "fail",
                f"{stage} failed on {who}: the Python module {module} is not installed where the ranks run ({said})",
                [f"{module} cannot be imported in this environment; {stage} needs it -- not a network problem"],
                [f"pip install {module}   # in the environment every rank runs in"],
                {"ranks": ranks, "stage": stage, "module": module}))
        else:
            out.append(Finding(
                "comm.python-error", "fail",
                f"{stage} failed on {who} with a Python error, not a communication failure: {error}",
                ["no collective reported a failure: the error was raised by Python code around it"],
                ["check that torch and torchdoctor fit each other (`torchdoctor env`); if they do, report the error "
                 "above with `python -c 'import torch; print(torch.__version__)'`"],
                {"ranks": ranks, "stage": stage}))
    return out
