"""The programs of the real-program matrix (benchmarks/real_programs.py), as data: how each public training
program is copied from its checkout, patched (one line's text and what it becomes) and started at a tiny size on
CPU, and the faults put into it (the injector written next to its driver, driven by $TDFAULT).

Nothing here runs a program or judges a verdict; real_programs.py does both.
"""

from __future__ import annotations

import os
import re
import shutil
import subprocess
import sys
from dataclasses import dataclass, field

# A largest weight of 3e4 fits fp16 (6.55e4) but the sum of products it enters does not.
WEIGHT_MAX = 3e4

# --- the fault injector, written next to the drivers (driven by $TDFAULT, JSON) ----------------------------
TDFAULT = r'''
"""Fault injection for the real-program matrix; $TDFAULT (JSON) says what to do."""
import atexit, gc, json, math, os, sys
import torch

SPEC = json.loads(os.environ.get("TDFAULT") or "{}")
_MAIN_PID = os.getpid()
_st = {"owner": None, "target": None, "count": 0, "scaled": False, "fixed": False, "updates": 0, "fetch": 0}


def _owner():
    if _st["owner"] is None and SPEC.get("owner"):
        for obj in gc.get_objects():
            try:
                if isinstance(obj, torch.nn.Module) and type(obj).__name__ == SPEC["owner"]:
                    _st["owner"] = obj
                    break
            except ReferenceError:
                continue
    return _st["owner"]


_MONITOR_RERUN = os.sep + os.path.join("torchdoctor", "numerics", "judge") + os.sep


def _monitor_rerun() -> bool:
    """Is this forward one the monitor runs again (a replay, a skipped step checked in fp32, a fix check)? It is no
    training forward: counting it would inject the fault a step early."""
    f = sys._getframe(2)
    while f is not None:
        if _MONITOR_RERUN in f.f_code.co_filename:
            return True
        f = f.f_back
    return False


def _pre_hook(module, args):
    if not (module.training and torch.is_grad_enabled()) or os.getpid() != _MAIN_PID:
        return None
    owner = _owner()
    if owner is None:
        return None
    if SPEC.get("keep_fp32") and not _st["fixed"] and os.getpid() == _MAIN_PID:
        import torchdoctor
        _st["fixed"] = True
        for region in SPEC["keep_fp32"]:
            try:
                torchdoctor.keep_fp32(owner, region)
                print("[tdfault] applied keep_fp32", region, flush=True)
            except ValueError as e:
                # as a user would: the printed name is a wrapper's path; keep_fp32's error lists close names
                print(f"[tdfault] keep_fp32 as printed does not apply to {type(owner).__name__}: {e}", flush=True)
                parts = region.split(".")
                for i in range(1, len(parts)):
                    try:
                        torchdoctor.keep_fp32(owner, ".".join(parts[i:]))
                    except ValueError:
                        continue
                    print("[tdfault] applied keep_fp32 (prefix dropped)", ".".join(parts[i:]), flush=True)
                    break
    if SPEC.get("scale") and _st["target"] is None:
        _st["target"] = owner.get_submodule(SPEC["scale"])
    if module is _st["target"] and not _monitor_rerun():
        if _st["count"] == SPEC.get("step", 0) and not _st["scaled"]:
            w = module.weight
            with torch.no_grad():
                factor = float(SPEC["to_max"]) / float(w.detach().abs().max())
                w.mul_(factor)
            _st["scaled"] = True
            print(f"[tdfault] scaled {SPEC['scale']}.weight by {factor:.3g} (abs max now {SPEC['to_max']:.3g}) "
                  f"before training forward {_st['count']}", flush=True)
        _st["count"] += 1
    return None


def _post_step(opt, args, kwargs):
    _st["updates"] += 1


def nan_if_due(x):
    """The batch path calls this for each training sample/batch fetched (not during evaluation)."""
    if not (torch.is_grad_enabled() and not torch.is_inference_mode_enabled()):
        return x
    i = _st["fetch"]
    _st["fetch"] += 1
    if SPEC.get("nan_at") is not None and i == SPEC["nan_at"]:
        x = x.clone()
        x.view(-1)[0] = float("nan")
        print(f"[tdfault] NaN put in training batch/sample {i}", flush=True)
    return x


def sqrt_relu(x):  # the activation of the hf case (its model code is not patched)
    """An activation a user wrote (the invalid op: sqrt of the negatives, in the branch not taken)."""
    if SPEC.get("repaired"):
        return torch.where(x > 0, x.clamp_min(1e-12).sqrt(), torch.zeros_like(x))
    return torch.where(x > 0, x.sqrt(), torch.zeros_like(x))


def _summary():
    owner = _st["owner"]
    finite = None
    if owner is not None:
        finite = all(bool(torch.isfinite(p.detach()).all()) for p in owner.parameters())
    print("[tdfault] summary " + json.dumps({"updates": _st["updates"], "params_finite": finite}), flush=True)


if SPEC:
    torch.nn.modules.module.register_module_forward_pre_hook(_pre_hook)
    from torch.optim.optimizer import register_optimizer_step_post_hook
    register_optimizer_step_post_hook(_post_step)
    atexit.register(_summary)
'''

