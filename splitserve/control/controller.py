"""The Controller (DESIGN.md §4 "Ray"): a named, detached Ray actor, one per app, that owns the
worker registry and keeps each pool at its target size.

Every `probe_interval_s` it reconciles:
  * a STARTING worker whose model has loaded registers (`describe`: node, endpoints) → READY;
    one whose constructor refused its configuration is DEAD with that reason, and its pool
    stops growing until the targets change (a crash loop would only repeat the refusal);
  * every live worker is probed (`load`, answered without waiting on the engine); a probe
    unanswered for `probe_timeout_s` marks it slow (`silent_since`: shown; routers prefer its
    pool's other workers, never drop the last ones for it); an actor that died, an engine that
    stopped, or silence for `dead_after_s` makes it DEAD (killed, out of the registry, so
    routers drop it at their next refresh) and the pool gets a replacement;
  * a pool above target drains its least loaded workers: DRAINING leaves placement at once;
    once idle (nothing running, waiting, pulling or leased) for `drain_grace_s` (routers have
    seen it leave by then) its block counts are checked and recorded and it STOPs;
  * a pool below target spawns workers; one Ray has not placed within `PLACEMENT_GRACE_S` is
    diagnosed (control/unplaced.py) and `status` says why and what would place it (`scale`
    waits for that, briefly, so it can say it at once) — on a cluster we started, a worker no
    node could ever hold ends its pool's growth with that reason, as a refusal does.

With `autoscale` set, every `interval_s` its `Autoscaler` reads the READY workers' last loads
and the latencies routers `report`, and the targets it returns are applied as `scale`'s are:
a smaller pool drains (no request fails), a larger one spawns workers — on KubeRay a worker
Ray cannot place yet stays pending, and Ray's autoscaler adds a node of its pool's group.

The Serve ingress replicas are its owners (`attach` / `detach`, from their constructor and
`__del__`; one whose actor died is detached too, control/owners.py): when the last one leaves —
the app was deleted — it stops every worker and exits.

It is not a single point of failure (control/persisted.py): its workers are detached named
actors that outlive it, and what it decided is saved in Ray's GCS after every change. Killed,
Ray restarts it (`max_restarts=-1`); the new incarnation loads that state, finds each worker
again by name (one that died meanwhile is replaced), and resumes at the first call — routers
keep placing on their last snapshot meanwhile, and streams, which run between the ingress and
the workers, never pass through it. Its owners attach again when they see its new `epoch`.
"""

from __future__ import annotations

import asyncio
import dataclasses
import logging
import os
import time
import uuid

import ray

from splitserve.control.autoscale import Autoscaler, AutoscaleReport
from splitserve.control.actors import gpu_share, resolve_transports, spawn
from splitserve.control.admin import find  # noqa: F401  (drivers look the app up through either module)
from splitserve.control import persisted
from splitserve.control.owners import Owners
from splitserve.control.start_backoff import StartBackoff
from splitserve.control.status import ClusterStatus, cores_shared, status_row
from splitserve.control.unplaced import PLACEMENT_GRACE_S, Unplaced, demand, diagnose
from splitserve.control.registry import Registry
from splitserve.router.snapshot import RegistrySnapshot, WorkerRecord
from splitserve.control.deploy_config import DeployConfig
from splitserve.types import ConfigError, Role, WorkerId, WorkerLoad, WorkerState

log = logging.getLogger(__name__)
S = WorkerState
# what a worker runs: a change to any of these replaces every worker
WORKER_KEYS = ("model", "engine", "transport", "prefill_resources", "decode_resources", "on_transfer_failure",
               "lease_s", "worker_classes", "kv_secret")


