{{/*
Names, labels, the Serve app's args and the pod template shared by the head and both worker
groups. Every value that two places need (the custom Ray resource of a pool, the model path,
the pool bounds) is derived here once, so the pods and the Serve args cannot disagree.
*/}}

{{/* The model volume's mount point on every pod; the `model` arg is under it. */}}
{{- define "splitserve.modelMount" -}}/models{{- end -}}

{{/* Units of head.rayResource the head advertises; each Ingress replica asks for one. A fixed
number: changing rayStartParams makes KubeRay replace the whole Ray cluster. */}}
{{- define "splitserve.headResourceUnits" -}}1000{{- end -}}

{{- define "splitserve.name" -}}
{{- default .Chart.Name .Values.nameOverride | trunc 63 | trimSuffix "-" -}}
{{- end -}}

{{/* The RayService's name. Short: KubeRay derives the RayCluster, pod and Service names
(<name>-<suffix>-head-..., <name>-serve-svc) from it. */}}
{{- define "splitserve.fullname" -}}
{{- if .Values.fullnameOverride -}}
{{- .Values.fullnameOverride | trunc 40 | trimSuffix "-" -}}
{{- else -}}
{{- $name := default .Chart.Name .Values.nameOverride -}}
{{- if contains $name .Release.Name -}}
{{- .Release.Name | trunc 40 | trimSuffix "-" -}}
{{- else -}}
{{- printf "%s-%s" .Release.Name $name | trunc 40 | trimSuffix "-" -}}
{{- end -}}
{{- end -}}
{{- end -}}

{{- define "splitserve.selectorLabels" -}}
app.kubernetes.io/name: {{ include "splitserve.name" . }}
app.kubernetes.io/instance: {{ .Release.Name }}
{{- end -}}

{{/* Labels that stay the same across chart upgrades: the pod templates carry only these (a
changed pod template makes KubeRay build a new Ray cluster and reload the model). */}}
{{- define "splitserve.stableLabels" -}}
{{ include "splitserve.selectorLabels" . }}
{{- with .Values.commonLabels }}
{{ toYaml . }}
{{- end }}
{{- end -}}

{{- define "splitserve.labels" -}}
{{ include "splitserve.stableLabels" . }}
helm.sh/chart: {{ printf "%s-%s" .Chart.Name .Chart.Version | replace "+" "_" | trunc 63 | trimSuffix "-" }}
app.kubernetes.io/version: {{ .Chart.AppVersion | quote }}
app.kubernetes.io/managed-by: {{ .Release.Service }}
{{- end -}}

{{/* A `ray start --resources` value in the form KubeRay and Ray's autoscaler expect: a JSON
object, quoted and escaped for the shell KubeRay hands it to, e.g. "{\"prefill_node\":1}". */}}
{{- define "splitserve.rayResourcesParam" -}}
{{- printf "\"%s\"" (toJson . | replace "\"" "\\\"") -}}
{{- end -}}

{{/* "pvc", "hostPath" or "": where the checkpoint volume comes from. */}}
{{- define "splitserve.modelVolume" -}}
{{- if dig "pvc" "claimName" "" .Values.model -}}pvc
{{- else if .Values.model.hostPath -}}hostPath
{{- end -}}
{{- end -}}

{{/* The `model` arg: /models/<subPath> with a volume, else model.path, else "" (the demo model). */}}
{{- define "splitserve.modelArg" -}}
{{- if include "splitserve.modelVolume" . -}}
{{- $sub := trimAll "/" (.Values.model.subPath | default "") -}}
{{- if $sub -}}{{ printf "%s/%s" (include "splitserve.modelMount" .) $sub }}{{- else -}}{{ include "splitserve.modelMount" . }}{{- end -}}
{{- else -}}
{{- .Values.model.path | default "" -}}
{{- end -}}
{{- end -}}

