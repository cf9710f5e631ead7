"""Every trainer's dynamic loss scaler, in its own words: one table, read into the one trajectory of
:mod:`.scale_trajectory`, so a collapse is judged the same whoever printed it.

Each :class:`ScalerMessage` says what a line of one scaler means -- an overflow that skipped a step and lowered the
scale (named groups ``att``, the scale that overflowed, and ``new``, the one after, or ``ratio``, what ``att`` is
multiplied by; or ``lg``, the log2 of the new scale), a rise (``up``), the scaler giving up at its minimum (``min``) --
and that scaler's defaults: where it starts, its floor (``None``: it has none and halves towards 0, so below 1 every
scale overflows: collapsed), and whether reaching the floor stops the run. DeepSpeed's own lines (``[deepspeed]
OVERFLOW!``, hysteresis, "Current loss scale already at minimum") keep their dedicated rules in :mod:`.patterns`; the
rest are here.

Sources (the format strings, read at the commits named):

- NVIDIA/apex@e13873debc46 (the last commit with ``amp`` and ``fp16_utils``; removed in cb65b8ed, 2025):
  ``apex/amp/handle.py`` "Gradient overflow.  Skipping step, loss scaler {loss_id} reducing loss scale to {scale}"
  (``amp.scaler.LossScaler``: init 2**16, halves, no floor, never stops) and the old API's "Gradient overflow,
  skipping update"; ``apex/fp16_utils/fp16_optimizer.py`` "Gradient overflow.  Skipping step, reducing loss scale to
  {}" and "OVERFLOW within closure! Skipping step, reducing loss scale to {}"; ``apex/optimizers/fp16_optimizer.py``
  (@cfb628ba2e46, the cut-down FP16_Optimizer copied into BERT-era trainers) "Grad overflow on iteration {n}" then
  "Using dynamic loss scale of {scale}": the scale that overflowed, then ``max(scale / 2, 1)``.
- facebookresearch/fairseq@3d262bb25690: ``fairseq/trainer.py`` "NOTE: gradient overflow detected, ignoring
  gradient, setting loss scale to: {scale}" (0.9-0.10: "NOTE: overflow detected, " + the scaler's "setting loss scale
  to: {scale}"; <= 0.6: "| WARNING: overflow detected, ..."; ``optim/dynamic_loss_scaler.py``: init 2**7, floor
  ``--min-loss-scale``
  1e-4, "Minimum loss scale reached ({min}). Your loss is probably exploding. ..." raises FloatingPointError);
  ``optim/amp_optimizer.py`` "AMP: overflow detected, setting scale to to {scale}" and "AMP: Minimum loss scale
  reached ({min})".
- hpcaitech/ColossalAI@4f9953be335e ``colossalai/amp/naive_amp/grad_scaler/dynamic_grad_scaler.py`` "Overflow occurs,
  the loss scale is adjusted to {scale}", "No overflow for consecutive {n} steps, the loss scale is adjusted to
  {scale}" (floor 1 in its plugins); ``zero/low_level/low_level_optim.py`` "Found overflow. Skip step".
- open-mmlab/mmcv 1.x@1d8f9285674f ``mmcv/runner/hooks/optimizer.py`` (``Fp16OptimizerHook``, torch < 1.6) "Check
  overflow, downscale loss scale to {scale}" (``fp16_utils.LossScaler``: floor 1).
- PaddlePaddle/Paddle ``python/paddle/amp/grad_scaler.py`` (``AmpScaler._update``, Paddle 2.1-3.x; 2.1's print had no
  spaces after the commas): "Found inf or nan, current scale is: {scale}, decrease to: {scale}*{decr_ratio}" -- the
  scale that overflowed and the ratio it is multiplied by (default 0.5); ``GradScaler`` starts at
  ``init_loss_scaling=2**15`` and has no floor: it multiplies towards 0 (PaddleClas, PaddleSeg, PaddleDetection and
  PaddleNLP train through it).
- openai/guided-diffusion ``guided_diffusion/train_util.py`` (and improved-diffusion, copies in diffusion trainers;
  index copies of ``optimize_fp16``) "Found NaN, decreased lg_loss_scale to {lg}": the scale is ``2 ** lg``, lowered
  by one power of two per overflow, raised by ``fp16_scale_growth`` per good step; no floor.
"""

from __future__ import annotations

import re
from dataclasses import dataclass

NUM = r"[-+]?\d+(?:\.\d*)?(?:[eE][+-]?\d+)?"


@dataclass(frozen=True)
class ScalerMessage:
    trainer: str
    key: str                     # a substring every line of the message holds (checked before the regex)
    rx: re.Pattern[str]
    kind: str                    # "overflow", "rise", "min", "announce" (the scale at an overflow: see apex optimizers)
    init: float | None           # the scaler's default starting scale
    floor: float | None          # its default minimum (None: none)
    stops_at_min: bool           # reaching the minimum raises / ends the run
    hint: str = ""               # the trainer's own way to the fix


_APEX_HINT = ("apex's amp is deprecated and gone from apex since 2025: torch.autocast(device_type, "
              "dtype=torch.bfloat16) needs no scaler; in fp16, torch.amp.GradScaler replaces it")
