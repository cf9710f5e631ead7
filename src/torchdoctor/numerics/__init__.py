"""The numerics monitor: inf/nan in weights, activations and gradients, found cheaply and explained."""

from .errors import AbortAfterStep, NonFiniteError
from .monitor import NumericsMonitor, OverflowEvent
from .overflow import detect_overflow

__all__ = ["AbortAfterStep", "NonFiniteError", "NumericsMonitor", "OverflowEvent", "detect_overflow"]