class Controller:
    def __init__(self, cfg: DeployConfig, joined: bool = True) -> None:
        self.cfg = cfg.with_kv_secret()  # the app's, kept across rebuilds (and restarts: persisted)
        self.registry = Registry()
        self.autoscaler: Autoscaler | None = None
        self._set_config_targets(cfg)
        self.errors: dict[Role, str] = {}
        self.backoff = StartBackoff()  # workers that failed to start: retried ever later
        self._kinds = resolve_transports(cfg.transport)
        self._joined = joined
        self.owners = Owners()
        self._describing: dict[WorkerId, asyncio.Task] = {}
        self._probes: dict[WorkerId, asyncio.Task] = {}
        self._groups: dict[WorkerId, object] = {}  # every worker's placement group
        self._placing: dict[WorkerId, asyncio.Task] = {}  # watching a group until Ray places it
        self._unplaced: dict[WorkerId, Unplaced] = {}  # why Ray has not placed a worker yet
        self._loop: asyncio.Task | None = None
        self._autoscaling: asyncio.Task | None = None
        self._watching: asyncio.Task | None = None
        self._closed = False
        self.epoch = uuid.uuid4().hex[:12]  # this incarnation
        self._saved: tuple | None = None  # what was last saved, to save only changes
        self.restored = self._restore()

    def _restore(self) -> bool:
        """A restart: the previous incarnation's config, targets and workers (found by name;
        one gone is recorded dead and replaced at the first reconcile)."""
        state = persisted.load(self.cfg)
        if state is None:
            return False
        self.cfg, self._kinds = state.cfg, resolve_transports(state.cfg.transport)
        self._set_config_targets(state.cfg)
        self.targets = dict(state.targets)
        found, lost = [], []
        for rec in state.workers:
            name = persisted.worker_name(self.cfg, rec.id)
            try:
                handle = ray.get_actor(name, namespace=self.cfg.namespace)
                self._groups[rec.id] = ray.util.get_placement_group(name)
            except ValueError:
                lost.append(rec)
                continue
            found.append(dataclasses.replace(rec, handle=handle))
        self.registry.restore(found, state.version)
        for rec in lost:
            self.registry.record_lost(rec, "lost while the Controller restarted")
        if state.owned:
            self.owners.expect()  # the replicas attach again when they see the new epoch
        log.warning("Controller restarted: re-adopted %d workers, %d were lost", len(found), len(lost))
        return True

    # -- the API (Ray methods) ------------------------------------------------------------------
    async def start(self) -> int:
        """Begin reconciling (idempotent; a restarted Controller begins at its first call);
        returns the registry version."""
        if self._loop is None:
            self._loop = asyncio.get_running_loop().create_task(self._reconcile_forever())
            self._autoscaling = asyncio.get_running_loop().create_task(self._autoscale_forever())
            self._watching = asyncio.get_running_loop().create_task(self.owners.watch(self.cfg.probe_interval_s))
            self._reconcile()
        return self.registry.version

    async def configure(self, cfg: DeployConfig) -> None:
        """The app's config, from each ingress replica as it starts. Only a changed config
        changes anything (so a restarted replica does not undo `scale`): new targets, and when
        what the workers run changed, every worker is replaced (drained, new ones started)."""
        cfg = cfg.with_kv_secret(self.cfg.kv_secret)  # a rebuild without one keeps the app's
        if cfg == self.cfg:
            return
        replace = any(getattr(cfg, k) != getattr(self.cfg, k) for k in WORKER_KEYS)
        self.cfg, self._kinds = cfg, resolve_transports(cfg.transport)
        self._set_config_targets(cfg)
        self.errors.clear()
        if replace:
            for rec in self.registry:
                if rec.state is S.STARTING:
                    self._end(rec.id, S.STOPPED, "the app's configuration changed")
                elif rec.state is S.READY:
                    self.registry.move(rec.id, S.DRAINING)
        self._reconcile()

    async def snapshot(self, known_version: int = -1) -> RegistrySnapshot | None:
        """The registry for routers; None when it has not changed since `known_version`."""
        await self._resume()
        if known_version == self.registry.version:
            return None
        return self.registry.snapshot(self.targets, self._autoscale_report(), self.epoch)

    async def _resume(self) -> None:
        if self.restored and self._loop is None and not self._closed:
            await self.start()

    async def report(self, samples: list) -> None:
        """Finished requests' latencies from a router (autoscale.RequestSample)."""
        if self.autoscaler is not None:
            self.autoscaler.record(samples)

    async def scale(self, role: str, n: int) -> dict:
        await self._resume()
        role = Role(role)
        low, high = (1 if role is Role.DECODE else 0), self.cfg.max_pool_size
        if not isinstance(n, int) or not low <= n <= high:
            raise ConfigError(f"{role.value} pool size must be an integer in [{low}, {high}] (max_pool_size), "
                              f"got {n!r}")
        if role is Role.PREFILL and n > 0 and self.cfg.decode_pp > 1:
            raise ConfigError(f"decode_pp {self.cfg.decode_pp}: the prefill pool stays at 0 (the KV handoff into "
                              f"pipeline stages is not built)")
        if role is Role.PREFILL and n > 0 and self.cfg.dp > 1:
            raise ConfigError(f"data_parallel_size {self.cfg.dp}: the prefill pool stays at 0 (a data-parallel "
                              f"worker takes no prefill handoff yet)")
        self.targets[role] = n
        self.errors.pop(role, None)  # new targets: try again
        placing = set(self._placing)
        self._reconcile()
        await self._placed_or_diagnosed(set(self._placing) - placing)  # so the caller can say why one waits
        return {r.value: t for r, t in self.targets.items()}

    async def _placed_or_diagnosed(self, wids: set, bound_s: float = PLACEMENT_GRACE_S + 3.0) -> None:
        deadline = time.monotonic() + bound_s
        while any(w in self._placing and w not in self._unplaced for w in wids) and time.monotonic() < deadline:
            await asyncio.sleep(0.05)

    async def status(self) -> ClusterStatus:
        await self._resume()
        rows = [status_row(r, self._unplaced.get(r.id)) for r in self.registry]
        rows += [status_row(r) for r in self.registry.ended()[-16:]]
        live = {role.value: len(self.registry.pool(role, S.STARTING, S.READY, S.DRAINING)) for role in Role}
        # a cluster we started is this machine alone, the Controller's; one we joined places by its nodes' CPUs
        sharing = "" if self._joined else cores_shared(self.cfg, live, ray.cluster_resources().get("GPU", 0.0),
                                                       os.cpu_count() or 1)
        return ClusterStatus({r.value: t for r, t in self.targets.items()}, tuple(rows),
                             {r.value: e for r, e in self.errors.items()}, self.registry.version,
                             self._autoscale_report(), tuple(self._unplaced.values()), self.backoff.messages(),
                             sharing)

    async def ended(self) -> list[WorkerRecord]:
        """Workers that stopped or died, newest last (with a drained worker's final counts)."""
        return self.registry.ended()

    async def attach(self, owner: str, handle=None) -> None:
        """An ingress replica (`handle`: its actor, watched until it dies) owns this app."""
        self.owners.attach(owner, handle)

    async def detach(self, owner: str) -> None:
        self.owners.detach(owner)

    async def shutdown(self) -> None:
        """Stop every worker and this actor."""
        await self._stop_all()
        await self._exit()

    async def _exit(self) -> None:
        """End this actor's own tasks (so none is destroyed pending, which Python reports at
        exit), then the actor — for good: nothing is left for a restart to resume."""
        persisted.forget(self.cfg)
        tasks = [t for t in (self._loop, self._autoscaling, self._watching, *self._placing.values(),
                             *self._describing.values(), *self._probes.values())
                 if t is not None and t is not asyncio.current_task()]
        for t in tasks:
            t.cancel()
        if tasks:
            await asyncio.wait(tasks, timeout=5)
        ray.actor.exit_actor()

    # -- autoscaling ----------------------------------------------------------------------------
    def _set_config_targets(self, cfg: DeployConfig) -> None:
        """The targets a (new) config sets; a changed autoscale config starts a fresh autoscaler."""
        if cfg.autoscale is None:
            self.autoscaler = None
        elif self.autoscaler is None or self.autoscaler.config != cfg.autoscale:
            self.autoscaler = Autoscaler(cfg.autoscale)
        a = self.autoscaler
        self.targets = {r: a.initial(r, n) if a else n for r, n in ((Role.PREFILL, cfg.prefill),
                                                                      (Role.DECODE, cfg.decode))}

    def _autoscale_report(self) -> AutoscaleReport | None:
        return None if self.autoscaler is None else self.autoscaler.report(self.targets)

    async def _autoscale_forever(self) -> None:
        while not self._closed:
            a = self.autoscaler
            await asyncio.sleep(a.config.interval_s if a else 1.0)
            if a is None or a is not self.autoscaler or self._closed:
                continue
            try:
                self._autoscale(a)
            except Exception:  # a bad round must not stop autoscaling
                log.exception("autoscaling failed")

    def _autoscale(self, a: Autoscaler) -> None:
        loads = {role: {str(r.id): r.load.stats for r in self.registry.pool(role, S.READY) if r.load is not None}
                 for role in Role}
        starting = {role: len(self.registry.pool(role, S.STARTING)) for role in Role}
        decision = a.tick(time.time(), dict(self.targets), loads[Role.PREFILL], loads[Role.DECODE], starting)
        for role in Role:
            if decision.target(role) != self.targets[role]:
                self.targets[role] = decision.target(role)
                self.errors.pop(role, None)
        self.registry.touch()  # routers export the new report
        self._reconcile()

    # -- reconciling ----------------------------------------------------------------------------
    async def _reconcile_forever(self) -> None:
        while not self._closed:
            await asyncio.sleep(self.cfg.probe_interval_s)
            if self.owners.orphaned():
                log.warning("the app's ingress is gone: stopping every worker")
                await self._stop_all()
                await self._exit()
            try:
                self._reconcile()
            except Exception:  # never let one bad round stop the control loop
                log.exception("reconcile failed")

    def _reconcile(self) -> None:
        for rec in self.registry:
            if rec.state is S.STARTING and rec.id not in self._describing:
                self._describing[rec.id] = asyncio.get_running_loop().create_task(self._register(rec))
            elif rec.state in (S.READY, S.DRAINING) and rec.id not in self._probes:
                self._probes[rec.id] = asyncio.get_running_loop().create_task(self._probe(rec.id))
        for role in Role:
            self._resize(role)
        self.registry.check_invariants()
        self._save()

    def _save(self) -> None:
        """Persist what a restart needs, when it changed (control/persisted.py)."""
        if self._closed:
            return
        now = (self.registry.version, tuple(sorted(self.targets.items())), self.cfg, self.owners.owned)
        if now != self._saved:
            persisted.save(persisted.ControllerState.of(self.cfg, self.targets, self.registry.version,
                                                        list(self.registry), self.owners.owned))
            self._saved = now

    def _resize(self, role: Role) -> None:
        active = self.registry.pool(role, S.STARTING, S.READY)
        extra = len(active) - self.targets[role]
        if extra > 0:
            # starting ones first (nothing placed there yet), then the least loaded, newest first
            order = sorted(active, key=lambda r: (r.state is S.READY, _busy(r.load), -r.since))
            for rec in order[:extra]:
                if rec.state is S.STARTING:
                    self._end(rec.id, S.STOPPED, "scaled down before it was ready")
                else:
                    self.registry.move(rec.id, S.DRAINING)
        elif extra < 0 and role not in self.errors and self.backoff.may_spawn(role):
            for _ in range(-extra):
                self._spawn(role)

    def _spawn(self, role: Role) -> None:
        wid = WorkerId.new(role)
        try:
            ranks = self.cfg.ranks(self.targets[Role.PREFILL], self.targets[Role.DECODE])  # a device each
            share = gpu_share(str(self.cfg.engine.get("device", "auto")), ray.cluster_resources().get("GPU", 0.0),
                              ranks, joined=self._joined, growing=self.autoscaler is not None)
            spawned = spawn(self.cfg, wid, self._kinds, share, name=persisted.worker_name(self.cfg, wid))
        except ConfigError as e:
            self.errors[role] = str(e)
            return
        self._groups[wid] = spawned.group
        self.registry.add(wid, spawned.handle)
        self._placing[wid] = asyncio.get_running_loop().create_task(self._watch_placement(wid, spawned))

    async def _watch_placement(self, wid: WorkerId, spawned) -> None:
        """Until Ray places the worker's group: past the grace, `unplaced` says why; on a cluster
        we started, a worker no node could ever hold ends its pool's growth."""
        placed = asyncio.wrap_future(spawned.group.ready().future())
        try:
            done, _ = await asyncio.wait({placed}, timeout=PLACEMENT_GRACE_S)
            if not done:
                # a PACK group (pipeline stages) may span nodes: what one node must hold is bundle 0
                need = demand(spawned.bundles if spawned.one_node else spawned.bundles[:1])
                why = diagnose(wid.role, need, [n["Resources"] for n in ray.nodes() if n.get("Alive")],
                               ray.available_resources(), joined=self._joined)
                self._unplaced[wid] = why
                log.warning("%s", why.message)
                if why.infeasible and not self._joined and wid in self.registry:
                    self.errors[wid.role] = why.describe()
                    self._end(wid, S.DEAD, why.describe())
                    return
                await placed
        finally:
            placed.cancel()
            self._placing.pop(wid, None)
            self._unplaced.pop(wid, None)

    async def _register(self, rec: WorkerRecord) -> None:
        try:
            info = await rec.handle.describe.remote()
        except Exception as e:
            refused = config_error_in(e)
            if refused is not None:
                self.errors[rec.role] = str(refused)
            if rec.id in self.registry and self.registry[rec.id].state is S.STARTING:
                why = str(refused) if refused else f"failed to start: {_first_line(e)}"
                if refused is None:
                    self.backoff.failed(rec.role, why)
                self._end(rec.id, S.DEAD, why)
            return
        finally:
            self._describing.pop(rec.id, None)
        if rec.id in self.registry and self.registry[rec.id].state is S.STARTING:
            self.registry.move(rec.id, S.READY, info=info)
            self._save()  # now, not at the next round: a restart in between would take it for one still starting
            self.backoff.started(rec.role)
            log.info("worker %s ready on %s", rec.id, info.node_ip)

    async def _probe(self, wid: WorkerId) -> None:
        """Probe one worker until it leaves the registry (DESIGN.md §4 "Liveness"). Slow and dead
        are apart: a probe unanswered for `probe_timeout_s` (or refused by Ray as unreachable for
        the moment) marks it slow — shown, not taken out of placement; DEAD only when its actor
        died, its engine stopped, or it stayed silent for `dead_after_s` — a worker starved of
        CPU, compiling or paused is not killed with its requests."""
        silent_since: float | None = None  # monotonic: when the first probe it has not answered was sent
        try:
            while wid in self.registry and not self._closed:
                asked = asyncio.ensure_future(self.registry[wid].handle.load.remote())
                sent = time.monotonic()
                load = None
                while wid in self.registry:
                    done, _ = await asyncio.wait({asked}, timeout=self.cfg.probe_timeout_s)
                    if done:
                        try:
                            load = asked.result()
                        except Exception as e:
                            if not unreachable(e):
                                self._end(wid, S.DEAD, f"its actor died ({type(e).__name__})")
                                return
                        break
                    silent_since = self._silent(wid, silent_since, sent)
                    if silent_since is None:
                        return
                if wid not in self.registry:
                    return
                if load is None:  # unreachable for the moment: silent, as if unanswered
                    silent_since = self._silent(wid, silent_since, sent)
                    if silent_since is None:
                        return
                elif load.failure is not None:
                    self._end(wid, S.DEAD, f"its engine stopped ({load.failure})")
                    return
                else:
                    silent_since = None
                    self.registry.observe(wid, load)
                    self.registry.set_silent(wid, None)
                    rec = self.registry[wid]
                    if rec.state is S.DRAINING and load.idle and time.time() - rec.since >= self.cfg.drain_grace_s:
                        await self._stop_drained(wid)
                        return
                await asyncio.sleep(self.cfg.probe_interval_s)
        finally:
            self._probes.pop(wid, None)

    def _silent(self, wid: WorkerId, since: float | None, sent: float) -> float | None:
        """A probe sent at `sent` went unanswered: the worker is slow from the first such probe
        on (`since`, returned), and DEAD once that is `dead_after_s` ago (None returned)."""
        since = sent if since is None else since
        self.registry.set_silent(wid, time.time() - (time.monotonic() - since))
        if time.monotonic() - since >= self.cfg.dead_after_s:
            self._end(wid, S.DEAD, f"no answer to health probes for {self.cfg.dead_after_s:g} s")
            return None
        return since

    async def _stop_drained(self, wid: WorkerId) -> None:
        handle = self.registry[wid].handle
        try:
            counts = await asyncio.wait_for(handle.check_invariants.remote(), 10)
            await asyncio.wait_for(handle.close.remote(), 10)
        except Exception as e:  # the invariant broke, or it died on the way out
            self._end(wid, S.DEAD, f"failed while stopping: {type(e).__name__}: {e}")
            return
        self._end(wid, S.STOPPED, "drained", final_counts=counts)

    def _end(self, wid: WorkerId, state: WorkerState, reason: str, **changes) -> None:
        handle = self.registry[wid].handle
        self.registry.move(wid, state, reason=reason, **changes)
        if state is S.DEAD:
            log.warning("worker %s is dead: %s", wid, reason)
        try:
            ray.kill(handle, no_restart=True)
        except Exception:
            pass
        watch = self._placing.pop(wid, None)
        if watch is not None and watch is not asyncio.current_task():
            watch.cancel()
        group = self._groups.pop(wid, None)
        if group is not None:  # its other ranks go with it, and its reservation
            ray.util.remove_placement_group(group)

    async def _stop_all(self) -> None:
        """Every worker closed (all at once, each given 5 s: a slow machine's teardown stays
        bounded), then killed."""
        self._closed = True
        self.targets = {r: 0 for r in Role}
        records = list(self.registry)
        try:
            await asyncio.wait_for(asyncio.gather(*(r.handle.close.remote() for r in records), return_exceptions=True),
                                   5)
        except asyncio.TimeoutError:
            pass
        for wid in [r.id for r in records]:
            if wid not in self.registry:  # ended meanwhile (a probe found it dead)
                continue
            if self.registry[wid].state is S.READY:  # as it is now: a reconcile may have drained it
                self.registry.move(wid, S.DRAINING)
            self._end(wid, S.STOPPED, "the app stopped")


