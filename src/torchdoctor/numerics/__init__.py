"""The numerics monitor: inf/nan in weights, activations and gradients, found cheaply and explained."""

from .errors import AbortAfterStep, NonFiniteError, NonFiniteWarning
from .judge.headroom import HeadroomEvent, HeadroomWarning
from .monitor import NumericsMonitor, OverflowEvent
from .overflow import detect_overflow

__all__ = [
    "AbortAfterStep", "HeadroomEvent", "HeadroomWarning", "NonFiniteError", "NonFiniteWarning", "NumericsMonitor",
    "OverflowEvent", "detect_overflow",
]
