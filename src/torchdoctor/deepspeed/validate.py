"""The walk over a config against DeepSpeed's tables: unknown keys, bad values, removed and deprecated keys.

How a value is read is :mod:`.values`. With ``recheck`` (a callable :mod:`.config_check` passes in: the whole
check) the walker checks each value a fix suggests by running the whole check again on the fixed config, and never
offers a rename that would make a config DeepSpeed accepts fail.
"""

from __future__ import annotations

from collections.abc import Callable, Iterator
from typing import Any

from ..findings import Finding
from .parse import edit
from .schema import Schema, Spec
from .values import _NO, _examples, _expect, _json_at, _judge, _lax_bool, _rm, _set, _show, _suggest, _with

# -- the walk over the config: unknown keys, bad values, removed and deprecated keys ------------------------------

_DEPRECATED_FIX = {
    "cpu_offload": '"zero_optimization": {"offload_optimizer": {"device": "cpu"}}',
    "cpu_offload_param": '"zero_optimization": {"offload_param": {"device": "cpu"}}',
    "cpu_offload_use_pin_memory": '"zero_optimization": {"offload_optimizer": {"device": "cpu", "pin_memory": true}}'
                                  ' (and the same "pin_memory" in "offload_param")',
}


# Where the value of a deprecated boolean moves (a device key set to "cpu"), for the fixes' edits.
_DEPRECATED_TARGET = {"cpu_offload": ("offload_optimizer", "device"), "cpu_offload_param": ("offload_param", "device")}


