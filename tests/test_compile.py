"""The monitor on compiled models: no graph break, no recompilation, and the first bad module still named.

Most cases compile with the ``aot_eager`` backend (Dynamo's graph capture and AOT autograd, as with
inductor, without generating C++), one with inductor itself. Graphs, breaks and recompilations are read
from Dynamo's own counters, bare run against monitored run, same steps.
"""

from __future__ import annotations

import pytest
import torch
from torch import nn
from torch._dynamo.utils import clear_compilation_metrics, counters, get_compilation_metrics

from conftest import Boom
from torchdoctor import NonFiniteError, NumericsMonitor
from torchdoctor.numerics.engines import MonitorWarning

pytestmark = pytest.mark.both_levels  # (conftest: once per watch level)

LEVELS = ("none", "params", "modules")
MODES = ("torch.compile", "model.compile", "per-layer")


class MLP(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        layers: list[nn.Module] = []
        for _ in range(3):
            layers += [nn.Linear(32, 32), nn.GELU()]
        self.body = nn.Sequential(*layers[:3], Boom(), *layers[3:], nn.Linear(32, 4))
        self.body[3].enabled = False

    def forward(self, x):
        return self.body(x)


def compiled(mode: str, backend: str = "aot_eager") -> tuple[nn.Module, nn.Module]:
    """(the model as built, what the training loop calls)."""
    torch.manual_seed(0)
    model = MLP()
    if mode == "torch.compile":
        return model, torch.compile(model, backend=backend)
    if mode == "model.compile":
        model.compile(backend=backend)
        return model, model
    for i, layer in enumerate(model.body):  # per layer, as torchtitan compiles each block
        if isinstance(layer, nn.Linear):
            model.body[i] = torch.compile(layer, backend=backend)
    return model, model


def inner(layer: nn.Module) -> nn.Module:
    return getattr(layer, "_orig_mod", layer)


def counts() -> tuple[int, int, int]:
    recompiles = [m for m in get_compilation_metrics() if m.recompile_reason]
    return counters["stats"]["unique_graphs"], sum(counters["graph_break"].values()), len(recompiles)


def train(mode: str, grads: str | None, steps: int = 5, bad: str | None = None, backend: str = "aot_eager"):
    """Run ``steps`` SGD steps (the last one bad when asked); return (graphs, breaks, recompiles), the error."""
    torch._dynamo.reset()
    counters.clear()
    clear_compilation_metrics()
    model, call = compiled(mode, backend)
    opt = torch.optim.SGD(model.parameters(), lr=1e-3)
    mon = NumericsMonitor(call, optimizer=opt, grads=grads) if grads is not None else None
    error = None
    g = torch.Generator().manual_seed(0)
    try:
        for step in range(steps):
            if step == steps - 1 and bad == "forward":
                with torch.no_grad():
                    inner(model.body[5]).weight.fill_(3e38)
            model.body[3].enabled = step == steps - 1 and bad == "backward"
            call(torch.randn(8, 32, generator=g)).pow(2).mean().backward()
            opt.step()
            opt.zero_grad()
    except NonFiniteError as e:
        error = e
    finally:
        if mon is not None:
            assert mon.step_index == (steps if error is None else steps - 1)
            mon.close()
    return counts(), error


@pytest.mark.parametrize("mode", MODES)
def test_the_monitor_adds_no_graph_break_and_no_recompilation(mode):
    bare, _ = train(mode, None)
    for grads in LEVELS:
        watched, error = train(mode, grads)
        assert error is None
        assert watched == bare, (grads, watched, bare)
    assert bare[1] == 0  # (per layer, the bare run already recompiles for Linears of other shapes: the same there)
    if mode != "per-layer":
        assert bare == (1, 0, 0)


@pytest.mark.parametrize("mode", MODES)
@pytest.mark.parametrize("grads", LEVELS)
def test_a_forward_overflow_inside_a_compiled_region_is_named(mode, grads):
    _, error = train(mode, grads, bad="forward")
    assert error is not None
    assert (error.first.module, error.first.cls, error.first.slot) == ("body.5", "Linear", "output")
    assert "eager replay of this micro-batch on the same inputs" in error.report
    assert error.details.replay == "reproduced"
    assert "_orig_mod" not in error.report


@pytest.mark.parametrize("mode", MODES)
def test_a_backward_blowup_inside_a_compiled_region_is_named_at_module_level(mode):
    _, error = train(mode, "modules", bad="backward")
    assert (error.first.module, error.first.cls, error.first.slot) == ("body.3", "Boom", "grad_input")
    assert "eager replay" in error.report  # (per layer too: at the default Boom's own hooks are not in place)
    # at "params" the step's check finds a parameter gradient; the replay goes from the kept gradient at the model's
    # output and names the module all the same
    _, error = train(mode, "params", bad="backward")
    assert (error.first.module, error.first.cls, error.first.slot) == ("body.3", "Boom", "grad_input")
    assert "grads='modules'" not in error.report


def test_inductor_graphs_stay_whole_and_the_module_is_named():
    bare, _ = train("torch.compile", None, steps=3, backend="inductor")
    watched, error = train("torch.compile", "params", steps=3, bad="forward", backend="inductor")
    assert watched == bare == (1, 0, 0)
    assert error.first.module == "body.5"


def test_dynamo_explain_sees_one_graph_with_the_monitor_attached():
    torch._dynamo.reset()
    model = MLP()
    with NumericsMonitor(model, grads="modules"):
        explained = torch._dynamo.explain(model)(torch.randn(8, 32))
    assert explained.graph_count == 1 and explained.graph_break_count == 0


def test_a_rerun_leaves_the_rng_as_the_compiled_run_left_it_and_buffers_as_before_the_step():
    def build():
        torch.manual_seed(0)
        return nn.Sequential(nn.Linear(8, 8), nn.BatchNorm1d(8), nn.Dropout(0.5), nn.Linear(8, 2))

    x = torch.randn(16, 8, generator=torch.Generator().manual_seed(1))
    after = {}
    for watched in (False, True):
        torch._dynamo.reset()
        model = build()
        with torch.no_grad():
            model[3].weight.fill_(3e38)
        call = torch.compile(model, backend="aot_eager")
        opt = torch.optim.SGD(model.parameters(), lr=0.1)
        mon = NumericsMonitor(call, optimizer=opt) if watched else None
        torch.manual_seed(123)
        before = [b.clone() for b in model.buffers()]
        try:
            call(x).sum().backward()
            if not watched:  # a detection restores the buffers to the step's start (issue 10, item 12)
                state = (*before, torch.get_rng_state())
            opt.step()
        except NonFiniteError as e:
            assert e.first.module == "3"
            state = (*[b.clone() for b in model.buffers()], torch.get_rng_state())
        after[watched] = state
        if mon is not None:
            mon.close()
    for a, b in zip(after[False], after[True]):
        assert torch.equal(a, b)  # the re-run's random draws undone; the BatchNorm update of the bad step too


def test_hooks_removed_on_close_and_compiled_call_restored():
    model = MLP()
    model.compile(backend="aot_eager")
    original = model._compiled_call_impl
    mon = NumericsMonitor(model)
    assert model._compiled_call_impl is not original
    mon.close()
    assert model._compiled_call_impl is original
    assert not any(m._forward_hooks or m._forward_pre_hooks for m in model.modules())


def test_compiled_after_attaching_is_said_or_caught_up():
    model = MLP()
    opt = torch.optim.SGD(model.parameters(), lr=1e-3)
    with NumericsMonitor(model, optimizer=opt) as mon:
        model.compile(backend="aot_eager")  # module.compile() after attaching: its edge is watched from the next step
        for _ in range(2):
            model(torch.randn(8, 32)).sum().backward()
            opt.step()
        assert mon._steps.history.records[-1].frames[-1].info.boundary
    torch._dynamo.reset()
    model = MLP()
    opt = torch.optim.SGD(model.parameters(), lr=1e-3)
    with NumericsMonitor(model, optimizer=opt):
        call = torch.compile(model, backend="aot_eager")  # a wrapper the monitor never sees: say so, once
        with pytest.warns(MonitorWarning, match=r"attach it to the compiled model"):
            call(torch.randn(8, 32)).sum().backward()
            opt.step()


@pytest.mark.parametrize("mode", ["torch.compile", "model.compile"])
def test_every_micro_batch_of_an_accumulated_step_is_watched(mode):
    torch._dynamo.reset()
    model, call = compiled(mode)
    opt = torch.optim.SGD(model.parameters(), lr=1e-3)
    with NumericsMonitor(call, optimizer=opt, grads="modules") as mon:
        with pytest.raises(NonFiniteError) as exc:
            for step in range(2):
                for micro in range(2):
                    x = torch.randn(4, 32)
                    if step == 1 and micro == 1:
                        x[3, 0] = float("inf")  # a sample the loss below leaves out: the gradients stay finite
                    call(x)[:3].pow(2).mean().backward()
                opt.step()
                opt.zero_grad()
        assert mon.step_index == 1
    assert (exc.value.first.module, exc.value.first.slot) == ("body.0", "output")
    assert "eager replay of micro-batch 2 of 2" in exc.value.report


def test_a_compiled_optimizer_step_gets_no_recompilation():
    def run(watched: bool):
        torch._dynamo.reset()
        counters.clear()
        clear_compilation_metrics()
        torch.manual_seed(0)
        model = nn.Sequential(nn.Linear(8, 16), nn.GELU(), nn.Linear(16, 4))
        opt = torch.optim.Adam(model.parameters(), lr=torch.tensor(1e-3))

        @torch.compile(backend="aot_eager")
        def opt_step():
            opt.step()

        mon = NumericsMonitor(model, optimizer=opt) if watched else None
        for _ in range(10):
            model(torch.randn(4, 8)).pow(2).mean().backward()
            opt_step()
            opt.zero_grad()
        if mon is not None:
            assert mon.step_index == 10
            mon.close()
        return counts()

    bare, watched = run(False), run(True)
    assert watched[0] == bare[0] and watched[2] == bare[2] == 0  # no graph and no recompilation per step
    assert watched[1] <= bare[1] + 1  # the monitor's check runs eagerly: at most one break where it is called


def test_model_compile_root_leaves_no_call_in_flight():
    model = MLP()
    model.compile(backend="aot_eager")
    with NumericsMonitor(model) as mon:
        for _ in range(3):
            model(torch.randn(2, 32))
            assert mon._recorder.root_depth == 0
        recorded = len(mon._recorder.rec.frames)
        with torch.no_grad():
            model.body[0](torch.randn(2, 32))  # a submodule alone under no_grad: not part of any step
        assert len(mon._recorder.rec.frames) == recorded


def test_region_names_look_through_wrappers():
    model = MLP()
    model.body[5] = torch.compile(model.body[5], backend="aot_eager")
    call = torch.compile(nn.DataParallel(model), backend="aot_eager")
    with NumericsMonitor(call) as mon:
        names = sorted((r.info.name, r.is_root) for r in mon._watched.regions.regions)
    assert names == [("", True), ("body.5", False)]
