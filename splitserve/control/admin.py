"""`splitserve scale` and `splitserve status`: a short-lived driver that finds the app's
Controller on a running Ray cluster and asks it."""

from __future__ import annotations

from splitserve.control.status import ClusterStatus


def _controller(address: str, name: str, namespace: str):
    from splitserve.control.launch import connect_ray, stop_local_ray

    if connect_ray(address, 1):  # nothing was running: there is no app to ask
        stop_local_ray()
        raise ValueError("no Ray cluster is running here; start one with `splitserve serve`")
    return find(name, namespace)


def find(name: str = "splitserve", namespace: str = "splitserve"):
    """The running Controller of app `name` (ValueError when there is none) — by name, without
    importing the Controller's module (torch comes with it): a CLI call stays quick."""
    import ray

    try:
        return ray.get_actor(name, namespace=namespace)
    except ValueError:
        raise ValueError(f"no splitserve app {name!r} is running on this Ray cluster (namespace {namespace!r})") \
            from None


def scale(address: str, name: str, namespace: str, prefill: int | None, decode: int | None) -> str:
    """The new targets, and at once what keeps a new worker from running as one would expect: why
    Ray has not placed it and what would (the Controller waits for its placement briefly), or
    that it shares the machine's cores."""
    import ray

    c = _controller(address, name, namespace)
    targets = {}
    for role, n in (("prefill", prefill), ("decode", decode)):
        if n is not None:
            targets = ray.get(c.scale.remote(role, n))
    st = ray.get(c.status.remote())
    waiting = [f"{w.id} waits: {w.reason}" for w in st.workers if w.state == "starting" and w.reason]
    return "\n".join([f"targets: prefill {targets['prefill']}, decode {targets['decode']}", *waiting,
                      *([f"sharing: {st.sharing}"] if st.sharing else [])])


def status(address: str, name: str, namespace: str) -> ClusterStatus:
    import ray

    return ray.get(_controller(address, name, namespace).status.remote())


def _ranks(ips: tuple[str, ...]) -> str:
    """A tensor-parallel worker's ranks by node: "2: 127.0.0.2 ×2"."""
    if not ips:
        return "-"
    nodes = dict.fromkeys(ips)
    return f"{len(ips)}: " + ", ".join(f"{ip} ×{ips.count(ip)}" for ip in nodes)


def status_table(st: ClusterStatus) -> str:
    """The workers one a line; STATE says `ready, slow` for a worker whose probes go unanswered
    (alive, not dead); NOTE says why one is dead or stopped, or why Ray has not placed it yet and
    what would (the last column: a long note widens nothing)."""
    head = ("ID", "ROLE", "STATE", "NODE", "WAITING", "RUNNING", "KV USAGE", "TP RANKS", "NOTE")
    rows = [(w.id, w.role, f"{w.state}, slow" if w.slow else w.state, w.node_ip or "-", str(w.num_waiting),
             str(w.num_running), f"{100 * w.kv_usage:.1f}%", _ranks(w.ranks), w.reason) for w in st.workers]
    widths = [max(len(r[i]) for r in [head, *rows]) for i in range(len(head))]
    lines = [f"targets: prefill {st.targets['prefill']}, decode {st.targets['decode']}"]
    lines += ["  ".join(c.ljust(w) for c, w in zip(r, widths)).rstrip() for r in [head, *rows]]
    lines += [f"{w.id} memory: {w.memory}" for w in st.workers if w.memory]
    lines += [f"sharing: {st.sharing}"] if st.sharing else []
    lines += [f"error ({role}): {e}" for role, e in st.errors.items()]
    lines += [f"retrying ({role}): {m}" for role, m in st.retrying.items()]
    last = st.autoscale.last if st.autoscale is not None else None
    if last is not None:
        lines.append(f"autoscaler: prefill {last.prefill} ({last.prefill_reason}), decode {last.decode} "
                     f"({last.decode_reason}) — {last.detail}")
    return "\n".join(lines)
