"""The monitor's cost in dispatched ops, and the windowed statistics that keep it low (issue 12).

On an accelerator every dispatched op is host time and usually a kernel launch, so a launch-bound step pays for
each one: the monitor must stay under one extra op per hooked module at the default level. Counted on CPU with
``OpCounter`` (a dispatch mode); ``accelerator_path()`` makes CPU tensors take the path a GPU's take.
"""

from __future__ import annotations

import copy
import json
import math
from pathlib import Path

import pytest
import torch

from conftest import t5_batch, tiny_t5
from torchdoctor import NonFiniteError, NumericsMonitor
from torchdoctor.numerics.measure import windows as stats
from torchdoctor.numerics.measure.windows import StatBuffer, accelerator_path, lookup, window_reduce_works
from torchdoctor.numerics.record.frames import KEY, LABEL
from torchdoctor.syncs import OpCounter


def issue_t5():
    """The T5 of the issue's table: 4+4 layers, d_model 256, the real vocabulary."""
    from transformers import T5Config, T5ForConditionalGeneration

    torch.manual_seed(0)
    cfg = T5Config(d_model=256, d_ff=1024, num_layers=4, num_decoder_layers=4, num_heads=4, d_kv=64,
                   feed_forward_proj="gated-gelu", vocab_size=32128, decoder_start_token_id=0, pad_token_id=0)
    return T5ForConditionalGeneration(cfg).train()


def ops_per_step(base, batch, grads: str | None, watch: str = "every-module") -> tuple[int, int]:
    """(ops, host syncs) of the third training step of a fresh copy, bare (``grads=None``) or monitored."""
    model = copy.deepcopy(base)
    opt = torch.optim.SGD(model.parameters(), lr=1e-3)

    def step():
        model(**batch).loss.backward()
        opt.step()
        opt.zero_grad()

    mon = NumericsMonitor(model, optimizer=opt, grads=grads, watch=watch) if grads else None
    try:
        if mon:
            mon.__enter__()
        step()
        step()
        with OpCounter() as ops:
            step()
    finally:
        if mon:
            mon.__exit__(None, None, None)
    return ops.count, ops.syncs


@pytest.fixture(scope="module")
def t5_and_batch():
    g = torch.Generator().manual_seed(1)
    batch = {"input_ids": torch.randint(1, 32128, (4, 32), generator=g),
             "labels": torch.randint(1, 32128, (4, 16), generator=g)}
    return issue_t5(), batch


def test_accelerator_path_dispatches_under_one_op_per_module_on_the_issues_t5(t5_and_batch):
    base, batch = t5_and_batch
    modules = sum(1 for _ in base.modules())  # 199, every one hooked
    with accelerator_path():
        bare, bare_syncs = ops_per_step(base, batch, None)
        extra = {level: [x - y for x, y in zip(ops_per_step(base, batch, level), (bare, bare_syncs))]
                 for level in ("none", "params", "modules")}
    # was +583 / +785 / +1271 ops: three dispatches per measured tensor (detach, abs, aminmax)
    assert extra["params"][0] <= modules, extra
    assert extra["none"][0] <= modules, extra
    assert extra["modules"][0] <= 2 * modules, extra
    assert all(syncs <= 1 for _, syncs in extra.values()), extra


def test_cpu_path_on_small_tensors_stays_under_one_op_per_module():
    # the issue's host-cost T5 (d_model 32, 4+4 layers, vocab 128, batch 1, 8/8 tokens): every tensor small, so
    # the CPU's own path (tensors of one shape stacked) reduces them all in windows
    base = tiny_t5(num_layers=4, num_decoder_layers=4, vocab_size=128, feed_forward_proj="relu").train()
    batch = t5_batch(batch=1, src=8, tgt=8)
    modules = sum(1 for _ in base.modules())
    bare, _ = ops_per_step(base, batch, None)
    params, syncs = ops_per_step(base, batch, "params")
    assert params - bare <= modules
    assert syncs <= 1 + ops_per_step(base, batch, None)[1]


def _reference(t: torch.Tensor) -> tuple[float, float]:
    a = t.detach().double().abs()
    return a.min().item(), a.max().item()