{{/* Cross-key rules values.schema.json cannot say; each fails with the keys to fix. */}}
{{- define "splitserve.validate" -}}
{{- $v := .Values -}}
{{- if and (dig "pvc" "claimName" "" $v.model) $v.model.hostPath -}}
{{- fail "model: set model.pvc.claimName or model.hostPath, not both" -}}
{{- end -}}
{{- if and (include "splitserve.modelVolume" .) $v.model.path -}}
{{- fail "model.path names a checkpoint inside the image; with a volume set model.subPath instead" -}}
{{- end -}}
{{- if contains ".." ($v.model.subPath | default "") -}}
{{- fail (printf "model.subPath %q must stay inside the volume (no ..)" $v.model.subPath) -}}
{{- end -}}
{{- range $role := list "prefill" "decode" -}}
{{- $g := index $v $role -}}
{{- if gt (int $g.minReplicas) (int $g.maxReplicas) -}}
{{- fail (printf "%s.minReplicas (%d) > %s.maxReplicas (%d)" $role (int $g.minReplicas) $role (int $g.maxReplicas)) -}}
{{- end -}}
{{- if or (lt (int $g.replicas) (int $g.minReplicas)) (gt (int $g.replicas) (int $g.maxReplicas)) -}}
{{- fail (printf "%s.replicas (%d) must be within [%s.minReplicas, %s.maxReplicas] = [%d, %d]" $role (int $g.replicas) $role $role (int $g.minReplicas) (int $g.maxReplicas)) -}}
{{- end -}}
{{- $tp := int ($g.tp | default 1) -}}
{{- $pp := int ($g.pp | default 1) -}}
{{- /* beside a prefill pool the KV moves by pipeline stage: whole layers between one-rank stages, over shm or tcp */ -}}
{{- $pd := or (gt (int $v.prefill.replicas) 0) $v.autoscale.enabled -}}
{{- $grouped := or (gt (int ($v.prefill.tp | default 1)) 1) (gt (int ($v.decode.tp | default 1)) 1) -}}
{{- if and (gt $pp 1) $pd $grouped -}}
{{- fail (printf "%s.pp > 1 beside a prefill pool needs prefill.tp and decode.tp 1: the KV handoff by pipeline stage moves whole layers between one-rank stages (PP x TP serves with prefill.replicas 0 and autoscale.enabled false)" $role) -}}
{{- end -}}
{{- if and (gt $pp 1) $pd (eq $v.serve.transport "nixl") -}}
{{- fail (printf "%s.pp > 1: the KV handoff by pipeline stage moves over shm or tcp (serve.transport auto), not nixl yet" $role) -}}
{{- end -}}
{{- /* a data-parallel decode worker (serve.engine.data_parallel_size D) is D processes, a GPU each */ -}}
{{- $dp := 1 -}}
{{- if eq $role "decode" }}{{ $dp = int (dig "data_parallel_size" 1 ($v.serve.engine | default dict)) }}{{ end -}}
{{- if and (gt $dp 1) (gt (int $g.gpus) 0) (ne (int $g.gpus) $dp) -}}
{{- fail (printf "decode.gpus (%d) must equal serve.engine.data_parallel_size (%d): one worker per pod, one GPU per data-parallel replica" (int $g.gpus) $dp) -}}
{{- end -}}
{{- if and (gt (int $g.gpus) 0) (eq $pp 1) (eq $dp 1) (ne (int $g.gpus) $tp) -}}
{{- fail (printf "%s.gpus (%d) must equal %s.tp (%d): one worker per pod, one GPU per tensor-parallel rank" $role (int $g.gpus) $role $tp) -}}
{{- end -}}
{{- if and (gt (int $g.gpus) 0) (gt $pp 1) (ne (int $g.gpus) (mul $tp $pp)) -}}
{{- fail (printf "%s.gpus (%d) must equal %s.tp x %s.pp (%d x %d): one worker per pod, one GPU per rank of each stage" $role (int $g.gpus) $role $role $tp $pp) -}}
{{- end -}}
{{- if hasKey ($g.rayStartParams | default dict) "resources" -}}
{{- fail (printf "%s.rayStartParams.resources is the chart's (from %s.rayResource)" $role $role) -}}
{{- end -}}
{{- end -}}
{{- range $k := list "num-gpus" "dashboard-host" "resources" -}}
{{- if hasKey ($v.head.rayStartParams | default dict) $k -}}
{{- fail (printf "head.rayStartParams.%s is the chart's" $k) -}}
{{- end -}}
{{- end -}}
{{- if not (and (ne $v.head.rayResource $v.prefill.rayResource) (ne $v.head.rayResource $v.decode.rayResource) (ne $v.prefill.rayResource $v.decode.rayResource)) -}}
{{- fail "head.rayResource, prefill.rayResource and decode.rayResource must differ: each pins its own pods' actors" -}}
{{- end -}}
{{- if and $v.autoscale.enabled (not $v.rayAutoscaler.enabled) -}}
{{- fail "autoscale.enabled needs rayAutoscaler.enabled: the pools grow onto pods only the Ray autoscaler makes" -}}
{{- end -}}
{{- $device := toString (dig "device" "auto" ($v.serve.engine | default dict)) -}}
{{- if and (hasPrefix "cuda" $device) (or (eq (int $v.prefill.gpus) 0) (eq (int $v.decode.gpus) 0)) -}}
{{- fail (printf "serve.engine.device %s needs prefill.gpus and decode.gpus > 0" $device) -}}
{{- end -}}
{{- if and $v.metrics.serviceMonitor.enabled $v.apiKeys.secretName (not $v.metrics.serviceMonitor.bearerTokenSecret.name) -}}
{{- fail "metrics.serviceMonitor.bearerTokenSecret.name: with API keys, /metrics answers an operator key only; name the Secret holding the one Prometheus presents" -}}
{{- end -}}
{{- if and (not (kindIs "invalid" $v.serve.speculative)) (not (kindIs "invalid" (dig "speculative" nil ($v.serve.engine | default dict)))) -}}
{{- fail "serve.speculative and serve.engine.speculative are both set: set it once, as serve.speculative" -}}
{{- end -}}
{{- if and (not (kindIs "invalid" $v.serve.speculative)) (gt (int ($v.decode.pp | default 1)) 1) -}}
{{- fail "serve.speculative with decode.pp > 1: speculative decoding does not run on pipeline-parallel decode workers yet" -}}
{{- end -}}
{{- if and (not (kindIs "invalid" $v.serve.speculative)) (eq (dig "method" "" ($v.serve.speculative | default dict)) "draft") (gt (int ($v.prefill.pp | default 1)) 1) -}}
{{- fail "serve.speculative method draft with prefill.pp > 1: the prefill workers run the draft head too, and speculative decoding does not run on pipeline-parallel workers yet" -}}
{{- end -}}
{{- with $v.serve.speculative }}{{ if gt (int (.min_n | default 2)) (int (.max_n | default 5)) -}}
{{- fail (printf "serve.speculative.min_n (%d) must not exceed max_n (%d)" (int (.min_n | default 2)) (int (.max_n | default 5))) -}}
{{- end }}{{ end -}}
{{- if hasKey ($v.serve.engine | default dict) "model" -}}
{{- fail "serve.engine.model: the model is set by model.*" -}}
{{- end -}}
{{- end -}}

