"""A GPU that a kernel library, or this torch build, does not support: FlashAttention below Ampere, xFormers' kernels
for another capability, a bitsandbytes built without GPU support, a GPU torch calls too old. (A torch build without
kernels for the GPU -- ``no kernel image``, torch's "is not compatible with the current PyTorch installation" -- is
:mod:`..judge_cuda`'s ``cuda.no-kernel-image``.)

Message table:

- Dao-AILab/flash-attention ``csrc/flash_attn/flash_api.cpp`` (@4f285b3 v2.0.0 to @0251105): "FlashAttention only
  supports Ampere GPUs or newer.", "bfloat16 is only supported on Ampere GPUs or newer" (v2.0-v2.3).
- facebookresearch/xformers@56be3b5 (v0.0.29) ``xformers/ops/fmha/dispatch.py`` / ``common.py``: "No operator found
  for `{op}` with inputs:" and, per kernel, "requires device with capability > {cc} but your GPU has capability
  {cap} (too old)", "bf16 is only supported on A100+ GPUs", "xFormers wasn't build with CUDA support".
- bitsandbytes 0.35-0.45 ``bitsandbytes/cextension.py`` (@b844e10 .. @d72cb9c): "The installed version of
  bitsandbytes was compiled without GPU support."
- torch ``torch/cuda/__init__.py`` (``_check_capability``, torch 1.x-2.10): "Found GPU{i} {name} which is of cuda
  capability {maj}.{min}. PyTorch no longer supports this GPU because it is too old."; torch 2.13
  ``_warn_unsupported_code``: "Your installed torch=={v} does not include kernels for this GPU."
- huggingface/transformers 5.25 ``modeling_utils.py``: "FlashAttention{v} has been toggled on, but it cannot be used
  due to the following error: ... requires compute capability >= {maj}, but found {cap} ...".
"""

from __future__ import annotations

import re
from typing import Any

from ...findings import Finding
from ..common import add
from .base import Family

FLASH_ATTN_RE = re.compile(r"FlashAttention only supports Ampere GPUs or newer|bfloat16 is only supported on Ampere "
                           r"GPUs or newer")
XFORMERS_OP_RE = re.compile(r"No operator found for .(?P<op>\w+).")
XFORMERS_CAP_RE = re.compile(r"requires device with capability > \((?P<need>[\d, ]+)\) but your GPU has capability "
                             r"\((?P<have>[\d, ]+)\) \(too old\)|bf16 is only supported on A100\+ GPUs")
BNB_RE = re.compile(r"bitsandbytes was compiled without GPU support")
TORCH_TOO_OLD_RE = re.compile(r"Found GPU\s*(?P<i>\d+) (?P<name>.+?) which is of cuda capability (?P<cap>\d+\.\d+)\."
                              r"|PyTorch no longer supports this GPU because it is too old"
                              r"|does not include kernels for this GPU")
HF_FA_RE = re.compile(r"FlashAttention\w* has been toggled on, but it cannot be used due to the following error: .*?"
                      r"requires compute capability")

_FIX = {
    "flash-attn": "FlashAttention 2 runs on Ampere (sm_80) and newer: on a T4, V100 or RTX 20xx use another attention "
                  "(attn_implementation=\"sdpa\" with transformers, xformers' cutlass kernels, or the model's "
                  "default), and bf16 -> fp16 there (Turing and Volta have no bf16)",
    "xformers": "xFormers' dispatcher found no kernel for these inputs on this GPU: its flash kernel needs capability "
                "> 8.0 and bf16 needs A100+ -- use fp16 on older GPUs, or torch's own "
                "F.scaled_dot_product_attention; `python -m xformers.info` lists which kernels this install has",
    "bitsandbytes": "this bitsandbytes was built without GPU support (or found no CUDA library): `python -m "
                    "bitsandbytes` says why; install a bitsandbytes whose binaries match this CUDA (pip install -U "
                    "bitsandbytes)",
    "torch": "this torch release dropped support for the GPU: install an older torch built for it (the release notes "
             "of each torch list the minimum compute capability), or use a newer GPU",
    "transformers": "set attn_implementation=\"sdpa\" (or \"eager\") in from_pretrained: FlashAttention needs a newer "
                    "GPU",
}