@pytest.mark.parametrize("path", ["cpu", "accelerator"])
def test_windows_give_every_tensor_its_own_exact_statistics(path):
    assert window_reduce_works(torch.device("cpu"))
    g = torch.Generator().manual_seed(0)
    tensors = []
    for i in range(150):  # several windows, shapes repeated (stacked on CPU) and unique, dtypes mixed
        shape = [(3, 4), (7,), (2, 3, 5), ()][i % 4] if i % 5 else (i + 1,)
        dtype = [torch.float32, torch.float16, torch.bfloat16, torch.float64][i % 4]
        t = (torch.randn(shape, generator=g) * 10 ** (i % 7 - 3)).to(dtype)
        if i % 17 == 3:
            t.view(-1)[0] = float("nan")
        if i % 23 == 5 or i == 7:
            t.view(-1)[-1] = -float("inf")
        tensors.append(t)
    tensors += [torch.randn(50_000, generator=g), torch.arange(-5, 5), torch.tensor([True, False])]
    with accelerator_path() if path == "accelerator" else _nothing():
        buf = StatBuffer()
        refs = [buf.add(t) for t in tensors]
        values = buf.read()
    for t, ref in zip(tensors, refs):
        got, want = lookup(values, ref), _reference(t)
        for a, b in zip(got, want):
            assert (math.isnan(a) and math.isnan(b)) or a == pytest.approx(b, rel=1e-6), (t, got, want)


class _nothing:
    def __enter__(self):
        return self

    def __exit__(self, *exc):
        return False


def test_a_window_never_keeps_more_than_its_bound_alive():
    window_reduce_works(torch.device("cpu"))
    buf = StatBuffer()
    for _ in range(3 * stats.WINDOW_TENSORS):
        buf.add(torch.ones(8))
        group = next(iter(buf._groups.values()))
        assert len(group.pending) < stats.WINDOW_TENSORS
        assert group.pending_elements < stats.WINDOW_ELEMENTS


class CapturesBatchNorm(torch.nn.Module):
    """BatchNorm then ReLU(inplace=True): the ReLU changes the BatchNorm's output in place."""

    def __init__(self):
        super().__init__()
        self.lin = torch.nn.Linear(4, 4)
        self.bn = torch.nn.BatchNorm1d(4)
        self.act = torch.nn.ReLU(inplace=True)
        self.out = torch.nn.Linear(4, 1)

    def forward(self, x):
        return self.out(self.act(self.bn(self.lin(x))))


def test_an_output_changed_in_place_is_labelled_then_measured_at_once(tmp_path, monkeypatch):
    monkeypatch.chdir(tmp_path)
    torch.manual_seed(0)
    model = CapturesBatchNorm()
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    before_relu = []
    model.bn.register_forward_hook(lambda m, a, out: before_relu.append(out.detach().abs().max().item()))
    with NumericsMonitor(model, optimizer=opt, trace_steps=[0, 2]) as mon:
        for _ in range(3):
            model(torch.randn(8, 4)).sum().backward()
            opt.step()
            opt.zero_grad()
        assert mon._watched.infos[id(model.bn)].at_once and not mon._watched.infos[id(model.lin)].at_once
    trace = [json.loads(x) for x in Path("torchdoctor-trace-rank0.jsonl").read_text().splitlines()]
    bn = {f["step"]: f for f in trace if f["module"] == "bn" and f["phase"] == "fwd"}
    out0 = next(s for s in bn[0]["slots"] if s["slot"] == "output")
    assert out0.get("scope") == "measured after an in-place change"  # step 0: said, not hidden
    out2 = next(s for s in bn[2]["slots"] if s["slot"] == "output")
    assert "scope" not in out2 and out2["abs_max"] == pytest.approx(before_relu[2], rel=1e-6)


def test_a_nan_behind_an_in_place_relu_is_still_found_at_its_module():
    torch.manual_seed(0)
    model = CapturesBatchNorm()
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    with NumericsMonitor(model, optimizer=opt), pytest.raises(NonFiniteError) as exc:
        for step in range(3):
            x = torch.randn(8, 4)
            if step == 2:
                model.bn.weight.data[0] = float("inf")  # inf * 0-centred -> nan, and -inf that ReLU zeroes
            model(x).sum().backward()
            opt.step()
            opt.zero_grad()
    assert exc.value.first.module in ("bn", "lin") and exc.value.first.step == 2


