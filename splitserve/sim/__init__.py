"""The cluster simulator: splitserve's own scheduler, block pool, router policy, admission and
autoscaler under simulated time, with the model step replaced by a cost model — to plan past
this machine (how many prefill vs decode workers a trace needs, what PD buys over aggregated
serving, whether the autoscaler keeps up). No Ray, no torch (only `--calibrate` loads the real
engine). Entry point: `splitserve simulate` (command.py); the pieces:

    events.py      the clock: timed callbacks in order
    workload.py    what is replayed: Mooncake traces, bench datasets; prompts as chained block hashes
    engine.py      SimEngine = the real EngineCore + a cost model for each step
    worker.py      one worker: stepping on the clock, lifecycle state, load reports
    router.py      one router replica: the real policy, KV index and Pending over the reports
    pools.py       the pools: start, drain, stop, nodes; what the Controller does
    simulation.py  a request's life from arrival to end, admission, the autoscaler's ticks
    cost/          step-time models (linear: calibrated / profiled; roofline; parallel: PP, DP
                   attention, EP, DeepSeek's shape) and KV links
    capacity.py    a cost model's steady-state output tokens/s at a TPOT target, without simulating
    search.py      goodput at a target SLO attainment; the prefill:decode sweep
    report.py      the summary JSON, its print, the PNG
"""
