"""The invalid-op table: op names as autograd's anomaly mode and the dispatcher write them, and repairs written with
the operand of the user's own line."""

from __future__ import annotations

import pytest

from torchdoctor.numerics.explain.invalid_ops import op_base, operand, repair


@pytest.mark.parametrize(("name", "base"), [("DivBackward0", "div"), ("aten.div.Tensor", "div"),
                                            ("aten::sqrt", "sqrt"), ("LinalgVectorNormBackward0", "linalg_vector_norm"),
                                            ("SqrtBackward0", "sqrt")])
def test_op_names_from_both_sides_meet(name, base):
    assert op_base(name) == base


@pytest.mark.parametrize(("base", "code", "name"), [
    ("sqrt", "z = torch.where(z > 0, z.sqrt(), torch.zeros_like(z))", "z"),
    ("sqrt", "out = torch.sqrt(var) * w", "var"),
    ("sqrt", "self.running.sqrt_()", "self.running"),
    ("log", "loss = -torch.log(p[idx])", None),  # (an indexed operand: not one name)
    ("log", "a.log() + b.log()", None),  # two operands: the repair keeps its x
    ("log", "y = x + 1", None),
])
def test_the_operand_of_the_users_line(base, code, name):
    assert operand(base, code) == name


def test_a_repair_names_the_users_operand_and_only_where_it_is_one():
    what, why, fix = repair("aten.sqrt.default", "forward", "h = torch.where(h > 0, h.sqrt(), 0)")
    assert (what, why) == ("a square root", "its input is negative")
    assert fix == "(h + eps).sqrt() or h.clamp_min(eps).sqrt()"
    assert repair("SqrtBackward0", "backward")[2] == "(x + eps).sqrt() or x.clamp_min(eps).sqrt()"
    assert "its input is 0" in repair("SqrtBackward0", "backward")[1]  # the derivative at 0, in the backward
    # an op outside the table: a generic repair, never an invented one
    assert repair("CumprodBackward0")[0] == "the op cumprod"