# The torchvision wheel on PyPI is a CUDA build; on a CPU-only torch its C ops do not load and its
# import registers fake kernels for two ops that then do not exist. Defining their schemas (never
# called here) lets the pure-Python parts (transforms, datasets) import.
TVSHIM = r'''
import torch
try:
    torch.ops.torchvision.nms
except (AttributeError, RuntimeError):
    _lib = torch.library.Library("torchvision", "DEF")
    _lib.define("nms(Tensor dets, Tensor scores, float iou_threshold) -> Tensor")
    _lib.define("qnms(Tensor dets, Tensor scores, float iou_threshold) -> Tensor")
'''

RUNPY_DRIVER = r'''
import os, runpy, sys
here = os.path.dirname(os.path.abspath(__file__))
sys.path.insert(0, here)
import tvshim, tdfault  # noqa: F401,E401
os.chdir(os.path.join(here, "src"))
sys.path.insert(0, os.getcwd())
sys.argv = [{script!r}] + sys.argv[1:]
runpy.run_path({script!r}, run_name="__main__")
'''


# The invalid op, written into one line of the program's model, and its usual repair (a safe value in the
# branch that is not taken).
SQRT = "torch.where({v} > 0, {v}.sqrt(), torch.zeros_like({v}))"
SQRT_REPAIRED = "torch.where({v} > 0, {v}.clamp_min(1e-12).sqrt(), torch.zeros_like({v}))"
VARIANTS = ("plain", "invalid", "repaired")


def variant_of(case) -> str:
    if not case.flags.get("invalid_op"):
        return "plain"
    return "repaired" if case.flags.get("repaired") else "invalid"


@dataclass
class Patch:
    """Replace the `nth` occurrence (1-based) of one line's text in `path` (relative to the copy)."""
    path: str
    old: str
    new: str
    nth: int = 1

    def apply(self, root: str) -> None:
        full = os.path.join(root, self.path)
        with open(full) as f:
            text = f.read()
        start = -1
        for _ in range(self.nth):
            start = text.find(self.old, start + 1)
            if start < 0:
                raise SystemExit(f"patch: {self.old!r} not found {self.nth} time(s) in {self.path}: "
                                 "this checkout differs from the one the patch was written for")
        with open(full, "w") as f:
            f.write(text[:start] + self.new + text[start + len(self.old):])


@dataclass
class Case:
    name: str
    fault: dict = field(default_factory=dict)   # $TDFAULT
    flags: dict = field(default_factory=dict)   # program-specific switches (precision, patched copy)
    expect: dict = field(default_factory=dict)  # step, phase, modules, cause, fix_check; {} = silent


