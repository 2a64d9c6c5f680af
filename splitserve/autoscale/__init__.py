"""Pool autoscaling, pure Python (no Ray, no torch): the signals a Controller (or the
simulator) samples every interval and the policy that turns them into target pool sizes."""

from splitserve.autoscale.policy import AutoscaleConfig, AutoscalePolicy, Bounds, Decision, Reason
from splitserve.autoscale.signals import DecodeSignals, PrefillSignals, Signals, StepFit

__all__ = ["AutoscaleConfig", "AutoscalePolicy", "Bounds", "Decision", "Reason", "DecodeSignals", "PrefillSignals",
           "Signals", "StepFit"]
