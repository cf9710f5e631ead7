"""One optimizer update as a plain loop writes it, with or without a GradScaler (shared by the test workers)."""

from __future__ import annotations


def update(loss, opt, scaler=None) -> None:
    """Backward, step (through the scaler when there is one) and zero the gradients."""
    if scaler is not None:
        scaler.scale(loss).backward()
        scaler.step(opt)
        scaler.update()
    else:
        loss.backward()
        opt.step()
    opt.zero_grad()