{{- define "splitserve.apiKeysMount" -}}/etc/splitserve/api-keys{{- end -}}
{{- define "splitserve.kvSecretMount" -}}/etc/splitserve/kv-secret{{- end -}}

{{/* The operator's Secrets mounted read-only on the head (where the app is built and reads
them): volume name -> (Secret, mount path), for those whose secretName is set. */}}
{{- define "splitserve.headSecrets" -}}
{{- $out := dict -}}
{{- if .Values.apiKeys.secretName -}}
{{- $_ := set $out "api-keys" (dict "secretName" .Values.apiKeys.secretName "mountPath" (include "splitserve.apiKeysMount" .)) -}}
{{- end -}}
{{- if .Values.kvSecret.secretName -}}
{{- $_ := set $out "kv-secret" (dict "secretName" .Values.kvSecret.secretName "mountPath" (include "splitserve.kvSecretMount" .)) -}}
{{- end -}}
{{- toJson $out -}}
{{- end -}}

{{/* The Serve app's args (a DeployConfig, read by splitserve.deploy:build_app). One worker per
pod: each pool's resource is one unit of its group's custom resource, the starting sizes are
the groups' `replicas`, the autoscaler's bounds their minReplicas / maxReplicas. */}}
{{- define "splitserve.serveArgs" -}}
{{- $v := .Values -}}
{{- $args := dict -}}
{{- with include "splitserve.modelArg" . }}{{ $_ := set $args "model" . }}{{ end -}}
{{- with $v.model.servedName }}{{ $_ := set $args "served_model_name" . }}{{ end -}}
{{- $_ := set $args "prefill" (int $v.prefill.replicas) -}}
{{- $_ := set $args "decode" (int $v.decode.replicas) -}}
{{- $_ := set $args "prefill_resources" (dict $v.prefill.rayResource 1) -}}
{{- $_ := set $args "decode_resources" (dict $v.decode.rayResource 1) -}}
{{- $_ := set $args "prefill_tp" (int ($v.prefill.tp | default 1)) -}}
{{- $_ := set $args "decode_tp" (int ($v.decode.tp | default 1)) -}}
{{- $_ := set $args "prefill_pp" (int ($v.prefill.pp | default 1)) -}}
{{- $_ := set $args "decode_pp" (int ($v.decode.pp | default 1)) -}}
{{- $_ := set $args "policy" $v.serve.policy -}}
{{- $_ := set $args "transport" $v.serve.transport -}}
{{- $_ := set $args "ingress_replicas" (int $v.serve.ingressReplicas) -}}
{{- $_ := set $args "kv_streaming" $v.serve.kvStreaming -}}
{{- $_ := set $args "kv_streaming_min_tokens" (int $v.serve.kvStreamingMinTokens) -}}
{{- if not (kindIs "invalid" $v.serve.ttftSloMs) }}{{ $_ := set $args "ttft_slo_ms" $v.serve.ttftSloMs }}{{ end -}}
{{- if not (kindIs "invalid" $v.serve.tpotSloMs) }}{{ $_ := set $args "tpot_slo_ms" $v.serve.tpotSloMs }}{{ end -}}
{{- if not (kindIs "invalid" $v.serve.maxTokensDefault) }}{{ $_ := set $args "max_tokens_default" (int $v.serve.maxTokensDefault) }}{{ end -}}
{{- with $v.serve.otlpTracesEndpoint }}{{ $_ := set $args "otlp_traces_endpoint" . }}{{ end -}}
{{- if not (kindIs "invalid" $v.serve.traceSampleRatio) }}{{ $_ := set $args "trace_sample_ratio" (float64 $v.serve.traceSampleRatio) }}{{ end -}}
{{- $engine := dict -}}
{{- range $k, $val := ($v.serve.engine | default dict) }}{{ if not (kindIs "invalid" $val) }}{{ $_ := set $engine $k $val }}{{ end }}{{ end -}}
{{- if not (kindIs "invalid" $v.serve.speculative) }}{{ $_ := set $engine "speculative" $v.serve.speculative }}{{ end -}}
{{- $_ := set $args "engine" $engine -}}
{{- if $v.autoscale.enabled -}}
{{- $bounds := dict -}}
{{- range $role := list "prefill" "decode" -}}
{{- $g := index $v $role -}}
{{- $_ := set $bounds $role (dict "min" (int $g.minReplicas) "max" (int $g.maxReplicas)) -}}
{{- end -}}
{{- $_ := set $bounds "interval_s" $v.autoscale.intervalS -}}
{{- $_ := set $bounds "up_cooldown_s" $v.autoscale.upCooldownS -}}
{{- $_ := set $bounds "down_cooldown_s" $v.autoscale.downCooldownS -}}
{{- $_ := set $args "autoscale" $bounds -}}
{{- end -}}
{{- /* The keys set above from values (serve.extraArgs may not set them), and the engine keys
DeployConfig also reads at the top level (they belong under serve.engine). */ -}}
{{- $managed := list "model" "served_model_name" "prefill" "decode" "prefill_resources" "decode_resources" "prefill_tp" "decode_tp" "tensor_parallel_size" "policy" "transport" "kv_streaming" "kv_streaming_min_tokens" "ingress_replicas" "ttft_slo_ms" "tpot_slo_ms" "max_tokens_default" "otlp_traces_endpoint" "trace_sample_ratio" "engine" "autoscale" "name" "dtype" "kv_cache_dtype" "device" "attention_backend" "kv_cache_memory_gib" "gpu_memory_utilization" "speculative" -}}
{{- if $v.apiKeys.secretName -}}
{{- /* the key file, from the operator's Secret mounted on the head (where the app is built) */ -}}
{{- $_ := set $args "api_keys" (printf "%s/%s" (include "splitserve.apiKeysMount" .) $v.apiKeys.key) -}}
{{- $managed = append $managed "api_keys" -}}
{{- end -}}
{{- if $v.kvSecret.secretName -}}
{{- /* the KV secret, from the operator's Secret mounted on the head, read once when the app is built */ -}}
{{- $_ := set $args "kv_secret_file" (printf "%s/%s" (include "splitserve.kvSecretMount" .) $v.kvSecret.key) -}}
{{- $managed = concat $managed (list "kv_secret" "kv_secret_file") -}}
{{- end -}}
{{- range $k, $val := ($v.serve.extraArgs | default dict) -}}
{{- if has $k $managed -}}
{{- fail (printf "serve.extraArgs.%s is set by the chart (see values.yaml for the key that sets it)" $k) -}}
{{- end -}}
{{- $_ := set $args $k $val -}}
{{- end -}}
{{- toYaml $args -}}
{{- end -}}

