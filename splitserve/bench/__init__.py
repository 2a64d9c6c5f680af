"""`splitserve bench`: a load generator over the OpenAI-compatible streaming completions API.

    datasets.py  what to ask: random, shared-prefix, mooncake trace (token-id prompts)
    client.py    one streaming request, timed: TTFT, inter-token latencies, e2e, status
    runner.py    when to ask: open loop (Poisson or trace timestamps) or closed loop; bounds; output
    metrics.py   summary: mean/p50/p90/p99, throughput, goodput against SLOs
    plot.py      PNG of the latency CDFs
    command.py   the CLI handler: arguments -> dataset + config -> run -> JSON + PNG
"""