class Program:
    name = ""
    owner = ""
    needs_checkout = True

    def __init__(self, checkout: str, work: str, extra_path: list[str]):
        self.checkout, self.work, self.extra_path = checkout, work, extra_path

    def commit(self) -> str:
        try:
            return subprocess.run(["git", "-C", self.checkout, "rev-parse", "HEAD"], capture_output=True,
                                  text=True, timeout=30).stdout.strip() or "?"
        except (OSError, subprocess.SubprocessError):
            return "?"

    def write_common(self, d: str) -> None:
        for name, text in (("tdfault.py", TDFAULT), ("tvshim.py", TVSHIM)):
            with open(os.path.join(d, name), "w") as f:
                f.write(text)

    def env(self) -> dict:
        env = dict(os.environ)
        env["PYTHONPATH"] = os.pathsep.join(self.extra_path + [p for p in [env.get("PYTHONPATH")] if p])
        env["PYTHONUNBUFFERED"] = "1"
        return env

    def setup(self) -> None: ...
    def cases(self) -> list[Case]: ...
    def command(self, case: Case, variant: str) -> list[str]: ...
    def fix_flags(self, fix: str, case: Case) -> dict | None:
        """Flags/fault for a second run that applies the printed fix; None where it cannot be applied."""
        fix = fix or ""
        regions = re.findall(r"keep_fp32\(model, '([^']*)'\)", fix)
        if regions:
            return {"fault": dict(case.fault, keep_fp32=regions), "flags": dict(case.flags)}
        repair = re.search(r"torch\.where|clamp|eps", fix)
        if re.search(r"\bbf16\b|bfloat16", fix) and not repair:
            return {"fault": dict(case.fault), "flags": dict(case.flags, bf16=True)}
        if repair and (case.fault.get("sqrt_relu") or case.flags.get("invalid_op")):
            return {"fault": dict(case.fault, repaired=True), "flags": dict(case.flags, repaired=True)}
        return None


# --- nanoGPT ---------------------------------------------------------------------------------------------
class NanoGPT(Program):
    name = "nanogpt"
    owner = "GPT"
    target = "transformer.h.0.mlp.c_fc"
    # train.py runs CPU without autocast and builds torch.cuda.amp.GradScaler (disabled off CUDA): these two
    # lines give it on CPU the recipe it runs on a GPU with dtype=float16 (autocast + GradScaler).
    fp16_cpu = [
        Patch("train.py", "ctx = nullcontext() if device_type == 'cpu' else torch.amp.autocast(",
              "ctx = torch.amp.autocast("),
        Patch("train.py", "scaler = torch.cuda.amp.GradScaler(enabled=",
              "scaler = torch.amp.GradScaler(device_type, enabled="),
    ]
    @staticmethod
    def invalid(variant):
        expr = SQRT_REPAIRED if variant == "repaired" else SQRT
        return [Patch("model.py", "x = self.gelu(x)", "x = " + expr.format(v="x"))] if variant != "plain" else []

    def setup(self):
        import numpy as np
        for variant in VARIANTS:
            d = os.path.join(self.work, variant)
            os.makedirs(os.path.join(d, "src", "data_tiny"))
            self.write_common(d)
            for f in ("train.py", "model.py", "configurator.py"):
                shutil.copy(os.path.join(self.checkout, f), os.path.join(d, "src", f))
            for p in self.fp16_cpu + self.invalid(variant):
                p.apply(os.path.join(d, "src"))
            rng = np.random.default_rng(0)
            for split in ("train", "val"):
                rng.integers(0, 65, 20000).astype(np.uint16).tofile(os.path.join(d, "src", "data_tiny",
                                                                                  f"{split}.bin"))
            import pickle
            with open(os.path.join(d, "src", "data_tiny", "meta.pkl"), "wb") as f:
                pickle.dump({"vocab_size": 65}, f)
            with open(os.path.join(d, "drive.py"), "w") as f:
                f.write(RUNPY_DRIVER.format(script="train.py"))

    def cases(self):
        ov = {"phase": "forward", "modules": [self.target], "cause": "overflow", "fix_check": "fixed"}
        return [
            Case("a0", {"owner": self.owner, "scale": self.target, "to_max": WEIGHT_MAX, "step": 0},
                 expect=dict(ov, step=0)),
            Case("a3", {"owner": self.owner, "scale": self.target, "to_max": WEIGHT_MAX, "step": 3},
                 expect=dict(ov, step=3)),
            Case("c0", {"owner": self.owner}, {"invalid_op": True},
                 expect={"step": 0, "phase": "backward", "modules": ["transformer.h.1.mlp", "transformer.h.0.mlp"],
                         "cause": "invalid", "fix_check": "not checked", "op": "sqrt"}),
            Case("d", {"owner": self.owner}),
        ]

    def command(self, case, variant=""):
        d = os.path.join(self.work, variant_of(case))
        dtype = "bfloat16" if case.flags.get("bf16") else "float16"
        return [sys.executable, os.path.join(d, "drive.py"), "--device=cpu", "--compile=False",
                f"--dtype={dtype}", f"--dataset={os.path.join(d, 'src', 'data_tiny')}", "--n_layer=2",
                "--n_head=2", "--n_embd=64", "--block_size=32", "--batch_size=4",
                "--gradient_accumulation_steps=1", "--max_iters=6", "--eval_interval=1000", "--eval_iters=1",
                f"--out_dir={os.path.join(self.work, 'out')}", "--warmup_iters=0", "--learning_rate=1e-3",
                "--always_save_checkpoint=False"]


