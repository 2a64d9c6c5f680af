"""One splitserve application's configuration (`DeployConfig`): what `serve --config`, the Serve
app's args (`splitserve.deploy:build_app`, a RayService's serveConfigV2) and `Cluster.start` hold.
Frozen and checked where it is made (the driver), so a bad key or value fails before any actor
starts. It names the app's parts by their names (a routing policy, a transport, the autoscaler's
bounds, the API keys), so it lives with the Controller that runs them, above the ground floor."""

from __future__ import annotations

import dataclasses
import secrets
from dataclasses import dataclass
from typing import Any

from splitserve.config import KV_TRANSPORTS, EngineConfig
from splitserve.tracing import TraceConfig
from splitserve.types import ConfigError

POOL_KEYS = ("prefill", "decode")
PP_PLACEMENTS = ("pack", "spread")
TRANSPORTS = ("auto",) + KV_TRANSPORTS
ENGINE_FLAG_KEYS = ("dtype", "kv_cache_dtype", "device", "attention_backend", "kv_cache_memory_gib",
                    "gpu_memory_utilization", "host_kv_blocks", "tensor_parallel_size", "speculative")
# engine settings only the decode pool's workers take: speculative decoding verifies proposals in
# decode steps, and a prefill worker runs none (it computes the prompt, samples the first token
# and hands the KV over), so there a proposer would only cost memory and a config to check —
# except a draft head's (method draft): the prefill worker runs the head over the prompt, whose
# draft KV (one more cache layer) the handoff carries, so both pools take that config
DECODE_ONLY_ENGINE_KEYS = ("speculative",)