def test_keyword_nones_are_not_lines_but_keyword_tensors_are(tmp_path, monkeypatch):
    monkeypatch.chdir(tmp_path)

    class Kw(torch.nn.Module):
        def forward(self, x, mask=None, bias=None, use_cache=False):
            return x * 2 + (bias if bias is not None else 0)

    model = Kw()
    with NumericsMonitor(model, trace_steps=[0]):
        model(torch.ones(2), mask=None, bias=torch.ones(2), use_cache=True)
    frame = json.loads(Path("torchdoctor-trace-rank0.jsonl").read_text().splitlines()[0])
    assert [s["slot"] for s in frame["slots"]] == ["input[0]", "input[bias]", "output"]


@pytest.mark.parametrize("path", ["cpu", "accelerator"])
def test_a_tensor_freed_while_it_waits_never_breaks_the_window(path):
    window_reduce_works(torch.device("cpu"))
    with accelerator_path() if path == "accelerator" else _nothing():
        buf = StatBuffer()
        kept = [torch.full((3, 4), float(i + 1)) for i in range(5)]
        freed = torch.ones(3, 4)
        refs = [buf.add(t) for t in kept[:2]] + [buf.add(freed)] + [buf.add(t) for t in kept[2:]]
        freed.untyped_storage().resize_(0)  # as an engine reusing a buffer would
        values = buf.read()
        flags = buf.finite_flags()
    assert refs[2][:2] in values.lost  # (group key, entry)
    assert [lookup(values, r) for i, r in enumerate(refs) if i != 2] == [(float(i + 1),) * 2 for i in range(5)]
    assert all(bool(f) for f in flags)  # no statistics is not "non-finite"


def test_a_freed_view_at_an_offset_is_lost_not_read():
    window_reduce_works(torch.device("cpu"))
    base = torch.randn(64)
    a, b = base[:16], base[16:32]  # b's data pointer is not null once the storage is freed: the storage's is
    buf = StatBuffer()
    refs = [buf.add(a), buf.add(b), buf.add(torch.full((4,), 2.0))]
    base.untyped_storage().resize_(0)  # as FSDP frees an unsharded flat parameter
    values = buf.read()
    assert {r[:2] for r in refs[:2]} <= values.lost and lookup(values, refs[2]) == (2.0, 2.0)


def test_the_loops_own_in_place_masking_after_the_forward_is_not_the_models_output():
    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Linear(8, 16), torch.nn.Tanh(), torch.nn.Linear(16, 5))
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    with NumericsMonitor(model, optimizer=opt) as mon:
        for _ in range(3):
            logits = model(torch.randn(4, 8))
            logits[:, 0] = float("-inf")  # banned tokens, outside the model: the loss stays finite
            torch.nn.functional.cross_entropy(logits, torch.randint(1, 5, (4,))).backward()
            opt.step()
            opt.zero_grad()
        assert mon.step_index == 3


class MasksAChildsOutput(torch.nn.Module):
    """The parent masks a child's output in place (attention scores -> -inf) before using it."""

    def __init__(self):
        super().__init__()
        self.score = torch.nn.Linear(4, 4)

    def forward(self, x):
        s = self.score(x)
        s.masked_fill_(torch.eye(4, dtype=torch.bool)[: len(x)], float("-inf"))
        return torch.softmax(s, -1).sum(-1, keepdim=True) * x


def test_an_in_place_mask_by_the_code_around_a_module_never_stops_the_run(tmp_path, monkeypatch):
    monkeypatch.chdir(tmp_path)
    torch.manual_seed(0)
    model = MasksAChildsOutput()
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    with NumericsMonitor(model, optimizer=opt, trace_steps=[0]) as mon:
        for _ in range(3):
            model(torch.randn(4, 4)).sum().backward()
            opt.step()
            opt.zero_grad()
        assert mon.step_index == 3 and mon._watched.infos[id(model.score)].at_once
    trace = [json.loads(x) for x in Path("torchdoctor-trace-rank0.jsonl").read_text().splitlines()]
    out = next(s for f in trace if f["module"] == "score" for s in f["slots"] if s["slot"] == "output")
    assert out["abs_max"] == "inf" and out["scope"] == "measured after an in-place change"  # shown, not judged