# --- timm ------------------------------------------------------------------------------------------------
class Timm(Program):
    name = "timm"
    owner = "ResNet"
    target = "layer2.0.conv1"
    # train.py makes its loss scaler (NativeScaler: a GradScaler) only on CUDA; on CPU it trains fp16 autocast
    # without one. This line gives it the GPU recipe (autocast fp16 + GradScaler).
    scaler_cpu = Patch("train.py", "if device.type in ('cuda',) and amp_dtype == torch.float16:",
                       "if device.type in ('cuda', 'cpu') and amp_dtype == torch.float16:")
    @staticmethod
    def invalid(variant):
        expr = SQRT_REPAIRED if variant == "repaired" else SQRT
        # the first occurrence is BasicBlock.forward (test_resnet's block)
        return [Patch("timm/models/resnet.py", "x = self.act1(x)", "x = " + expr.format(v="x"))] \
            if variant != "plain" else []
    # The training loader's batches pass through tdfault.nan_if_due (the NaN batch).
    loader = r'''
import timm.data
_create_loader = timm.data.create_loader
class _Loader:
    def __init__(self, inner): self._inner = inner
    def __getattr__(self, k): return getattr(self._inner, k)
    def __len__(self): return len(self._inner)
    def __iter__(self):
        for x, y in self._inner:
            yield tdfault.nan_if_due(x), y
def create_loader(*a, **kw):
    loader = _create_loader(*a, **kw)
    return _Loader(loader) if kw.get("is_training") else loader
timm.data.create_loader = create_loader
'''

    def setup(self):
        import numpy as np
        from PIL import Image
        for variant in VARIANTS:
            d = os.path.join(self.work, variant)
            os.makedirs(os.path.join(d, "src"))
            self.write_common(d)
            shutil.copy(os.path.join(self.checkout, "train.py"), os.path.join(d, "src", "train.py"))
            shutil.copytree(os.path.join(self.checkout, "timm"), os.path.join(d, "src", "timm"))
            self.scaler_cpu.apply(os.path.join(d, "src"))
            for p in self.invalid(variant):
                p.apply(os.path.join(d, "src"))
            driver = RUNPY_DRIVER.format(script="train.py")
            driver = driver.replace("sys.argv = ", "sys.path.insert(0, os.getcwd())\n" + self.loader + "sys.argv = ")
            with open(os.path.join(d, "drive.py"), "w") as f:
                f.write(driver)
        rng = np.random.default_rng(0)
        for split, n in (("train", 16), ("validation", 4)):
            for c in ("a", "b"):
                os.makedirs(os.path.join(self.work, "data", split, c))
                for i in range(n):
                    Image.fromarray(rng.integers(0, 255, (32, 32, 3), dtype=np.uint8)).save(
                        os.path.join(self.work, "data", split, c, f"{i}.png"))

    def cases(self):
        # train.py's task (ClassificationTask, the module the monitor watches) computes the loss itself
        ov = {"phase": "forward", "modules": [self.target], "cause": "overflow", "fix_check": "fixed",
              "loss_inside": True}
        data = {"phase": "forward", "modules": ["conv1.0", "(input)"], "cause": "data"}
        sc = {"owner": self.owner, "scale": self.target, "to_max": WEIGHT_MAX}
        return [
            Case("a0", dict(sc, step=0), expect=dict(ov, step=0)),
            Case("a3", dict(sc, step=3), expect=dict(ov, step=3)),
            Case("b0", {"owner": self.owner, "nan_at": 0}, expect=dict(data, step=0)),
            Case("b3", {"owner": self.owner, "nan_at": 3}, expect=dict(data, step=3)),
            Case("c0", {"owner": self.owner}, {"invalid_op": True},
                 expect={"step": 0, "phase": "backward", "modules": ["layer4.0", "layer3.0", "layer2.0",
                                                                     "layer1.0"],
                         "cause": "invalid", "fix_check": "not checked", "op": "sqrt"}),
            Case("d", {"owner": self.owner}),
        ]

    def command(self, case, variant=""):
        d = os.path.join(self.work, variant_of(case))
        dtype = "bfloat16" if case.flags.get("bf16") else "float16"
        return [sys.executable, os.path.join(d, "drive.py"), "--data-dir", os.path.join(self.work, "data"),
                "--model", "test_resnet", "--num-classes", "2", "--img-size", "32", "-b", "4", "--epochs", "1",
                "--device", "cpu", "--amp", "--amp-dtype", dtype, "-j", "1", "--no-prefetcher", "--output",
                os.path.join(self.work, "out"), "--log-interval", "1", "--warmup-epochs", "0", "--lr", "0.01",
                "--opt", "sgd", "--sched", "cosine"]


