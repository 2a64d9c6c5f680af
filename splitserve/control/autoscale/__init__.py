"""Pool autoscaling, pure Python (no Ray, no torch): the signals a Controller (or the
simulator) samples every interval, the policy that turns them into target pool sizes, and the
`Autoscaler` that runs the policy over the pools' load and the routers' latencies."""

from splitserve.control.autoscale.autoscaler import AutoscaleReport, Autoscaler
from splitserve.control.autoscale.observer import SignalObserver
from splitserve.control.autoscale.policy import AutoscaleConfig, AutoscalePolicy, Bounds, AutoscaleDecision, Reason
from splitserve.control.autoscale.signals import DecodeSignals, PrefillSignals, Signals, StepFit
from splitserve.control.autoscale.window import LatencyWindow, RequestSample

__all__ = ["AutoscaleConfig", "AutoscalePolicy", "AutoscaleReport", "Autoscaler", "Bounds", "AutoscaleDecision", "Reason",
           "DecodeSignals", "LatencyWindow", "PrefillSignals", "RequestSample", "SignalObserver", "Signals",
           "StepFit"]