def test_quantized_and_functorch_values_never_raise_into_the_run():
    class Quant(torch.nn.Module):
        def __init__(self):
            super().__init__()
            self.lin = torch.nn.Linear(4, 4)
            self.q = torch.ao.nn.quantized.Quantize(0.1, 0, torch.quint8)

        def forward(self, x):
            y = self.lin(x)
            return self.q(y).dequantize().sum() + y.sum()

    model = Quant()
    with NumericsMonitor(model) as mon:
        for _ in range(2):
            model(torch.randn(3, 4)).backward()
            mon.step()
    from torch.func import functional_call, grad

    net = torch.nn.Sequential(torch.nn.Linear(4, 4), torch.nn.Tanh(), torch.nn.Linear(4, 1))
    params = {k: v.detach() for k, v in net.named_parameters()}
    with NumericsMonitor(net, grads="none") as mon:
        for _ in range(2):
            g = grad(lambda p, x: functional_call(net, p, (x.unsqueeze(0),)).sum())(params, torch.randn(4))
            mon.step()
    assert set(g) == set(params)


def test_compat_prints_an_output_as_returned_even_when_changed_in_place_later():
    import contextlib
    import io

    from transformers.debug_utils import DebugUnderflowOverflow as Theirs

    from torchdoctor.compat import DebugUnderflowOverflow as Ours

    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Linear(4, 4), torch.nn.ReLU(inplace=True), torch.nn.Linear(4, 2))
    x = torch.randn(3, 4)
    printed = {}
    for cls in (Theirs, Ours):
        m = copy.deepcopy(model)
        cls(m, trace_batch_nums=[0, 1])
        for call in range(2):
            buf = io.StringIO()
            with contextlib.redirect_stdout(buf):
                m(x)
            lines = buf.getvalue().splitlines()
            i = next(i for i, line in enumerate(lines) if line.strip() == "0 Linear")
            printed[cls, call] = [line for line in lines[i:i + 5] if "output" in line]
    assert printed[Ours, 0] == printed[Theirs, 0] and printed[Ours, 1] == printed[Theirs, 1]


def test_waiting_forward_calls_stay_bounded_and_in_order(tmp_path, monkeypatch):
    """Calls wait to be labelled together (StepRecord.defer); never more than CALLS_WAITING of them, nor more than a
    window's elements, and the trace still lists every call, in order, with its own numbers."""
    from torchdoctor.numerics.record.step import CALLS_WAITING

    monkeypatch.chdir(tmp_path)

    class Loop(torch.nn.Module):
        def __init__(self):
            super().__init__()
            self.lin = torch.nn.Linear(4, 4)
            self.big = torch.nn.Identity()

        def forward(self, x):
            for _ in range(3 * CALLS_WAITING):
                x = torch.tanh(self.lin(x))
            return self.big(torch.ones(stats.WINDOW_ELEMENTS)).sum() * 0 + x.sum()

    torch.manual_seed(0)
    model = Loop()
    waiting = []
    with NumericsMonitor(model, trace_steps=[0]) as mon:
        model.lin.register_forward_hook(lambda *a: waiting.append(len(mon._recorder.rec.calls)))
        model.big.register_forward_hook(lambda *a: waiting.append(mon._recorder.rec.call_elements))
        model(torch.randn(2, 4))
    assert max(waiting[:-1]) <= CALLS_WAITING and waiting[-1] < stats.WINDOW_ELEMENTS
    frames = [json.loads(x) for x in Path("torchdoctor-trace-rank0.jsonl").read_text().splitlines()]
    lins = [f for f in frames if f["module"] == "lin"]
    assert len(lins) == 3 * CALLS_WAITING
    # each call's input is the tanh of the previous call's output: its own numbers, never another call's
    for prev, cur in zip(lins, lins[1:]):
        out = next(s for s in prev["slots"] if s["slot"] == "output")
        inp = next(s for s in cur["slots"] if s["slot"] == "input[0]")
        assert inp["abs_max"] == pytest.approx(math.tanh(out["abs_max"]), rel=1e-5)