{{/* serveConfigV2: the one splitserve application, HTTP on 8000 and gRPC on 50051. The Ingress
replicas ask for one unit of the head's resource (so they run on the head, never on a GPU pod
the autoscaler may remove, and so does, as a rule, the Controller they create); num_cpus 0 as in the code
(splitserve/cli/app.py): a config's ray_actor_options replace the code's whole. */}}
{{- define "splitserve.serveConfig" -}}
http_options:
  host: 0.0.0.0
  port: 8000
grpc_options:
  port: 50051
  grpc_servicer_functions:
    - splitserve.v1.generation_pb2_grpc.add_GenerationServicer_to_server
applications:
  - name: splitserve
    route_prefix: /
    import_path: splitserve.deploy:build_app
    args:
      {{- include "splitserve.serveArgs" . | nindent 6 }}
    deployments:
      - name: Ingress
        ray_actor_options:
          num_cpus: 0
          resources:
            {{ .Values.head.rayResource }}: 1
{{- end -}}

{{/* Container resources: the group's, with nvidia.com/gpu from `gpus` (requests default to
limits for extended resources). */}}
{{- define "splitserve.containerResources" -}}
{{- $res := deepCopy (.resources | default dict) -}}
{{- $gpus := int (.gpus | default 0) -}}
{{- if gt $gpus 0 -}}
{{- $limits := $res.limits | default dict -}}
{{- $_ := set $limits "nvidia.com/gpu" (toString $gpus) -}}
{{- $_ := set $res "limits" $limits -}}
{{- end -}}
{{- toYaml $res -}}
{{- end -}}

