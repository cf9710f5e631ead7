"""Fix texts that more than one command gives, kept in one place so that they never disagree."""

from __future__ import annotations

# A loss scale that keeps falling means the gradients overflow at every scale: the values themselves are
# too large for fp16, so the first fix is a dtype with fp32's range. initial_scale_power only moves where
# the scale starts (2**power): it saves the first skipped steps of a healthy run, and changes nothing
# for a run whose scale collapsed.
FP16_COLLAPSE_DEEPSPEED = (
    'train in bf16 where the GPU has it (Ampere or newer: A100, H100, RTX 30xx+): "bf16": {"enabled": true} '
    'and "fp16": {"enabled": false} in the DeepSpeed config (--bf16 with the HF Trainer); models pretrained in '
    'bf16 overflow in fp16. "initial_scale_power" only sets the starting scale (2**power): it does not help a '
    "scale that collapsed, because the gradients overflow at every scale. Otherwise keep the module named above "
    "in fp32 (torchdoctor.keep_fp32)"
)
FP16_COLLAPSE_TORCH = (
    "train in bf16 where the GPU has it (torch.autocast(device_type, dtype=torch.bfloat16), no GradScaler "
    "needed), or keep the module named above in fp32 (torchdoctor.keep_fp32)"
)
