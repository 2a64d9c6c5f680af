"""Pool autoscaling, pure Python (no Ray, no torch): the signals a Controller (or the
simulator) samples every interval, the policy that turns them into target pool sizes, and the
`Autoscaler` that runs the policy over the pools' load and the routers' latencies."""

from splitserve.autoscale.autoscaler import AutoscaleReport, Autoscaler
from splitserve.autoscale.observer import SignalObserver
from splitserve.autoscale.policy import AutoscaleConfig, AutoscalePolicy, Bounds, Decision, Reason
from splitserve.autoscale.signals import DecodeSignals, PrefillSignals, Signals, StepFit
from splitserve.autoscale.window import LatencyWindow, RequestSample

__all__ = ["AutoscaleConfig", "AutoscalePolicy", "AutoscaleReport", "Autoscaler", "Bounds", "Decision", "Reason",
           "DecodeSignals", "LatencyWindow", "PrefillSignals", "RequestSample", "SignalObserver", "Signals",
           "StepFit"]