def _busy(load: WorkerLoad | None) -> int:
    return 0 if load is None else load.stats.num_waiting + load.stats.num_running + load.held


def unreachable(e: BaseException) -> bool:
    """Ray could not reach the actor for the moment (it may answer later): slow, not a death
    (the Controller's probes, and each router's polls: orchestrator/cluster_backend.py)."""
    return isinstance(e, ray.exceptions.ActorUnavailableError)


def _first_line(e: BaseException) -> str:
    """An actor's death, in a line: Ray's own error text is many, with the traceback."""
    lines = [ln.strip() for ln in str(e).splitlines() if ln.strip()]
    last = next((ln for ln in reversed(lines) if ":" in ln and not ln.startswith(("File ", "^"))), None)
    return (last or type(e).__name__)[:200]


def config_error_in(e: BaseException) -> ConfigError | None:
    """The ConfigError a worker's constructor raised, recovered from Ray's actor error (which
    keeps only its text)."""
    marker = f"{ConfigError.__module__}.ConfigError: "
    text = str(e)
    if marker not in text:
        return None
    return ConfigError(text.rsplit(marker, 1)[1].strip().splitlines()[0])


ControllerActor = ray.remote(Controller)


def get_or_create(cfg: DeployConfig, joined: bool = True):
    """The app's Controller: the running one if there is one, else a new detached one (its
    pools start with `start`), on this node — the ingress's (on KubeRay the head), never a
    worker pod the cluster autoscaler may take away."""
    from ray.util.scheduling_strategies import NodeAffinitySchedulingStrategy

    here = NodeAffinitySchedulingStrategy(ray.get_runtime_context().get_node_id(), soft=True)
    handle = ControllerActor.options(name=cfg.name, namespace=cfg.namespace, lifetime="detached",
                                     get_if_exists=True, num_cpus=0, max_concurrency=1000, max_restarts=-1,
                                     scheduling_strategy=here).remote(cfg, joined)
    return handle