@dataclass(frozen=True)
class DeployConfig:
    """One splitserve application on Ray: what `serve --config` and the Serve app's args
    (`splitserve.deploy:build_app`, a RayService's serveConfigV2) hold. Frozen and checked here,
    so a bad key or value fails before any actor starts."""

    model: str
    served_model_name: str | None = None
    prefill: int = 1
    decode: int = 1
    prefill_tp: int = 1  # tensor-parallel ranks per prefill worker (one placement group, one node)
    decode_tp: int = 1
    # pipeline stages per worker (each stage its TP ranks; one placement group). Beside a prefill
    # pool the KV moves by stage (kv_transfer/stage_slices.py) between one-rank stages: PP and TP
    # mix only in aggregated apps (prefill 0).
    prefill_pp: int = 1
    decode_pp: int = 1
    # where a pipeline-parallel worker's stages sit: "pack" (Ray's PACK: on as few nodes as fit,
    # so activations stay on a node where they can) or "spread" (STRICT_SPREAD: every stage on a
    # node of its own — the memory of several nodes for one model; only for one-rank stages, as
    # one placement group cannot pack a stage's TP ranks on a node and spread the stages)
    pp_placement: str = "pack"
    prefill_resources: dict = dataclasses.field(default_factory=dict)  # extra Ray resources per worker
    decode_resources: dict = dataclasses.field(default_factory=dict)
    transport: str = "auto"
    policy: str = "cache_aware"
    disagg_min_tokens: int = 32
    pd_decider: str = "slo"  # router/pd_decider.py: which requests go through a prefill worker
    # Stream a prompt's KV to its decode worker while the prefill computes it (DESIGN.md §1,
    # worker/decode/streamed.py), for contexts of at least kv_streaming_min_tokens; below, and
    # with it off, the KV moves in one piece after the prefill.
    kv_streaming: bool = True
    kv_streaming_min_tokens: int = 2048  # the default step budget: a prompt within one step streams nothing
    engine: dict = dataclasses.field(default_factory=dict)  # EngineConfig keys (model aside)
    max_inflight: int = 256
    # max_tokens of a request that sets none (chat; completions too): None, the model's
    # generation_config.json max_new_tokens, else up to the context (completions: 16)
    max_tokens_default: int | None = None
    tool_call_parser: str | None = None  # how the model writes tool calls (text/tool_calls.py); None: from its template
    ttft_slo_ms: float | None = None
    tpot_slo_ms: float | None = None
    admission: bool = True
    ingress_replicas: int = 1
    max_pool_size: int = 64  # the most workers `scale` (or the config) may ask of one pool
    name: str = "splitserve"  # the Serve app's name and its Controller's
    namespace: str = "splitserve"  # the Ray namespace the Controller is named in
    on_transfer_failure: str = "recompute"
    lease_s: float = 30.0
    probe_interval_s: float = 0.5  # Controller health probes
    # A probe (or a router's load poll) unanswered this long: the worker is *slow* — shown in
    # status and /metrics, and placed on only while no other worker of its pool answers; the last
    # ones of a pool are never taken out of placement for it (requests wait for them).
    probe_timeout_s: float = 1.0
    # Silent this long: the worker is DEAD (killed, replaced). Long against what a live worker
    # can be silent through: a step, a compile or a load on a CPU shared with other work (on 2
    # busy cores workers went unanswered for over 5 s). An exited process Ray reports at once,
    # and a silent worker's streams move on their own (decode_inactivity_timeout_s), so this
    # bound only says when a stopped or hung one is replaced.
    dead_after_s: float = 60.0
    drain_grace_s: float = 1.0  # a draining worker idle this long (routers have seen it leave) stops
    prefill_timeout_s: float = 120.0  # a prefill call unanswered this long: its worker failed, place again
    # no token for this long mid-stream, nor an answer to a ping: migrate the request (before its
    # first token the decode worker may be computing the whole prompt: prefill_timeout_s then)
    decode_inactivity_timeout_s: float = 30.0
    migration_limit: int = 3  # how many times one request may move to another decode worker
    # Pool autoscaling (autoscale.AutoscaleConfig; a mapping is read into one): None, the pools
    # stay at prefill / decode (and `splitserve scale`); set, those are the starting sizes.
    autoscale: Any = None
    # The worker class of a pool, as "module:Class" (a PrefillWorker / DecodeWorker subclass):
    # what tests use to put fault-injecting fakes into real actors. Empty: the real ones.
    worker_classes: dict = dataclasses.field(default_factory=dict)
    # API keys: a key file's path, its content, or a KeyRing; read into the tenancy.KeyRing the
    # ingress checks (plus SPLITSERVE_API_KEY where this config is made); none: the ingress is open.
    api_keys: Any = None
    # The secret every worker's TCP KV server challenges its readers for (hex), never printed.
    # None: the app's Controller makes one and keeps it (control/controller.py) — every rebuild
    # of the app (a config change, a replica restart) makes a new DeployConfig, and the workers
    # it keeps must go on accepting the ones it starts. Given: rotating it replaces every worker.
    kv_secret: str | None = dataclasses.field(default=None, repr=False)
    # A file holding kv_secret (a mounted Kubernetes Secret, on the node where the app is built):
    # read once, here, into kv_secret.
    kv_secret_file: str | None = None
    # Redis, where the ingress replicas share rate limits and in-flight load (None: each its own).
    redis_url: str | None = None
    # OpenTelemetry traces (tracing.py): the OTLP endpoint and the share of requests traced;
    # unset, the standard OTEL_* variables of each process decide (no endpoint: off).
    otlp_traces_endpoint: str | None = None
    trace_sample_ratio: float | None = None

    def with_kv_secret(self, kept: str | None = None) -> "DeployConfig":
        """This config with a KV secret: its own if given, else `kept` (the app's), else a new one."""
        if self.kv_secret is not None:
            return self
        return dataclasses.replace(self, kv_secret=kept or secrets.token_hex(32))

    def _read_kv_secret_file(self) -> None:
        """kv_secret from its file, once: the path is dropped, so a copy of this config made
        elsewhere (`dataclasses.replace` in the Controller) does not look for the file there."""
        if self.kv_secret_file is None:
            return
        if self.kv_secret is not None:
            raise ConfigError("set kv_secret or kv_secret_file, not both")
        try:
            with open(self.kv_secret_file, encoding="ascii") as f:
                text = f.read(4096).strip()
        except (OSError, UnicodeDecodeError) as e:
            raise ConfigError(f"kv_secret_file {self.kv_secret_file}: cannot be read ({e.__class__.__name__})") from None
        object.__setattr__(self, "kv_secret", text)
        object.__setattr__(self, "kv_secret_file", None)

    def __post_init__(self) -> None:
        from splitserve.router.policy import POLICIES
        from splitserve.tenancy import KeyRing

        object.__setattr__(self, "api_keys", KeyRing.from_options(self.api_keys).with_env())
        self._read_kv_secret_file()
        try:
            if self.kv_secret is not None and len(bytes.fromhex(self.kv_secret)) < 16:
                raise ValueError
        except (TypeError, ValueError):
            raise ConfigError("kv_secret must be at least 32 hex digits") from None
        self.trace  # noqa: B018 - checked now (ConfigError), read again where the spans are made
        if self.redis_url is not None and not str(self.redis_url).startswith(("redis://", "rediss://", "unix://")):
            raise ConfigError(f"redis_url must be a redis://, rediss:// or unix:// URL, got {self.redis_url!r}")

        def integer(name: str, low: int) -> None:
            v = getattr(self, name)
            if not isinstance(v, int) or isinstance(v, bool) or v < low:
                raise ConfigError(f"{name} must be an integer >= {low}, got {v!r}")

        from splitserve.router.pd_decider import DECIDERS

        if self.pd_decider not in DECIDERS:
            raise ConfigError(f"pd_decider must be one of {', '.join(DECIDERS)}, got {self.pd_decider!r}")
        if not isinstance(self.kv_streaming, bool):
            raise ConfigError(f"kv_streaming must be true or false, got {self.kv_streaming!r}")
        for name, low in (("prefill", 0), ("decode", 1), ("disagg_min_tokens", 0), ("kv_streaming_min_tokens", 0),
                          ("max_inflight", 1),
                          ("ingress_replicas", 1), ("migration_limit", 0), ("max_pool_size", 1),
                          ("prefill_tp", 1), ("decode_tp", 1), ("prefill_pp", 1), ("decode_pp", 1)):
            integer(name, low)
        for pool in ("prefill", "decode"):
            if getattr(self, pool) > self.max_pool_size:
                raise ConfigError(f"{pool} {getattr(self, pool)} is above max_pool_size {self.max_pool_size}")
        if self.max_tokens_default is not None:
            integer("max_tokens_default", 1)
        if self.tool_call_parser is not None:
            from splitserve.text.tool_calls import format_for

            format_for(None, self.tool_call_parser)  # ConfigError names the known ones
        if self.transport not in TRANSPORTS:
            raise ConfigError(f"unknown transport {self.transport!r}; known: {', '.join(TRANSPORTS)}")
        if self.policy not in POLICIES:
            raise ConfigError(f"unknown policy {self.policy!r}; known: {', '.join(POLICIES)}")
        if self.on_transfer_failure not in ("recompute", "fail"):
            raise ConfigError(f"on_transfer_failure must be recompute or fail, got {self.on_transfer_failure!r}")
        for role in POOL_KEYS:
            _check_resources(f"{role}_resources", getattr(self, f"{role}_resources"))
        _check_worker_classes(self.worker_classes)
        for name in ("lease_s", "probe_interval_s", "probe_timeout_s", "dead_after_s", "drain_grace_s",
                     "prefill_timeout_s", "decode_inactivity_timeout_s"):
            v = getattr(self, name)
            if not isinstance(v, (int, float)) or isinstance(v, bool) or not v > 0:
                raise ConfigError(f"{name} must be a positive number of seconds, got {v!r}")
        if self.dead_after_s < self.probe_timeout_s:
            raise ConfigError(f"dead_after_s ({self.dead_after_s}) must be >= probe_timeout_s ({self.probe_timeout_s})")
        for name in ("ttft_slo_ms", "tpot_slo_ms"):
            v = getattr(self, name)
            if v is not None and (not isinstance(v, (int, float)) or isinstance(v, bool) or not v > 0):
                raise ConfigError(f"{name} must be a positive number of milliseconds, got {v!r}")
        if self.autoscale is not None:
            object.__setattr__(self, "autoscale", self._autoscale_config())
        if not isinstance(self.engine, dict) or "model" in self.engine:
            raise ConfigError("engine: must be a mapping of engine settings (the model is set by model:)")
        if not isinstance(self.engine.get("pipeline_parallel_size", 1), int) or \
                self.engine.get("pipeline_parallel_size", 1) > 1:
            raise ConfigError("pipeline_parallel_size is set per pool on a cluster: prefill_pp and decode_pp "
                              "(serve --prefill-pp / --decode-pp)")
        self._check_dp()  # before the pools' engine configs: their own refusal of DP x TP/PP names no pool
        ecfg = EngineConfig.from_dict({"model": self.model, **self.pool_engine("decode")})  # every key checked now
        if ecfg.tensor_parallel_size > 1:
            raise ConfigError("tensor_parallel_size is set per pool on a cluster: prefill_tp and decode_tp "
                              "(serve --prefill-tp / --decode-tp)")
        for role in POOL_KEYS:
            try:
                EngineConfig.from_dict({"model": self.model, **self.pool_engine(role),
                                        "tensor_parallel_size": self.tp(role)})
            except ConfigError as e:  # the engine's words name its own keys, not the pool they came from
                raise ConfigError(f"the {role} pool ({role}_tp {self.tp(role)}, {role}_pp {self.pp(role)}): {e}") from None
        self._check_pp()
        if self.transport == "nixl" and self.prefill and max(self.prefill_tp, self.decode_tp) > 1:
            raise ConfigError("the KV handoff between tensor-parallel groups moves over shm or tcp (transport auto "
                              "picks them for such a pair), not nixl yet")

    def _check_dp(self) -> None:
        """A data-parallel worker (engine `data_parallel_size` D > 1: D replicas, one process and
        bundle each, experts spread over them) serves aggregated apps only: its front takes no
        prefill handoff, and each replica is one process (no TP or PP inside). (A bad value is
        EngineConfig's to refuse.)"""
        d = self.engine.get("data_parallel_size", 1)
        if not isinstance(d, int) or d <= 1:
            return
        prefill_max = self.autoscale.prefill.max if self.autoscale is not None else 0
        if self.prefill or prefill_max:
            raise ConfigError(f"data_parallel_size {d} beside a prefill pool: a data-parallel worker takes no "
                              f"prefill handoff (pulled KV) yet; it serves aggregated apps only (prefill 0)")
        for role in POOL_KEYS:
            for kind in ("tp", "pp"):
                if getattr(self, f"{role}_{kind}") > 1:
                    raise ConfigError(f"data_parallel_size {d} with {role}_{kind} {getattr(self, f'{role}_{kind}')}: "
                                      f"each data-parallel replica is one process (no tensor or pipeline "
                                      f"parallelism inside it yet)")

    def _check_pp(self) -> None:
        """What pipeline-parallel workers cannot do yet is refused here, before any actor starts,
        so nothing half-works: the KV handoff by stage moves whole layers between one-rank
        stages (or single workers), so beside a prefill pool no tensor-parallel group may meet a
        pipeline-parallel worker, and it moves over shm or tcp."""
        if self.pp_placement not in PP_PLACEMENTS:
            raise ConfigError(f"pp_placement must be one of {', '.join(PP_PLACEMENTS)}, got {self.pp_placement!r}")
        for role in POOL_KEYS:
            if self.pp_placement == "spread" and self.pp(role) > 1 and self.tp(role) > 1:
                raise ConfigError(f"pp_placement spread puts each of a worker's processes on a node of its own: "
                                  f"{role}_pp {self.pp(role)} with {role}_tp {self.tp(role)} would spread each "
                                  f"stage's tensor-parallel ranks too; use pp_placement pack")
        staged = [role for role in POOL_KEYS if self.pp(role) > 1]
        prefill_max = self.autoscale.prefill.max if self.autoscale is not None else 0
        if not staged or (self.prefill == 0 and prefill_max == 0):
            return  # no handoff (aggregated): PP x TP decode workers serve as they are
        role = staged[0]
        grouped = [r for r in POOL_KEYS if self.tp(r) > 1]
        if grouped:
            raise ConfigError(f"{role}_pp {self.pp(role)} with {grouped[0]}_tp {self.tp(grouped[0])} beside a prefill "
                              f"pool: the KV handoff by pipeline stage moves whole layers between one-rank stages; "
                              f"a tensor-parallel group on either side of it is not built (PP x TP serves "
                              f"aggregated apps only, prefill 0)")
        if self.transport == "nixl":
            raise ConfigError(f"{role}_pp {self.pp(role)}: the KV handoff by pipeline stage moves over shm or tcp "
                              f"(transport auto picks them for such a pair), not nixl yet")

    @classmethod
    def from_options(cls, options: dict[str, Any]) -> "DeployConfig":
        """From a config file's or the Serve app's args. Values may be strings (`serve run ...
        prefill=2 decode_resources='{"decode_node": 1}'`): each is read as YAML then. Engine
        settings may sit at the top level too (dtype, device, ...: the serve flags)."""
        known = {f.name for f in dataclasses.fields(cls)}
        types = {f.name: f.type for f in dataclasses.fields(cls)}
        opts, engine = {}, dict(_as_value(options.get("engine"), "engine") or {})
        for key, value in options.items():
            if key in ENGINE_FLAG_KEYS:
                if value is not None:
                    engine.setdefault(key, _as_value(value, key) if key != "device" else str(value))
            elif key == "no_admission":
                opts["admission"] = not _as_value(value, key)
            elif key not in known:
                raise ConfigError(f"unknown option {key!r}; known: {', '.join(sorted(known | set(ENGINE_FLAG_KEYS)))}")
            elif key != "engine":
                opts[key] = value if types[key] in ("str", "str | None") else _as_value(value, key)
        if not opts.get("model"):
            from splitserve.engine.model.demo import ensure_demo_model

            opts["model"] = str(ensure_demo_model())
        return cls(**opts, engine=engine)

    def _autoscale_config(self):
        from splitserve.control.autoscale import AutoscaleConfig

        if isinstance(self.autoscale, AutoscaleConfig):
            return self.autoscale
        ms = lambda v: None if v is None else v / 1000  # noqa: E731
        return AutoscaleConfig.from_dict(self.autoscale, ms(self.ttft_slo_ms), ms(self.tpot_slo_ms))

    @property
    def trace(self) -> TraceConfig:
        """Where this process's spans go: the config's settings over its OTEL_* variables."""
        return TraceConfig.resolve(self.otlp_traces_endpoint, self.trace_sample_ratio)

    def resources(self, role: str) -> dict:
        return dict(getattr(self, f"{role}_resources"))

    def tp(self, role: str) -> int:
        """Tensor-parallel ranks per worker of pool `role`."""
        return getattr(self, f"{role}_tp")

    def pp(self, role: str) -> int:
        """Pipeline stages per worker of pool `role`."""
        return getattr(self, f"{role}_pp")

    def pool_engine(self, role: str) -> dict:
        """The engine settings of pool `role`'s workers (tensor_parallel_size aside): its stages;
        pipeline_micro_batches applies to pools with stages only, speculative to the decode pool
        only (DECODE_ONLY_ENGINE_KEYS; with prefill 0 the decode workers compute prompts too) —
        but to both pools with method draft: the prefill worker computes the prompt's draft KV,
        and the two caches must have the same layers for the handoff."""
        engine = {**self.engine, "pipeline_parallel_size": self.pp(role)}
        if self.pp(role) == 1:
            engine.pop("pipeline_micro_batches", None)
        if role != "decode":
            for key in DECODE_ONLY_ENGINE_KEYS:
                if not (key == "speculative" and _draft_head(engine.get(key))):
                    engine.pop(key, None)
        return engine

    def ranks(self, prefill: int, decode: int) -> int:
        """The processes (each a CPU, or a GPU) `prefill` and `decode` workers take."""
        return prefill * self.prefill_tp * self.prefill_pp + decode * self.decode_tp * self.decode_pp * self.dp

    @property
    def dp(self) -> int:
        """Data-parallel replicas per worker (engine data_parallel_size; aggregated apps only)."""
        return self.engine.get("data_parallel_size", 1)