class GpuSupport(Family):
    RULES = (
        ("only supported on Ampere", FLASH_ATTN_RE, "on_flash_attn"),
        ("only supports Ampere", FLASH_ATTN_RE, "on_flash_attn"),
        ("No operator found for", XFORMERS_OP_RE, "on_xformers_op"),
        ("requires device with capability", XFORMERS_CAP_RE, "on_xformers_reason"),
        ("only supported on A100", XFORMERS_CAP_RE, "on_xformers_reason"),
        ("compiled without GPU support", BNB_RE, "on_bnb"),
        ("which is of cuda capability", TORCH_TOO_OLD_RE, "on_torch_too_old"),
        ("no longer supports this GPU", TORCH_TOO_OLD_RE, "on_torch_too_old"),
        ("does not include kernels for this GPU", TORCH_TOO_OLD_RE, "on_torch_too_old"),
        ("has been toggled on", HF_FA_RE, "on_hf_flash_attn"),
    )
    ANCHORS = ("FlashAttention", "No operator found", "PyTorch no longer supports", "Found GPU",
               "The installed version of bitsandbytes", "Your installed torch")
    NEEDLES = ()  # xFormers' reasons are read below its "No operator found" line
    CAUSE_EVENTS = frozenset({"gpu-unsupported"})

    def __init__(self, log: Any) -> None:
        super().__init__(log)
        self.events: list[dict] = []
        self._reasons: list[str] = []

    @property
    def failed(self) -> bool:
        return bool(self.events)

    def _add(self, lineno: int, text: str, library: str, detail: str) -> None:
        if any(e["library"] == library and e["detail"] == detail for e in self.events):
            return
        self.log.event(lineno, "gpu-unsupported", text)
        add(self.events, {"line": lineno, "library": library, "detail": detail, "text": self.log.quote(text)}, 8)

    def on_flash_attn(self, m: re.Match, text: str, lineno: int) -> None:
        self._add(lineno, text, "flash-attn", m.group(0))

    def on_xformers_op(self, m: re.Match, text: str, lineno: int) -> None:
        self._add(lineno, text, "xformers", f"no kernel for {m['op']} on this GPU and these inputs")
        for line in self.log.following(40) or ():  # each kernel's reasons follow, indented
            r = XFORMERS_CAP_RE.search(line)
            if r:
                self.on_xformers_reason(r, line, lineno)

    def on_xformers_reason(self, m: re.Match, text: str, lineno: int) -> None:
        reason = (f"a kernel needs capability > ({m['need']}), the GPU has ({m['have']})" if m["need"]
                  else "bf16 needs an A100 or newer")
        if reason not in self._reasons:
            self._reasons.append(reason)
        if not any(e["library"] == "xformers" for e in self.events):
            self._add(lineno, text, "xformers", reason)

    def on_bnb(self, m: re.Match, text: str, lineno: int) -> None:
        self._add(lineno, text, "bitsandbytes", "built without GPU support")

    def on_torch_too_old(self, m: re.Match, text: str, lineno: int) -> None:
        if "no longer supports" in text or "does not include kernels" in text or "too old" in text:
            self._add(lineno, text, "torch", "this torch has no kernels for the GPU (too old for it)")

    def on_hf_flash_attn(self, m: re.Match, text: str, lineno: int) -> None:
        self._add(lineno, text, "transformers", "FlashAttention needs a newer GPU")

    def judge(self) -> list[Finding]:
        if not self.events:
            return []
        hard = [x for x in self.events if x["library"] != "bitsandbytes"]  # bitsandbytes warns and the run goes on
        e = (hard or self.events)[0]
        ev = [f"line {x['line']}: {x['text']}" for x in self.events[:3]] + [f"why: {r}" for r in self._reasons[:3]]
        libs = list(dict.fromkeys(x["library"] for x in self.events))
        name = {"flash-attn": "FlashAttention", "xformers": "xFormers", "bitsandbytes": "bitsandbytes",
                "torch": "this torch build", "transformers": "FlashAttention (transformers)"}[e["library"]]
        return [Finding("cuda.unsupported-gpu", "fail" if hard else "warn",
                        f"{name} does not support this GPU: {e['detail']}", ev,
                        [_FIX[lib] for lib in libs] + ["torchdoctor env shows the GPU's compute capability and what "
                                                       "torch was built for"],
                        {"libraries": libs, "events": list(self.events), "reasons": list(self._reasons)})]