_FAIRSEQ_HINT = ("fairseq: --bf16 (or --memory-efficient-bf16) instead of --fp16; its own advice for a scale at the "
                 "minimum: lower --lr, --clip-norm, a larger batch (--update-freq)")

MESSAGES: tuple[ScalerMessage, ...] = (
    ScalerMessage("apex amp", "Skipping step, loss scaler", re.compile(
        rf"Gradient overflow\.\s+Skipping step, loss scaler \d+ reducing loss scale to (?P<new>{NUM})"),
        "overflow", 2.0**16, None, False, _APEX_HINT),
    ScalerMessage("apex FP16_Optimizer", "Skipping step, reducing loss scale", re.compile(
        rf"(?:Gradient overflow\.\s+|OVERFLOW within closure! )Skipping step, reducing loss scale to (?P<new>{NUM})"),
        "overflow", 2.0**16, None, False, _APEX_HINT),
    ScalerMessage("apex amp", "Gradient overflow, skipping update", re.compile(
        r"Gradient overflow, skipping update"), "overflow", 2.0**16, None, False, _APEX_HINT),
    ScalerMessage("apex FP16_Optimizer", "Using dynamic loss scale of", re.compile(
        rf"Using dynamic loss scale of:? (?P<att>{NUM})"), "announce", 2.0**16, 1.0, False, _APEX_HINT),
    # fairseq's trainer said it three ways over its versions: "| WARNING: overflow detected, setting loss scale to: X"
    # (<= 0.6, print), "NOTE: overflow detected, setting loss scale to: X" (0.9-0.10, logger.info), "NOTE: gradient
    # overflow detected, ignoring gradient, setting loss scale to: X" (current)
    ScalerMessage("fairseq", "overflow detected, ", re.compile(
        rf"(?:gradient )?overflow detected, (?:ignoring gradient, )?setting loss scale to:? (?P<new>{NUM})"),
        "overflow", 2.0**7, 1e-4, True, _FAIRSEQ_HINT),
    ScalerMessage("fairseq", "AMP: overflow detected", re.compile(
        rf"AMP: overflow detected, setting scale to(?: to)? (?P<new>{NUM})"), "overflow", 2.0**7, 1e-4, True,
        _FAIRSEQ_HINT),
    ScalerMessage("fairseq", "Minimum loss scale reached", re.compile(
        rf"Minimum loss scale reached \((?P<min>{NUM})\)"), "min", 2.0**7, 1e-4, True, _FAIRSEQ_HINT),
    ScalerMessage("ColossalAI", "Overflow occurs, the loss scale", re.compile(
        rf"Overflow occurs, the loss scale is adjusted to (?P<new>{NUM})"), "overflow", 2.0**16, 1.0, False),
    ScalerMessage("ColossalAI", "the loss scale is adjusted to", re.compile(
        rf"No overflow for consecutive \d+ steps, the loss scale is adjusted to (?P<up>{NUM})"), "rise", 2.0**16,
        1.0, False),
    ScalerMessage("ColossalAI", "Found overflow. Skip step", re.compile(r"Found overflow\. Skip step"),
                  "overflow", 2.0**16, 1.0, False),
    ScalerMessage("mmcv Fp16OptimizerHook", "downscale loss scale", re.compile(
        rf"Check overflow, downscale loss scale to (?P<new>{NUM})"), "overflow", 2.0**32, 1.0, False),
    ScalerMessage("PaddlePaddle GradScaler", "Found inf or nan", re.compile(
        rf"Found inf or nan, ?current scale is: ?(?P<att>{NUM}), ?decrease to: ?{NUM}\*(?P<ratio>{NUM})"),
        "overflow", 2.0**15, None, False,
        "Paddle: paddle.amp.auto_cast(level='O1', dtype='bfloat16') on GPUs that have bf16 (no scaler needed), or "
        "train in fp32 (drop the amp config); GradScaler(init_loss_scaling=..., decr_every_n_nan_or_inf=...) only "
        "moves where the fall starts"),
    ScalerMessage("guided-diffusion", "decreased lg_loss_scale", re.compile(
        rf"Found NaN, decreased lg_loss_scale to (?P<lg>{NUM})"), "overflow", 2.0**20, None, False),
)

#: literals for the scanner's prefilter: each message's line holds one
ANCHORS = ("Gradient overflow", "Skipping step", "Using dynamic loss scale", "Minimum loss scale", "AMP: overflow",
           "Overflow occurs", "Found overflow", "No overflow for", "Check overflow", "Found NaN, decreased",
           "Found inf or nan")  # (F: a capital, rarer than the lower-case letters the anchors avoid)
NEEDLES: tuple[str, ...] = ()  # fairseq's "gradient overflow detected": the analyzer's "verflow" anchor


def scale_of_lg(lg: float) -> float:
    """``2 ** lg`` without overflow: a log2 scale far below 0 is 0.0, far above it infinity."""
    try:
        return 2.0 ** lg
    except OverflowError:
        return float("inf")