# --- Lightning: the README's LitAutoEncoder ----------------------------------------------------------------
class LightningReadme(Program):
    name = "lightning"
    owner = "LitAutoEncoder"
    target = "encoder.0"
    # The README's data is MNIST, downloaded; here a random dataset of the same shape, whose training
    # samples pass through tdfault.nan_if_due; its Trainer() gets a size, a CPU and fp16: 16-mixed (autocast and
    # a GradScaler) or 16-true (the model in fp16).
    patches = [
        Patch("main.py", 'dataset = tv.datasets.MNIST(".", download=True, transform=tv.transforms.ToTensor())',
              "dataset = __import__('tdfault_data').MnistLike(64)"),
        Patch("main.py", "data.random_split(dataset, [55000, 5000])",
              "data.random_split(dataset, [56, 8], generator=torch.Generator().manual_seed(0))"),
        Patch("main.py", "trainer = L.Trainer()", "trainer = L.Trainer(**__import__('tdfault_data').trainer_kwargs())"),
    ]
    @staticmethod
    def invalid(variant):
        expr = SQRT_REPAIRED if variant == "repaired" else SQRT
        return [Patch("main.py", "z = self.encoder(x)\n",
                      "z = self.encoder(x)\n        z = " + expr.format(v="z") + "\n")] if variant != "plain" else []
    data = r'''
import os, torch, tdfault
class MnistLike(torch.utils.data.Dataset):
    def __init__(self, n):
        g = torch.Generator().manual_seed(0)
        self.x = torch.rand(n, 1, 28, 28, generator=g)
    def __len__(self): return len(self.x)
    def __getitem__(self, i): return tdfault.nan_if_due(self.x[i]), 0
def trainer_kwargs():
    kw = dict(max_steps=6, accelerator="cpu", logger=False, enable_checkpointing=False, enable_progress_bar=False)
    precision = os.environ.get("TD_PRECISION", "16-mixed")
    if precision == "16-mixed":
        # precision="16-mixed" becomes bf16-mixed on a CPU; its plugin, given, is the GPU recipe
        from lightning.pytorch.plugins import MixedPrecision
        kw["plugins"] = [MixedPrecision("16-mixed", "cpu", torch.amp.GradScaler("cpu"))]
    else:
        kw["precision"] = precision
    if os.environ.get("TD_API"):
        from torchdoctor import LightningNumericsCallback
        kw["callbacks"] = [LightningNumericsCallback()]
    return kw
'''

    def readme_example(self) -> str:
        with open(os.path.join(self.checkout, "README.md")) as f:
            text = f.read()
        for block in re.findall(r"```python\n(.*?)```", text, re.S):
            if "class LitAutoEncoder" in block:
                return block
        raise SystemExit("lightning: no ```python block with class LitAutoEncoder in README.md")

    def setup(self):
        code = self.readme_example()
        for variant in VARIANTS:
            d = os.path.join(self.work, variant)
            os.makedirs(os.path.join(d, "src"))
            self.write_common(d)
            with open(os.path.join(d, "src", "main.py"), "w") as f:
                f.write(code)
            for p in self.patches + self.invalid(variant):
                p.apply(os.path.join(d, "src"))
            with open(os.path.join(d, "tdfault_data.py"), "w") as f:
                f.write(self.data)
            with open(os.path.join(d, "drive.py"), "w") as f:
                f.write(RUNPY_DRIVER.format(script="main.py"))

    def cases(self):
        ov = {"phase": "forward", "modules": [self.target], "cause": "overflow", "fix_check": "fixed"}
        data = {"phase": "forward", "modules": ["encoder.0", "encoder", "(input)"], "cause": "data"}
        sc = {"owner": self.owner, "scale": self.target, "to_max": WEIGHT_MAX}
        return [
            Case("a0", dict(sc, step=0), expect=dict(ov, step=0)),
            Case("a3", dict(sc, step=3), expect=dict(ov, step=3)),
            Case("b0", {"owner": self.owner, "nan_at": 0}, expect=dict(data, step=0)),
            Case("b3", {"owner": self.owner, "nan_at": 3}, expect=dict(data, step=3)),
            Case("c0", {"owner": self.owner}, {"invalid_op": True},
                 expect={"step": 0, "phase": "backward", "modules": ["", "encoder.2", "decoder.0"],
                         "cause": "invalid", "fix_check": "not checked", "op": "sqrt"}),
            Case("d", {"owner": self.owner}),
            # the README's own Adam (eps=1e-8) on fp16 weights: its first update (step 0's) makes weights nan by
            # itself. (Until the update was tried on a copy before it is applied, the best verdict there could be was
            # step 1's forward, and that was the expectation: the fault itself is step 0's update.)
            Case("t16", {"owner": self.owner}, {"precision": "16-true"},
                 expect={"step": 0, "phase": "update", "modules": ["encoder.0"], "cause": "update"}),
        ]

    def command(self, case, variant=""):
        return [sys.executable, os.path.join(self.work, variant_of(case), "drive.py")]

    def case_env(self, case, variant):
        precision = case.flags.get("precision", "16-mixed")
        if case.flags.get("bf16"):
            precision = "bf16-true" if precision == "16-true" else "bf16-mixed"
        return {"TD_PRECISION": precision,
                **({"TD_API": "1"} if variant == "api" else {})}


