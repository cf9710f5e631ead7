"""Invalid operations: the ops whose result or derivative is nan at points people's code reaches, and their repairs.

A nan that fp32 does not cure is no dtype's overflow: an op was asked for a value it has none at. In the forward
that is 0/0, inf-inf, log or sqrt of a negative number. In the backward it is more often a *derivative* with no
value where the forward was fine: torch's derivative formulas (``tools/autograd/derivatives.yaml`` in the pytorch
repository, read at v2.5-v2.13: ``div: grad / other``, ``log: grad.div(self)``, ``sqrt: grad / (2 * result)``,
``rsqrt: -0.5 * grad * result.pow(3)``, ``pow: grad * exponent * self.pow(exponent - 1)``, ``acos/asin: grad *
-((-self * self + 1).rsqrt())``, ``linalg_vector_norm: ... / norm``) divide by the input or the result, so an input of
exactly 0 (or +-1 for acos/asin) gives inf times 0 = nan -- and ``torch.where`` does not help, because the branch it
does not select still gets a gradient (of 0), and 0 / 0 is nan.

:func:`repair` maps a backward node (``DivBackward0``, as autograd's anomaly mode names it) or a forward op
(``aten.div.Tensor``) to what went wrong and the usual repair.
"""

from __future__ import annotations

import re

# (what the op computes, why its value or derivative is nan, the usual repair), by the op's base name
_TABLE: dict[str, tuple[str, str, str]] = {
    "div": ("a division", "its denominator is 0 where the branch is not used (0/0 in the gradient)",
            "divide by a safe denominator: torch.where(den != 0, den, torch.ones_like(den)) (or den.clamp_min(eps)) "
            "before dividing -- the branch torch.where does not select still gets a gradient, so its own inputs must "
            "be safe too"),
    "reciprocal": ("a reciprocal", "its input is 0", "x.clamp_min(eps).reciprocal(), or a safe input via torch.where"),
    "log": ("a log", "its input is 0 or negative", "x.clamp_min(eps).log(), torch.log1p for values near 0, or a "
            "log-space formulation (torch.logsumexp, log_softmax) instead of a log of a probability"),
    "log2": ("a log2", "its input is 0 or negative", "x.clamp_min(eps).log2()"),
    "log10": ("a log10", "its input is 0 or negative", "x.clamp_min(eps).log10()"),
    "sqrt": ("a square root", "its input is 0 (the derivative 1/(2 sqrt x) is infinite there) or negative",
             "(x + eps).sqrt() or x.clamp_min(eps).sqrt()"),
    "rsqrt": ("a reciprocal square root", "its input is 0 or negative", "(x + eps).rsqrt(), as norms do"),
    "pow": ("a power", "its base is 0 with an exponent below 1, or negative with a fractional exponent",
            "x.clamp_min(eps).pow(p), or x.abs().clamp_min(eps).pow(p) * x.sign()"),
    "linalg_vector_norm": ("a vector norm", "the vector is all zeros (the derivative x / norm is 0/0)",
                           "torch.nn.functional.normalize(x, eps=...) or (x.pow(2).sum(-1) + eps).sqrt()"),
    "norm": ("a norm", "the vector is all zeros (the derivative x / norm is 0/0)",
             "torch.nn.functional.normalize(x, eps=...) or (x.pow(2).sum(-1) + eps).sqrt()"),
    "acos": ("an arccos", "its input is +-1 (or beyond)", "x.clamp(-1 + eps, 1 - eps).acos()"),
    "asin": ("an arcsin", "its input is +-1 (or beyond)", "x.clamp(-1 + eps, 1 - eps).asin()"),
    "atan2": ("an atan2", "both inputs are 0", "add eps to the second input, or mask those points"),
    "softmax": ("a softmax", "a row is masked entirely (every logit -inf)",
                "keep one position of every row unmasked, or mask with torch.finfo(dtype).min instead of -inf"),
    "log_softmax": ("a log-softmax", "a row is masked entirely (every logit -inf)",
                    "keep one position of every row unmasked, or mask with torch.finfo(dtype).min instead of -inf"),
    "mul": ("a product", "one factor is inf and the other 0 (an inf made earlier and masked away)",
            "find where the inf is made and keep it finite (torch.finfo(dtype).max instead of inf, or a safe branch)"),
    "sub": ("a difference", "both sides are inf (inf - inf)", "keep the values finite before subtracting"),
    "add": ("a sum", "inf and -inf meet (inf - inf)", "keep the values finite before adding"),
    "exp": ("an exponential", "its input is nan or its result overflows and is then multiplied by 0",
            "subtract the maximum first (the logsumexp trick) or clamp the input"),
}


def op_base(name: str) -> str:
    """``DivBackward0`` -> ``div``; ``aten.div.Tensor`` / ``aten::div.Tensor`` -> ``div``;
    ``LinalgVectorNormBackward0`` -> ``linalg_vector_norm``."""
    if name.startswith(("aten.", "aten::")):
        return re.split(r"[.:]+", name)[1]
    m = re.match(r"^([A-Za-z0-9]+?)Backward\d*$", name)
    stem = m.group(1) if m else name
    return re.sub(r"(?<!^)(?=[A-Z])", "_", stem).lower()


# why each op makes a nan in the *forward* (where its value, not its derivative, is asked for), where that differs
_FORWARD_WHY = {
    "div": "0 is divided by 0 (or inf by inf)",
    "reciprocal": "its input is nan",
    "log": "its input is negative (at 0 it is -inf, and a -inf times 0 later is nan)",
    "log2": "its input is negative",
    "log10": "its input is negative",
    "sqrt": "its input is negative",
    "rsqrt": "its input is negative",
    "pow": "its base is negative with a fractional exponent",
    "acos": "its input is beyond +-1",
    "asin": "its input is beyond +-1",
}


def repair(name: str, phase: str = "backward", code: str | None = None) -> tuple[str, str, str]:
    """(what the op is, why it gives nan -- its value in the ``"forward"``, its derivative in the ``"backward"`` --,
    the usual repair) for a backward node or a forward op's name. ``code``: the user's line that called it; where it
    applies the op to one operand (``z.sqrt()``, ``torch.log(p)``), the repair is written with that name for ``x``."""
    base = op_base(name)
    found = _TABLE.get(base) or _TABLE.get(base.rstrip("_"))
    if found is not None:
        what, why, fix = found
        if phase == "forward":
            why = _FORWARD_WHY.get(base, why)
        used = operand(base, code) if code else None
        if used is not None and used != "x":
            fix = re.sub(r"\bx\b", used, fix)
        return what, why, fix
    return (f"the op {base}", "its derivative has no value at the point it was asked for",
            "look at that line's inputs where the mask or the data makes them 0, +-1 or inf, and give that op a safe "
            "input there")


_NAME = r"[A-Za-z_][\w.]*"


def operand(base: str, code: str) -> str | None:
    """The one name ``code`` applies the op ``base`` to -- ``z.sqrt()``, ``torch.sqrt(z)``, ``self.var.log()`` --, or
    None when it names none or several (the repair keeps its ``x``)."""
    names = set(re.findall(rf"({_NAME})\.{base}_?\(", code))
    names |= set(re.findall(rf"\b(?:torch|math|F)\.{base}\(\s*({_NAME})\s*[,)]", code))
    names.discard("torch")
    return names.pop() if len(names) == 1 else None