def _draft_head(speculative: Any) -> bool:
    """Whether a speculative setting (a mapping, a SpeculativeConfig or None) runs a draft head."""
    method = speculative.get("method") if isinstance(speculative, dict) else getattr(speculative, "method", None)
    return method == "draft"


def _as_value(value: Any, key: str) -> Any:
    if not isinstance(value, str):
        return value
    import yaml

    try:
        return yaml.safe_load(value)
    except yaml.YAMLError as e:
        raise ConfigError(f"{key}: cannot read {value!r}: {e}") from None


def _check_resources(name: str, res: Any) -> None:
    if not isinstance(res, dict):
        raise ConfigError(f"{name} must be a mapping of Ray resource names to amounts, got {res!r}")
    for k, v in res.items():
        if k in ("CPU", "GPU", "memory"):
            raise ConfigError(f"{name}: {k!r} is set by splitserve itself (device / one CPU per worker)")
        if not isinstance(k, str) or not isinstance(v, (int, float)) or isinstance(v, bool) or not v > 0:
            raise ConfigError(f"{name}: {k!r}: {v!r} must be a positive amount")


def _check_worker_classes(classes: Any) -> None:
    if not isinstance(classes, dict):
        raise ConfigError(f"worker_classes must be a mapping of pool (prefill, decode) to 'module:Class', "
                          f"got {classes!r}")
    for role, path in classes.items():
        if role not in POOL_KEYS:
            raise ConfigError(f"worker_classes: unknown pool {role!r}; pools: {', '.join(POOL_KEYS)}")
        if not isinstance(path, str) or path.count(":") != 1 or not all(path.split(":")):
            raise ConfigError(f"worker_classes: {role}: {path!r} is not 'module:Class'")
