"""Fix texts that more than one command gives, kept in one place so that they never disagree."""

from __future__ import annotations


def fp16_collapse_fix(deepspeed: bool, keep: str | None = None) -> str:
    """What to do when a dynamic fp16 loss scale keeps falling.

    A scale that keeps falling means the gradients overflow at every scale: the values themselves are too
    large for fp16, so the first fix is a dtype with fp32's range. ``initial_scale_power`` only moves where
    the scale starts (2**power): it saves the first skipped steps of a healthy run and changes nothing for
    a run whose scale collapsed. ``keep`` names the module to keep in fp32 when one is known.
    """
    keep_fp32 = (f"torchdoctor.keep_fp32(model, {keep!r})" if keep is not None else
                 "torchdoctor.keep_fp32 on the module the report's frames show overflowing first")
    if deepspeed:
        return (
            'train in bf16 where the GPU has it (Ampere or newer: A100, H100, RTX 30xx+): "bf16": {"enabled": true} '
            'and "fp16": {"enabled": false} in the DeepSpeed config (--bf16 with the HF Trainer); models pretrained '
            'in bf16 overflow in fp16. "initial_scale_power" only sets the starting scale (2**power): it does not '
            "help a scale that collapsed, because the gradients overflow at every scale. Otherwise keep the module "
            f"where the overflow starts in fp32: {keep_fp32}"
        )
    return (
        "train in bf16 where the GPU has it (torch.autocast(device_type, dtype=torch.bfloat16), no GradScaler "
        f"needed), or keep the module where the overflow starts in fp32: {keep_fp32}"
    )


FP32_COLLAPSE_FIX = (
    "the gradients are non-finite at every scale the loss scaler tried while the step computes in fp32 (no fp16 value, "
    "no fp16 autocast): no loss scale or dtype helps -- look for what makes them that large (a learning rate too "
    "high, a custom backward's factor, an exploding model: clip the gradients, lower the learning rate); a loss "
    "scaler is not needed in fp32"
)