class _Walker:
    """Walks the config against the schema. With ``recheck`` (the whole check of a config, as a callable: it lives in
    :mod:`.config_check`, above this module), a value a fix suggests is one the whole check accepts at that key in this
    config (:meth:`_value_for`), not just one of the right type."""

    def __init__(self, sch: Schema, config: dict | None = None, for_: str = "deepspeed",
                 recheck: Callable[[dict], list[Finding]] | None = None) -> None:
        self.sch = sch
        self.root, self.for_, self.recheck = config, for_, recheck
        self._fails_now: set[str] | None = None  # the fail titles of the config as it is (for _breaks)
        self.findings: list[Finding] = []
        self.homes: dict[str, list[tuple[str, str]]] = {}  # lowercase key -> [(block, key as DeepSpeed spells it)]
        for block, specs in sch.blocks.items():
            for k, spec in specs.items():
                if spec.deprecated is None:
                    self.homes.setdefault(k.lower(), []).append((block, k))

    def walk(self, block: str, obj: dict, prefix: str, path: tuple = ()) -> None:
        specs = self.sch.blocks[block]
        removed = self.sch.removed.get(block, {})
        lax = block in self.sch.strict
        for raw_key, val in obj.items():
            key = str(raw_key)
            dotted = prefix + key
            if key in removed:
                self.findings.append(Finding(
                    "config.removed-key", "fail", f'"{dotted}" is no longer supported by DeepSpeed',
                    [removed[key].strip(), f"DeepSpeed {self.sch.version} refuses to start with it "
                                           "(DeepSpeedConfigError)."],
                    [f'remove "{dotted}" from the config'], {"key": dotted, "edits": [_rm((*path, raw_key))]}))
                continue
            spec = specs.get(key)
            if spec is None:
                self._unknown(block, key, dotted, val, prefix, obj, path)
                continue
            if isinstance(val, str) and val == "auto":
                continue  # judged by config.auto-outside-hf
            if block == "" and key == "zero_optimization" and isinstance(val, bool):
                self.findings.append(Finding(
                    "config.deprecated", "warn", f'"zero_optimization": {_show(val)} is the deprecated boolean form',
                    ["DeepSpeed reads true as ZeRO stage 1 and false as stage 0, and logs a deprecation warning."],
                    [f'write the block: "zero_optimization": {{"stage": {1 if val else 0}}}'],
                    {"key": dotted, "edits": [_set(("zero_optimization",), {"stage": 1 if val else 0})]}))
                continue
            if spec.deprecated is not None:
                self._deprecated(dotted, key, spec, val, prefix, lax, path)
            bad = _judge(spec, val, lax)
            if bad:
                self._bad(block, key, dotted, val, spec, *bad, path=(*path, raw_key))
                continue
            if spec.kind == "block" and isinstance(val, dict) and spec.ref in self.sch.blocks:
                self.walk(spec.ref, val, dotted + ".", (*path, raw_key))
        if block == "optimizer":
            self._optimizer(obj)
        elif block == "scheduler":
            self._scheduler(obj)

    def _value_for(self, path: tuple, dotted: str, candidates: list[Any]) -> Any:
        """The first candidate that, set at ``path``, leaves nothing to report at ``dotted`` (the first one when
        not rechecking); :data:`_NO` when none does."""
        if self.recheck is None or self.root is None:
            return candidates[0]
        for c in candidates:
            found = self.recheck(_with(self.root, path, c))
            if not any(f.severity in ("fail", "warn") and f.data.get("key") == dotted for f in found):
                return c
        return _NO

    def _moved(self, target: str, val: Any, path: tuple) -> tuple[Any, str]:
        """The value for a fix that renames or moves a key to ``target`` (``path``): the user's own when the target
        accepts it, else the nearest accepted one and a note saying why."""
        tspec = self._spec_at(target)
        if tspec is None or (isinstance(val, str) and val == "auto"):
            return val, ""
        lax = target.rpartition(".")[0] in self.sch.strict
        candidates = ([val] if _judge(tspec, val, lax) is None else []) + _examples(tspec, val, target)
        value = self._value_for(path, target, candidates)
        if value is _NO or (type(value) is type(val) and value == val):
            return val, ""
        return value, f"  ({_show(val)} is not accepted there: {_expect(tspec)})"

    def _unknown(self, block: str, key: str, dotted: str, val: Any, prefix: str, obj: dict, path: tuple) -> None:
        specs = self.sch.blocks[block]
        strict = block in self.sch.strict
        here = (*path, key)
        if key.startswith("_"):  # "_comment": the JSON-comment convention, never a misspelt key
            if strict:
                self.findings.append(Finding(
                    "config.unknown-key", "fail", f'"{dotted}" inside "{block}": DeepSpeed refuses comment keys there',
                    [f'A key starting with "_" is the usual JSON comment, and DeepSpeed ignores it at the top level; '
                     f'but "{block}" is validated by {self._model(block)}, which forbids unknown keys: '
                     'deepspeed.initialize() stops with "Extra inputs are not permitted".'],
                    [f'remove "{dotted}" (a "_comment" at the top level of the config is ignored)'],
                    {"key": dotted, "block": block, "suggestion": None, "edits": [_rm(here)]}))
            return  # elsewhere DeepSpeed never reads it: a comment, nothing to say
        current = [k for k, s in specs.items() if s.deprecated is None]
        rename = _suggest(key, current)
        homes = [(b, k) for b, k in self.homes.get(key.lower(), []) if b != block]
        title = f'unknown key "{dotted}"'
        fix: list[str] = []
        data: dict[str, Any] = {"key": dotted, "block": block or "(top level)"}
        target = None
        edits: list[dict[str, Any]] = []
        if rename is not None and (rename.lower() == key.lower() or not homes):
            target = prefix + rename
            title += f'; did you mean "{target}"?'
            if rename in obj:
                fix.append(f'"{target}" is set too ({_show(obj[rename])}): merge what you meant into it and remove '
                           f'"{dotted}"')
            else:
                value, note = self._moved(target, val, (*path, rename))
                fix.append(f"rename it: {_json_at(target, _show(value))}{note}")
                edits = [_rm(here), _set((*path, rename), value)]
        elif homes:
            home, real = homes[0]
            target = f"{home}.{real}" if home else real
            title += f'; it belongs in {"the top level" if not home else repr(home).replace(chr(39), chr(34))}'
            value, note = self._moved(target, val, tuple(target.split(".")))
            fix.append(f"move it: {_json_at(target, _show(value))}{note}")
            edits = [_rm(here), _set(tuple(target.split(".")), value)]
        else:
            fix.append(f'remove "{dotted}"' + (f' ("{block}" accepts: {", ".join(current)})'
                                                if block and len(current) <= 12 else ""))
            edits = [_rm(here)]
        broken = self._breaks(edits) if not strict and target else None
        if broken:  # DeepSpeed ignores the key today; the rename would make it refuse the config
            fix = [f'remove "{dotted}": renaming it to "{target}" would make the config fail ({broken})',
                   f'or rename it and settle that: {fix[0]}']
            edits = [_rm(here)]
        data["suggestion"] = target
        data["edits"] = edits
        if strict:
            evidence = [f'DeepSpeed validates "{block}" with {self._model(block)}, a pydantic model that forbids '
                        f'unknown keys: deepspeed.initialize() stops with "Extra inputs are not permitted".']
        elif block:
            evidence = [f'DeepSpeed reads only {", ".join(current)} in "{block}": this key is ignored.']
        else:
            evidence = ["DeepSpeed ignores unknown top-level keys without a warning: this setting has no effect."]
        if target and not strict:
            tspec = self._spec_at(target)
            if tspec is not None and tspec.kind == "block":
                evidence.append(f'So the run goes without your "{target}" settings (DeepSpeed uses its defaults).')
        self.findings.append(Finding("config.unknown-key", "fail" if strict else "warn", title, evidence, fix, data))

    def _breaks(self, edits: list[dict[str, Any]]) -> str | None:
        """The first fail the whole check finds in the config with ``edits`` applied that it does not find now
        (None when there is none, or when not rechecking): a fix must not turn an accepted config into a refused one."""
        if self.recheck is None or self.root is None or not edits:
            return None
        if self._fails_now is None:
            self._fails_now = {f.title for f in self.recheck(self.root) if f.severity == "fail"}
        for f in self.recheck(edit(self.root, edits)):
            if f.severity == "fail" and f.title not in self._fails_now:
                return f.title
        return None

    def _model(self, block: str) -> str:
        """The name of the pydantic model DeepSpeed validates ``block`` with (``CompileConfig``)."""
        where = self.sch.models.get(block, "")
        return where.rpartition(":")[2].rpartition(".")[2] or "a pydantic model"

    def _spec_at(self, dotted: str) -> Spec | None:
        block, _, key = dotted.rpartition(".")
        return self.sch.blocks.get(block, {}).get(key)

    def _deprecated(self, dotted: str, key: str, spec: Spec, val: Any, prefix: str, strict: bool,
                    path: tuple) -> None:
        new = spec.deprecated or ""
        title = f'"{dotted}" is deprecated' + (f'; use "{new}"' if new else "")
        here = (*path, key)
        edits: list[dict[str, Any]] = [_rm(here)]
        fix = None
        if key in _DEPRECATED_FIX:
            if _lax_bool(val) is True:
                fix = _DEPRECATED_FIX[key]
                target = _DEPRECATED_TARGET.get(key)
                edits = [_rm(here), _set((*path, *target), "cpu")] if target else []
            else:
                fix = f'remove "{dotted}" ({_show(val)} asks for nothing: it is the default)'
        elif new and " " not in new:
            value, note = self._moved(prefix + new, val, (*path, new))
            fix = f"rename it: {_json_at(prefix + new, _show(value))}{note}"
            edits = [_rm(here), _set((*path, new), value)]
        self.findings.append(Finding(
            "config.deprecated", "warn", title,
            ["DeepSpeed still maps it to its replacement and logs a deprecation warning; giving both is an error."
             if strict else f'DeepSpeed reads "{dotted}" only when "{new}" is absent.'],
            [fix or f'remove "{dotted}"'], {"key": dotted, "replacement": new or None, "edits": edits}))

    def _bad(self, block: str, key: str, dotted: str, val: Any, spec: Spec, severity: str, why: str,
             path: tuple) -> None:
        at, at_path, under = dotted, path, ""
        new = spec.deprecated
        if new and new in self.sch.blocks[block] and self.sch.blocks[block][new].deprecated is None:
            # a deprecated name: the fix sets the value under the current name (the rename finding says so too)
            at, at_path, under = dotted[: len(dotted) - len(key)] + new, (*path[:-1], new), " under its current name"
        example = self._value_for(at_path, at, _examples(spec, val, at))
        expect = _expect(spec)
        where = f'DeepSpeed validates "{block}" with a pydantic model: deepspeed.initialize() stops with an error'
        evidence = [f"{_show(val)} is {why}."]
        if severity == "fail" and block in self.sch.strict:
            evidence.append(where + ".")
        elif severity == "fail" and "as given" not in why:
            evidence.append("DeepSpeed uses values outside its config models as given, without conversion.")
        self.findings.append(Finding(
            "config.bad-value", severity, f"{dotted} = {_show(val)}: expected {expect}", evidence,
            [f"set it to {expect}{under}, e.g. {_json_at(at, _show(example))}" if example is not _NO
             else f'set it to {expect}{under} (no single value settles it here: see the other findings for "{at}")'],
            {"key": dotted, "value": val if isinstance(val, (str, int, float, bool, type(None))) else _show(val),
             "expected": expect,
             "edits": [] if example is _NO else ([_rm(path)] if at_path != path else []) + [_set(at_path, example)]}))

    def _optimizer(self, opt: dict) -> None:
        name = opt.get("type")
        if isinstance(name, str) and name != "auto":
            known = name.lower() in self.sch.optimizers or name in self.sch.torch_optimizers
            if not known and (self.sch.torch_optimizers or not name[:1].isupper()):
                cands = list(self.sch.optimizers) + list(self.sch.torch_optimizers)
                s = _suggest(name, cands)
                self.findings.append(Finding(
                    "config.bad-value", "fail",
                    f'optimizer.type = "{name}": not an optimizer DeepSpeed knows'
                    + (f'; did you mean "{s}"?' if s else ""),
                    [f"DeepSpeed accepts its own optimizers ({', '.join(self.sch.optimizers)}; any case) or a "
                     "torch.optim class name (exact case); otherwise it stops with "
                     f'"{name} is not a supported DeepSpeed Optimizer".'],
                    [f'"optimizer": {{"type": "{s or "AdamW"}"}}  (params unchanged)'],
                    {"key": "optimizer.type", "value": name, "suggestion": s,
                     "edits": [_set(("optimizer", "type"), s or "AdamW")]}))
        params = opt.get("params")
        if isinstance(params, dict) and "max_grad_norm" in params:
            clip = params["max_grad_norm"]
            self.findings.append(Finding(
                "config.bad-value", "fail", "optimizer.params.max_grad_norm is refused by DeepSpeed",
                ["DeepSpeed raises \"'max_grad_norm' is not supported as an optimizer parameter\": gradient clipping "
                 "is the top-level key gradient_clipping."],
                [f'remove optimizer.params.max_grad_norm and set "gradient_clipping": {_show(clip)}'],
                {"key": "optimizer.params.max_grad_norm",
                 "edits": [_rm(("optimizer", "params", "max_grad_norm")), _set(("gradient_clipping",), clip)]}))

    def _scheduler(self, sch_block: dict) -> None:
        name = sch_block.get("type")
        if not isinstance(name, str) or name == "auto":
            return
        if name not in self.sch.schedulers:
            ds_names = [n for n in self.sch.schedulers if n[:1].isupper()]
            s = _suggest(name, ds_names)
            self.findings.append(Finding(
                "config.bad-value", "fail",
                f'scheduler.type = "{name}": not a scheduler DeepSpeed knows' + (f'; did you mean "{s}"?' if s else ""),
                ["DeepSpeed looks the name up (exact case) in deepspeed.runtime.lr_schedules, then in "
                 f'torch.optim.lr_scheduler, and stops with "DeepSpeed does not recognize LR scheduler {name}".'],
                [f'"scheduler": {{"type": "{s or "WarmupLR"}", "params": {{...}}}}'],
                {"key": "scheduler.type", "value": name, "suggestion": s,
                 "edits": [_set(("scheduler", "type"), s)] if s else []}))
            return
        params = sch_block.get("params")
        required = self.sch.schedulers[name][1]
        needs = ", ".join(f'"{r}": ...' for r in required)
        if "params" not in sch_block or params is None:
            self.findings.append(Finding(
                "config.bad-value", "fail", f'scheduler "{name}" has no "params"',
                ["DeepSpeed builds the scheduler as Scheduler(optimizer, **params): without params that is a "
                 "TypeError at start."],
                [f'"scheduler": {{"type": "{name}", "params": {{{needs}}}}}'
                 + (f"  (fill in {', '.join(required)})" if required else "")], {"key": "scheduler.params"}))
            return
        if not isinstance(params, dict):
            return
        accepted, required = self.sch.schedulers[name]
        if not accepted:
            return  # **kwargs: anything goes
        for key in params:
            if key not in accepted:
                s = _suggest(str(key), list(accepted))
                self.findings.append(Finding(
                    "config.unknown-key", "fail",
                    f'unknown key "scheduler.params.{key}" for {name}' + (f'; did you mean "{s}"?' if s else ""),
                    [f"{name} takes {', '.join(accepted)}; DeepSpeed passes params as keyword arguments, so an "
                     "unknown one is a TypeError at start."],
                    [f"rename it: {_json_at(f'scheduler.params.{s}', _show(params[key]))}" if s
                     else f'remove "scheduler.params.{key}"'],
                    {"key": f"scheduler.params.{key}", "suggestion": s,
                     "edits": [_rm(("scheduler", "params", key))]
                     + ([_set(("scheduler", "params", s), params[key])] if s and s not in params else [])}))
        missing = [r for r in required if r not in params]
        if missing:
            self.findings.append(Finding(
                "config.bad-value", "fail", f"scheduler {name} needs {', '.join(missing)}",
                [f"{name}'s constructor has no default for {', '.join(missing)}: TypeError at start."],
                [", ".join(f'"{m}": ...' for m in missing) + ' in "scheduler.params"'
                 + (' (with the HF Trainer: "auto")' if "total_num_steps" in missing else "")],
                {"key": "scheduler.params", "missing": missing}))


def _autos(obj: Any, prefix: str = "") -> Iterator[str]:
    if isinstance(obj, dict):
        for k, v in obj.items():
            path = f"{prefix}{k}"
            if isinstance(v, str) and v == "auto":
                yield path
            else:
                yield from _autos(v, path + ".")
    elif isinstance(obj, list):
        for i, v in enumerate(obj):
            path = f"{prefix.rstrip('.')}[{i}]"
            if isinstance(v, str) and v == "auto":
                yield path
            else:
                yield from _autos(v, path + ".")

