"""NaN/inf losses and gradient norms in the words of the tools that stop (or warn) on them: one table.

A loss printed as a value (``'loss': nan``, ``loss=nan``, ``| loss | nan |``, ``[Loss] nan``, ``Loss is Infinity``)
is read by :data:`.patterns.LOSS_RE`; this table holds the sentences trainers print instead of the value, each with
what it means: a ``loss`` or ``grad`` that is not finite, and whether the tool ``stops`` the run there (a run that
stops on it is not one whose later losses recover) or warns and goes on.

Sources (format strings read at the commits named; "copies": the same text in trainers that copied it):

- facebookresearch/deit@7e160fe43f02 ``engine.py``, facebookresearch/mae@efb2a8062c20 ``engine_pretrain.py``,
  microsoft/unilm@768a3c873f59 ``beit*/engine_for_*.py``: "Loss is {}, stopping training" (then ``sys.exit(1)``).
- ultralytics yolov3/yolov5 ``train.py`` (2019-2020, copied into many training scripts): "WARNING: non-finite loss,
  ending training".
- facebookresearch/detectron2@02b5c4e295e9 ``engine/train_loop.py``: "Loss became infinite or NaN at
  iteration={iter}!" (FloatingPointError).
- open-mmlab/mmdetection@19bceba56284 ``mmdet/engine/hooks/checkloss_hook.py``: "loss become infinite or NaN!".
- facebookresearch/fairseq@3d262bb25690 ``fairseq/trainer.py``: "gradients are Nan/Inf" (FloatingPointError);
  ``fairseq/nan_detector.py``: "Detected nan/inf grad norm, dumping norms...", "{NaN|Inf} detected in output of
  {module}, shape: ..., {forward|backward}".
- NVIDIA/Megatron-LM@d98e8a64ddf3 ``core/distributed/param_and_grad_buffer.py``: "found {NaN|Inf} in local grad norm
  for bucket #{i} in backward pass ..."; ``pretrain_gpt.py``: "found {NaN|Inf} in local forward loss calculation";
  ``core/rerun_state_machine.py``: "Unexpected result {result} ...".
- pytorch/pytorch@01a57d87bd48 ``torch/nn/utils/clip_grad.py``: "The total norm of order {p} for gradients from
  `parameters` is non-finite, so it cannot be clipped." (``error_if_nonfinite=True``; Fabric's default); torch
  1.9-1.13 warned instead: "Non-finite norm encountered in torch.nn.utils.clip_grad_norm_; continuing anyway."
- PyTorch autograd anomaly mode (``torch/csrc/autograd/engine.cpp``): "Function '{name}' returned nan values in its
  {i}th output." (raises).
- Lightning-AI/pytorch-lightning@2cf24a9e307a (``terminate_on_nan``, v1.5-1.6): "The loss returned in
  `training_step` is {loss}.", "Detected nan and/or inf values in `{name}`."; @7f0c3436cd3f
  ``callbacks/early_stopping.py``: "Monitored metric {m} = {v} is not finite. ... Signaling Trainer to stop.".
- pytorch/torchtitan@b5bcd76c66d0 ``torchtitan/trainer.py``: "Loss or gradient norm is not finite on at least one
  rank at step {step}. Stopping training before the optimizer update."
- ultralytics ``ultralytics/engine/trainer.py`` (@00016300105e): "{Loss NaN/Inf|Fitness NaN/Inf} detected ...",
  "Training failed: NaN persisted for {n} epochs".
- huggingface/transformers@0c2a63e77d72 ``debug_utils.py``: "Detected inf/nan during batch_number={n}".
- keras-team/keras 3.x ``keras/src/callbacks/terminate_on_nan.py`` (``TerminateOnNaN``, whatever the backend, torch
  included; tf.keras 2.x the same): "Batch {batch}: Invalid loss, terminating training".
"""

from __future__ import annotations

import re
from dataclasses import dataclass


@dataclass(frozen=True)
class NonfiniteMessage:
    tool: str
    key: str                  # a substring the line holds (checked before the regex)
    rx: re.Pattern[str]       # optional groups: ``step`` (the iteration/step it names), ``where`` (a module, an op)
    what: str                 # "loss" or "grad"
    stops: bool               # the tool ends the run here (else it warns and goes on)