def test_module_level_gradient_hooks_see_what_tensor_hooks_see(tmp_path, monkeypatch):
    """grads='modules' catches each output's gradient with a tensor hook (a pre-hook of the node that made it would
    miss torch.autograd.grad w.r.t. that output, an unused output's None, and would run after the user's own tensor
    hooks): a node with two outputs of which one gets no gradient, and an output changed in place after the hook,
    give the gradients a tensor hook registered at the same point receives."""

    class Net(torch.nn.Module):
        def __init__(self, seen):
            super().__init__()
            self.lin = torch.nn.Linear(4, 8)
            self.split = Split(seen)
            self.act = torch.nn.Linear(4, 4)
            self.head = torch.nn.Linear(4, 1)
            self.seen = seen

        def forward(self, x):
            a, _unused = self.split(self.lin(x))
            y = self.act(a)
            y.register_hook(lambda g: self.seen.update(act=g.abs().max().item()))
            y.mul_(3.0)  # in place after the hooks: they see the gradient w.r.t. y before it
            return self.head(y).sum()

    class Split(torch.nn.Module):
        def __init__(self, seen):
            super().__init__()
            self.seen = seen

        def forward(self, x):
            a, b = x.chunk(2, dim=-1)
            a.register_hook(lambda g: self.seen.update(split0=g.abs().max().item()))
            return a, b

    monkeypatch.chdir(tmp_path)
    torch.manual_seed(0)
    seen: dict = {}
    model = Net(seen)
    with NumericsMonitor(model, grads="modules", trace_steps=[0]) as mon:
        model(torch.randn(2, 4)).backward()
        mon.step()
    lines = [json.loads(x) for x in Path("torchdoctor-trace-rank0.jsonl").read_text().splitlines()]
    bwd = {(f["module"], s["slot"]): s for f in lines if f["phase"] == "bwd" for s in f["slots"]}
    assert bwd[("act", "grad_output")]["abs_max"] == pytest.approx(seen["act"], rel=1e-6)
    assert bwd[("split", "grad_output[0]")]["abs_max"] == pytest.approx(seen["split0"], rel=1e-6)
    assert bwd[("split", "grad_output[1]")]["kind"] == "None"  # no gradient reaches the unused half: said so


def test_a_forward_in_another_thread_is_measured_in_its_hooks(tmp_path, monkeypatch):
    """nn.DataParallel runs its replicas' forwards in threads: calls wait only in the thread that made the record,
    so a call from another thread is labelled in its own hook and no queue is shared between threads."""
    import threading

    monkeypatch.chdir(tmp_path)
    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Linear(4, 4), torch.nn.Tanh(), torch.nn.Linear(4, 1))
    waiting = []
    with NumericsMonitor(model, trace_steps=[0, 1]) as mon:
        model[1].register_forward_hook(lambda *a: waiting.append(len(mon._recorder.rec.calls)))
        worker = threading.Thread(target=lambda: model(torch.randn(2, 4)).sum())
        worker.start()
        worker.join()
        model(torch.randn(2, 4))  # in the record's own thread the calls wait again
    assert waiting == [0, 2]
    frames = [json.loads(x) for x in Path("torchdoctor-trace-rank0.jsonl").read_text().splitlines()]
    assert len(frames) == 8 and all(s["abs_max"] is not None for f in frames for s in f["slots"])


def test_a_parameter_or_subclass_output_is_measured_before_the_code_after_it():
    """A Parameter or a tensor subclass returned by a module is measured at once (never in a window), so its call is
    labelled in its hook: the parent's masked_fill_(-inf) after the call (attention masking) is not that module's
    output, and a weight the loop sets to -inf after its module ran is blamed on the step that uses it."""

    class Tagged(torch.Tensor):
        pass

    class Scores(torch.nn.Module):
        def forward(self, q):
            return (q @ q.transpose(-1, -2)).as_subclass(Tagged)

    class Attn(torch.nn.Module):
        def __init__(self):
            super().__init__()
            self.scores = Scores()

        def forward(self, q):
            s = self.scores(q)
            s.masked_fill_(torch.ones_like(s, dtype=torch.bool).triu(1), float("-inf"))
            return torch.softmax(s.as_subclass(torch.Tensor), -1).sum()

    model = Attn()
    with NumericsMonitor(model):  # no NonFiniteError: the -inf is the parent's mask, after the call
        model(torch.randn(2, 4, 3))
        model(torch.randn(2, 4, 3))