# --- transformers' Trainer (a ViT classifier built from a config) ------------------------------------------
class HFTrainer(Program):
    name = "hf"
    owner = "ViTForImageClassification"
    target = "vit.layers.0.mlp.fc1"  # transformers 5 names (4.x: vit.encoder.layer.0.intermediate.dense)
    needs_checkout = False
    driver = r'''
import os, sys
sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
import tdfault, torch
from transformers import Trainer, TrainingArguments, ViTConfig, ViTForImageClassification
cfg = ViTConfig(image_size=16, patch_size=4, num_channels=3, hidden_size=32, num_hidden_layers=2,
                num_attention_heads=2, intermediate_size=64, num_labels=2)
torch.manual_seed(0)
model = ViTForImageClassification(cfg)
if tdfault.SPEC.get("sqrt_relu"):  # the user's own activation put in place of GELU
    class SqrtReLU(torch.nn.Module):
        def forward(self, x):
            return tdfault.sqrt_relu(x)
    for name, mod in list(model.named_modules()):
        if name.endswith("activation_fn"):
            parent, _, child = name.rpartition(".")
            setattr(model.get_submodule(parent), child, SqrtReLU())
class Data(torch.utils.data.Dataset):
    def __init__(self):
        self.x = torch.rand(64, 3, 16, 16, generator=torch.Generator().manual_seed(0))
    def __len__(self): return len(self.x)
    def __getitem__(self, i): return {"pixel_values": tdfault.nan_if_due(self.x[i]), "labels": i % 2}
bf16 = bool(os.environ.get("TD_BF16"))
args = TrainingArguments(output_dir=os.path.join(os.path.dirname(os.path.abspath(__file__)), "out"),
                         per_device_train_batch_size=1, max_steps=6, fp16=not bf16, bf16=bf16, use_cpu=True,
                         report_to=[], logging_steps=1, save_strategy="no", dataloader_num_workers=0, seed=0)
callbacks = []
if os.environ.get("TD_API"):
    from torchdoctor import NumericsCallback
    callbacks.append(NumericsCallback())
Trainer(model=model, args=args, train_dataset=Data(), callbacks=callbacks).train()
'''

    def commit(self) -> str:
        import importlib.metadata as md
        return "transformers " + md.version("transformers")

    def setup(self):
        self.write_common(self.work)
        with open(os.path.join(self.work, "drive.py"), "w") as f:
            f.write(self.driver)

    def cases(self):
        data = {"phase": "forward", "modules": ["vit.embeddings.patch_embeddings.projection",
                                                "vit.embeddings.patch_embeddings", "vit.embeddings",
                                                "(input)"], "cause": "data"}
        sc = {"owner": self.owner, "scale": self.target, "to_max": WEIGHT_MAX}
        # On a CPU the Trainer's fp16=True runs no autocast (accelerate autocasts fp16 on GPUs only): the
        # large weight trains in fp32 and the run must be silent (no false alarm on a value fp32 holds).
        return [
            Case("a0", dict(sc, step=0)),
            Case("a3", dict(sc, step=3)),
            Case("b0", {"owner": self.owner, "nan_at": 0}, expect=dict(data, step=0)),
            Case("b3", {"owner": self.owner, "nan_at": 3}, expect=dict(data, step=3)),
            Case("c0", {"owner": self.owner, "sqrt_relu": True}, {"invalid_op": True},
                 expect={"step": 0, "phase": "backward",
                         "modules": ["vit.layers.1.mlp.activation_fn", "vit.layers.0.mlp.activation_fn"],
                         "cause": "invalid", "fix_check": "not checked", "op": "sqrt"}),
            Case("d", {"owner": self.owner}),
        ]

    def command(self, case, variant=""):
        return [sys.executable, os.path.join(self.work, "drive.py")]

    def case_env(self, case, variant):
        return {**({"TD_BF16": "1"} if case.flags.get("bf16") else {}),
                **({"TD_API": "1"} if variant == "api" else {})}


PROGRAMS = {p.name: p for p in (NanoGPT, Timm, LightningReadme, HFTrainer)}
API_VARIANT = {"lightning", "hf"}