MESSAGES: tuple[NonfiniteMessage, ...] = (
    NonfiniteMessage("DeiT/MAE/BEiT", "stopping training", re.compile(
        r"Loss is (?P<val>\S+?),? stopping training"), "loss", True),
    NonfiniteMessage("yolov3/yolov5", "non-finite loss", re.compile(r"non-finite loss, ending training"), "loss",
                     True),
    NonfiniteMessage("detectron2", "Loss became infinite or NaN", re.compile(
        r"Loss became infinite or NaN at iteration=(?P<step>\d+)"), "loss", True),
    NonfiniteMessage("mmdetection", "loss become infinite or NaN", re.compile(r"loss become infinite or NaN"),
                     "loss", True),
    NonfiniteMessage("fairseq", "gradients are Nan/Inf", re.compile(r"gradients are Nan/Inf"), "grad", True),
    NonfiniteMessage("fairseq", "Detected nan/inf grad norm", re.compile(r"Detected nan/inf grad norm"), "grad",
                     True),
    NonfiniteMessage("fairseq", "detected in output of", re.compile(
        r"(?:NaN|Inf) detected in output of (?P<where>\S+?),"), "grad", False),
    NonfiniteMessage("Megatron-LM", "in local grad norm", re.compile(
        r"found (?:NaN|Inf) in local grad norm"), "grad", True),
    NonfiniteMessage("Megatron-LM", "in local forward loss", re.compile(
        r"found (?:NaN|Inf) in local forward loss calculation"), "loss", True),
    NonfiniteMessage("Megatron-LM", "Unexpected result", re.compile(
        r"Unexpected result (?P<val>nan|inf|-inf)\b"), "loss", True),
    NonfiniteMessage("torch clip_grad_norm_", "is non-finite, so it cannot be clipped", re.compile(
        r"The total norm of order \S+ for gradients from .parameters. is non-finite"), "grad", True),
    NonfiniteMessage("torch clip_grad_norm_", "Non-finite norm encountered", re.compile(
        r"Non-finite norm encountered in torch\.nn\.utils\.clip_grad_norm_"), "grad", False),
    NonfiniteMessage("torch anomaly mode", "returned nan values", re.compile(
        r"Function '(?P<where>\w+)' returned nan values in its \d+th output"), "grad", True),
    NonfiniteMessage("Lightning", "The loss returned in", re.compile(
        r"The loss returned in .training_step. is (?P<val>nan|inf|-inf)"), "loss", True),
    NonfiniteMessage("Lightning", "Detected nan and/or inf values", re.compile(
        r"Detected nan and/or inf values in .(?P<where>[^`']+)."), "grad", True),
    NonfiniteMessage("Lightning EarlyStopping", "is not finite", re.compile(
        r"Monitored metric (?P<where>\S+) = (?P<val>nan|inf|-inf) is not finite"), "loss", True),
    NonfiniteMessage("torchtitan", "is not finite on at least one rank", re.compile(
        r"Loss or gradient norm is not finite on at least one rank at step (?P<step>\d+)"), "loss", True),
    NonfiniteMessage("ultralytics", "NaN/Inf detected", re.compile(r"(?:Loss|Fitness) NaN/Inf detected"), "loss",
                     False),
    NonfiniteMessage("ultralytics", "NaN persisted for", re.compile(r"NaN persisted for \d+ epochs"), "loss", True),
    NonfiniteMessage("Keras TerminateOnNaN", "Invalid loss, terminating", re.compile(
        r"Batch (?P<step>\d+): Invalid loss, terminating training"), "loss", True),
    NonfiniteMessage("transformers DebugUnderflowOverflow", "Detected inf/nan during batch_number", re.compile(
        r"Detected inf/nan during batch_number=(?P<step>\d+)"), "grad", True),
)

#: literals for the scanner's prefilter (upper-case first letters are cheap there); NEEDLES for the rest
ANCHORS = ("Loss is", "Loss became", "WARNING: non-finite", "NaN!", "Detected nan", "Detected inf", "NaN detected",
           "Inf detected", "Unexpected result", "The total norm", "Non-finite norm", "Function '", "The loss returned",
           "Monitored metric", "Loss or gradient", "NaN/Inf detected", "NaN persisted", "Invalid loss")
#: (no needles: the lower-case sentences come on an exception or error line -- the analyzer's "rror" needle -- or
#: after "Loss is" / "WARNING: non-finite")
NEEDLES: tuple[str, ...] = ()