def test_a_call_with_a_tensor_no_window_takes_is_measured_before_the_code_after_it():
    """On a CPU a tensor above the window's 4K elements is measured at once: its call is labelled in its hook, so an
    in-place change by the code after the module (here a ReLU over a -inf) can never hide the module's output."""

    class Wide(torch.nn.Module):
        def __init__(self):
            super().__init__()
            self.lin = torch.nn.Linear(8, 8192)
            self.act = torch.nn.ReLU(inplace=True)

        def forward(self, x):
            return self.act(self.lin(x)).sum()

    torch.manual_seed(0)
    model = Wide()
    waiting = []
    with pytest.raises(NonFiniteError) as exc, NumericsMonitor(model) as mon:
        model.lin.register_forward_hook(lambda *a: waiting.append(len(mon._recorder.rec.calls)))
        with torch.no_grad():
            model.lin.bias[0] = -float("inf")
        model(torch.randn(1, 8))
    assert waiting == [0]
    assert (exc.value.first.module, exc.value.first.slot) == ("lin", "output")


@pytest.mark.parametrize("grads", ["params", "modules"])
def test_a_steps_slots_are_left_untracked_by_the_garbage_collector(grads):
    """(Every module watched: a step at the default has a few slots, the model's own.)"""
    """Each labelled value of a step is a plain tuple of untracked values (issue 12): after one collection the
    collector no longer tracks any, so the ~450-650 slots a T5 step makes are never promoted to the old
    generations (promotions are what trigger full collections of the whole heap). A slot holding a fresh tuple
    (a nested StatRef) or a named tuple / dataclass would stay tracked: the collector walks parents first."""
    import gc

    model, batch = tiny_t5(), t5_batch()
    opt = torch.optim.SGD(model.parameters(), lr=1e-3)
    with NumericsMonitor(model, optimizer=opt, grads=grads, watch="every-module") as mon:
        for _ in range(2):
            model(**batch).loss.backward()
            opt.step()
            opt.zero_grad()
        model(**batch).loss.backward()
        mon._recorder.rec.settle()
        slots = [s for f in mon._recorder.rec.frames for s in f.slots]
        kept = [s for rec in mon._steps.history.records for f in rec.frames for s in (*f.slots, *(f.weights or ()))]
        gc.collect()
        tracked = [s for s in slots + kept if gc.is_tracked(s)]
        opt.step()
    assert len(slots) > 100 and len(kept) > 20
    assert sum(s[KEY] is not None for s in slots) > 50  # (measured ones among them, not only None slots)
    assert tracked == []
    if grads == "modules":
        assert any(s[LABEL].startswith("grad_output") for s in slots)


@pytest.mark.parametrize("grads", ["none", "params", "modules"])
def test_a_step_watched_at_its_boundaries_dispatches_a_few_ops_whatever_the_model(t5_and_batch, grads):
    """At the default (``watch="boundaries"``) a healthy step costs what its boundaries cost: the model's inputs and
    outputs, the gradient check, the buffers' copy -- a count that does not grow with the modules (measured: +26 /
    +45 / +53 ops at "none" / "params" / "modules" on the tiny T5, +71 at "modules" on this one with 199 modules;
    about one per module and more when every module is watched), and one host sync."""
    base, batch = t5_and_batch
    small = tiny_t5(num_layers=2, num_decoder_layers=2, vocab_size=128, feed_forward_proj="relu").train()
    small_batch = t5_batch(batch=1, src=8, tgt=8)
    with accelerator_path():
        for model, data in ((base, batch), (small, small_batch)):
            bare, bare_syncs = ops_per_step(model, data, None)
            ops, syncs = ops_per_step(model, data, grads, watch="boundaries")
            assert ops - bare <= 80, (ops - bare, grads)
            assert syncs - bare_syncs <= 1