{{/* A Ray pod template. dict: root (the chart context), group (head / prefill / decode
values), role, container (KubeRay takes the first container as Ray's). */}}
{{- define "splitserve.podTemplate" -}}
{{- $root := .root -}}
{{- $g := .group -}}
{{- $image := merge (deepCopy ($g.image | default dict)) $root.Values.image -}}
{{- $volume := include "splitserve.modelVolume" $root -}}
metadata:
  labels:
    {{- include "splitserve.stableLabels" $root | nindent 4 }}
    app.kubernetes.io/component: {{ .role }}
spec:
  # Nothing in a pod calls the Kubernetes API but the Ray autoscaler (a sidecar on the head)
  automountServiceAccountToken: {{ and (eq .role "head") $root.Values.rayAutoscaler.enabled }}
  {{- with $root.Values.podSecurityContext }}
  securityContext:
    {{- toYaml . | nindent 4 }}
  {{- end }}
  {{- with $root.Values.imagePullSecrets }}
  imagePullSecrets:
    {{- toYaml . | nindent 4 }}
  {{- end }}
  {{- with $g.nodeSelector }}
  nodeSelector:
    {{- toYaml . | nindent 4 }}
  {{- end }}
  {{- with $g.tolerations }}
  tolerations:
    {{- toYaml . | nindent 4 }}
  {{- end }}
  containers:
    - name: {{ .container }}
      image: {{ printf "%s:%s" $image.repository $image.tag | quote }}
      imagePullPolicy: {{ $image.pullPolicy | default "IfNotPresent" }}
      {{- if eq .role "head" }}
      # KubeRay finds the serve port by its name; the head Service it makes exposes them all.
      ports:
        - {name: gcs-server, containerPort: 6379}
        - {name: dashboard, containerPort: 8265}
        - {name: client, containerPort: 10001}
        - {name: serve, containerPort: 8000}
        - {name: grpc, containerPort: 50051}
        - {name: metrics, containerPort: 8080}
      {{- end }}
      env:
        # Serve's gRPC proxy (on every node) takes messages no larger than an HTTP body (8 MiB)
        - {name: RAY_SERVE_GRPC_MAX_MESSAGE_SIZE, value: "8388608"}
        {{- with $g.env }}
        {{- toYaml . | nindent 8 }}
        {{- end }}
      resources:
        {{- include "splitserve.containerResources" $g | nindent 8 }}
      # Pod Security Standards "restricted": the root filesystem read-only, what Ray and the
      # engine write on emptyDirs (Ray's session dir under /tmp, caches under $HOME, /dev/shm
      # for the shm KV transport and Ray's object store)
      securityContext:
        {{- toYaml $root.Values.containerSecurityContext | nindent 8 }}
      volumeMounts:
        - {name: tmp, mountPath: /tmp}
        - {name: home, mountPath: /home/ray}
        - {name: dshm, mountPath: /dev/shm}
        {{- if eq .role "head" }}
        {{- range $name, $s := include "splitserve.headSecrets" $root | fromJson }}
        - {name: {{ $name }}, mountPath: {{ $s.mountPath }}, readOnly: true}
        {{- end }}
        {{- end }}
        {{- if $volume }}
        - name: model
          mountPath: {{ include "splitserve.modelMount" $root }}
          readOnly: true
        {{- end }}
  volumes:
    - {name: tmp, emptyDir: {}}
    - {name: home, emptyDir: {}}
    - name: dshm
      emptyDir:
        medium: Memory
        sizeLimit: {{ $g.shmSize | default $root.Values.shmSize | quote }}
    {{- if eq .role "head" }}
    {{- range $name, $s := include "splitserve.headSecrets" $root | fromJson }}
    - name: {{ $name }}
      secret:
        secretName: {{ $s.secretName | quote }}
    {{- end }}
    {{- end }}
    {{- if $volume }}
    - name: model
      {{- if eq $volume "pvc" }}
      persistentVolumeClaim:
        claimName: {{ $root.Values.model.pvc.claimName }}
        readOnly: true
      {{- else }}
      hostPath:
        path: {{ $root.Values.model.hostPath }}
        type: Directory
      {{- end }}
    {{- end }}
{{- end -}}
