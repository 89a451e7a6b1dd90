{{/*
Checks a cluster would otherwise catch late (or never). Each `fail` says what to change.
Included once, from templates/validate.yaml.
*/}}
{{- define "tandem.validate" -}}
{{- $v := .Values }}

{{/* Redis: exactly one source. */}}
{{- $sentinel := $v.externalRedis.sentinel }}
{{- if and $v.redis.enabled $v.externalRedis.url }}
{{- fail "tandem: both redis.enabled=true and externalRedis.url are set; use one Redis (set redis.enabled=false to use the external one)" }}
{{- end }}
{{- if and $v.redis.enabled $sentinel.hosts }}
{{- fail "tandem: both redis.enabled=true and externalRedis.sentinel.hosts are set; use one Redis (set redis.enabled=false to use the one behind the sentinels)" }}
{{- end }}
{{- if and $v.externalRedis.url $sentinel.hosts }}
{{- fail "tandem: externalRedis.url and externalRedis.sentinel.hosts are both set; with Sentinel the services ask the sentinels where the primary is, so leave externalRedis.url empty" }}
{{- end }}
{{- if and (not $v.redis.enabled) (not $v.externalRedis.url) (not $sentinel.hosts) }}
{{- fail "tandem: no Redis configured; set redis.enabled=true for the bundled StatefulSet, externalRedis.url (e.g. rediss://10.0.0.3:6378/0 for Memorystore) or externalRedis.sentinel.hosts (Redis Sentinel)" }}
{{- end }}
{{- if and $sentinel.hosts $v.externalRedis.tls.caSecret }}
{{- fail "tandem: externalRedis.tls.caSecret is set with externalRedis.sentinel; TLS through Sentinel is not supported yet, use externalRedis.url for a TLS endpoint" }}
{{- end }}
{{- if $v.redis.cluster }}
{{- if $v.redis.enabled }}
{{- fail "tandem: redis.cluster=true says the Redis is a Redis Cluster, but redis.enabled=true runs the bundled single Redis; set redis.enabled=false and externalRedis.url to one node of the cluster (Memorystore for Redis Cluster: its discovery endpoint)" }}
{{- end }}
{{- if $sentinel.hosts }}
{{- fail "tandem: redis.cluster=true and externalRedis.sentinel.hosts are both set; a Redis Cluster fails over by itself, without sentinels: leave externalRedis.sentinel.hosts empty and set externalRedis.url to one node of the cluster" }}
{{- end }}
{{- $db := trimPrefix "/" (urlParse $v.externalRedis.url).path }}
{{- if not (has $db (list "" "0")) }}
{{- fail (printf "tandem: externalRedis.url %q selects database %s, but a Redis Cluster has database 0 only; drop /%s from the URL" $v.externalRedis.url $db $db) }}
{{- end }}
{{- end }}
{{- if and (not $v.redis.enabled) (not $sentinel.hosts) }}
{{- $u := urlParse $v.externalRedis.url }}
{{- if not (has $u.scheme (list "redis" "rediss")) }}
{{- fail (printf "tandem: externalRedis.url %q must start with redis:// or rediss:// (TLS)" $v.externalRedis.url) }}
{{- end }}
{{- if $u.userinfo }}
{{- fail "tandem: externalRedis.url must not carry credentials (they would land in a ConfigMap); put the password in a Secret and set externalRedis.existingSecret" }}
{{- end }}
{{- if and $v.externalRedis.tls.caSecret (ne $u.scheme "rediss") }}
{{- fail "tandem: externalRedis.tls.caSecret is set but externalRedis.url is not rediss://; use rediss:// for TLS" }}
{{- end }}
{{- end }}

{{/* Secrets: each one comes from a Secret you manage, a value, or secretSeed; with none of them,
`helm install` generates it once and `helm upgrade` keeps it (lookup: tandem.keptSecret). An offline
render (`helm template`, Argo CD, post-renderers, CI) cannot keep a random value, so it fails instead. */}}
{{- $seed := toString (default "" $v.secretSeed) }}
{{- if and $seed (lt (len $seed) 32) }}
{{- fail (printf "tandem: secretSeed is %d characters; the chart derives the API key and the Redis password from it, so give at least 32 random ones (--set secretSeed=$(openssl rand -hex 32)), or leave it empty and use existingSecrets" (len $seed)) }}
{{- end }}
{{- if and (not $seed) (not (include "tandem.clusterSeen" .)) }}
{{- $auth := $v.gateway.auth }}
{{- if and $auth.enabled (not $auth.existingSecret) (not $auth.apiKeys) }}
{{- fail "tandem: the gateway needs API keys and none are given. For GitOps, point gateway.auth.existingSecret at a Secret you manage (key api-keys: a JSON list, [\"key1\"]); or set gateway.auth.apiKeys; or set secretSeed (--set secretSeed=$(openssl rand -hex 32)) and the chart derives a key from it, the same on every render (helm template, Argo CD, Flux); or install with helm install, which generates a key once and keeps it across upgrades. gateway.auth.enabled=false turns auth off." }}
{{- end }}
{{- if and $v.redis.enabled (not $v.redis.auth.existingSecret) (not $v.redis.auth.password) }}
{{- fail "tandem: the bundled Redis needs a password and none is given. For GitOps, point redis.auth.existingSecret at a Secret you manage (key redis-password, or redis.auth.existingSecretPasswordKey); or set redis.auth.password; or set secretSeed (--set secretSeed=$(openssl rand -hex 32)) and the chart derives one from it, the same on every render; or install with helm install, which generates one once and keeps it across upgrades." }}
{{- end }}
{{- end }}

{{/* The JAX compilation cache: one source. */}}
{{- range $component := list "prefill" "decode" }}
{{- $cache := (index $v $component).compilationCache }}
{{- if and $cache.enabled $cache.volume $cache.persistentVolumeClaim.create }}
{{- fail (printf "tandem: %s.compilationCache.volume and %s.compilationCache.persistentVolumeClaim.create are both set; the cache is one volume: give your own volume source, or let the chart create the claim" $component $component) }}
{{- end }}
{{- end }}

{{/* TPU scheduling: a GKE TPU type, and the google.com/tpu count must be the chips of the topology. */}}
{{- $hostChips := include "tandem.tpu.hostChips" . | fromJson }}
{{- range $component := list "prefill" "decode" }}
{{- $tpu := (index $v $component).tpu }}
{{- if $tpu.enabled }}
{{- if not (hasKey $hostChips (toString $tpu.accelerator)) }}
{{- fail (printf "tandem: %s.tpu.accelerator %q is not a GKE TPU type; use one of %s (the node label cloud.google.com/gke-tpu-accelerator; the table in docs/deploy-gke.md says which chips and topologies each has)" $component (toString $tpu.accelerator) (keys $hostChips | sortAlpha | join ", ")) }}
{{- end }}
{{- if not (regexMatch "^[1-9][0-9]*x[1-9][0-9]*(x[1-9][0-9]*)?$" (toString $tpu.topology)) }}
{{- fail (printf "tandem: %s.tpu.topology %q is not a TPU topology like 2x4 or 2x2x1" $component (toString $tpu.topology)) }}
{{- end }}
{{- $want := include "tandem.tpu.topologyChips" (toString $tpu.topology) | atoi }}
{{- if ne (int $tpu.chips) $want }}
{{- fail (printf "tandem: %s.tpu.chips=%d does not match %s.tpu.topology=%s, which has %d chips; set %s.tpu.chips=%d (google.com/tpu requests/limits must equal the topology's chips)" $component (int $tpu.chips) $component $tpu.topology $want $component $want) }}
{{- end }}
{{- $max := include "tandem.tpu.maxChipsPerHost" $tpu.accelerator | atoi }}
{{- if and (gt $max 0) (gt $want $max) }}
{{- fail (printf "tandem: %s.tpu.topology=%s (%d chips) is a multi-host slice for %s (at most %d chips per host); this chart runs single-host slices only, pick a topology with <= %d chips" $component $tpu.topology $want $tpu.accelerator $max $max) }}
{{- end }}
{{- end }}
{{- end }}

{{/* Shapes and names the three services must agree on. */}}
{{- $g := $v.gateway.settings }}
{{- $p := $v.prefill.settings }}
{{- $d := $v.decode.settings }}
{{- if not (and (eq (toString $g.pool) (toString $p.pool)) (eq (toString $p.pool) (toString $d.pool))) }}
{{- fail (printf "tandem: gateway/prefill/decode settings.pool must be equal (got %q, %q, %q)" (toString $g.pool) (toString $p.pool) (toString $d.pool)) }}
{{- end }}
{{- if not (and (eq (toString $p.engine.model) (toString $d.engine.model)) (eq (toString $g.model) (toString $p.engine.model))) }}
{{- fail (printf "tandem: gateway.settings.model, prefill.settings.engine.model and decode.settings.engine.model must name the same model (got %q, %q, %q)" (toString $g.model) (toString $p.engine.model) (toString $d.engine.model)) }}
{{- end }}
{{- if ne (toString $p.engine.dtype) (toString $d.engine.dtype) }}
{{- fail (printf "tandem: prefill and decode engine.dtype must match, KV is transferred as-is (got %q and %q)" (toString $p.engine.dtype) (toString $d.engine.dtype)) }}
{{- end }}
{{- if ne (toString $p.engine.quantize) (toString $d.engine.quantize) }}
{{- fail (printf "tandem: prefill and decode engine.quantize must match: a prompt's KV and first token come from the prefill pod's weights and its other tokens from the decode pod's, so both must serve the same weights (got %q and %q)" (toString $p.engine.quantize) (toString $d.engine.quantize)) }}
{{- end }}
{{- if not (and (eq (int $g.max_context_len) (int $p.engine.max_len)) (eq (int $p.engine.max_len) (int $d.engine.max_len))) }}
{{- fail (printf "tandem: gateway.settings.max_context_len (%d) must equal prefill and decode settings.engine.max_len (%d, %d)" (int $g.max_context_len) (int $p.engine.max_len) (int $d.engine.max_len)) }}
{{- end }}
{{- $maxBucket := 0 }}
{{- range $p.engine.prefill_buckets }}{{ if gt (int .) $maxBucket }}{{ $maxBucket = int . }}{{ end }}{{ end }}
{{- if ne (int $g.max_prompt_len) $maxBucket }}
{{- fail (printf "tandem: gateway.settings.max_prompt_len (%d) must equal the largest prefill bucket (prefill.settings.engine.prefill_buckets max = %d)" (int $g.max_prompt_len) $maxBucket) }}
{{- end }}
{{- if gt $maxBucket (int $p.engine.max_len) }}
{{- fail (printf "tandem: the largest prefill bucket (%d) exceeds prefill.settings.engine.max_len (%d)" $maxBucket (int $p.engine.max_len)) }}
{{- end }}
{{- if eq (int $g.port) (int $g.grpc_port) }}
{{- fail "tandem: gateway.settings.port and gateway.settings.grpc_port must differ" }}
{{- end }}
{{- if and (gt (int $g.metrics_port) 0) (has (int $g.metrics_port) (list (int $g.port) (int $g.grpc_port))) }}
{{- fail "tandem: gateway.settings.metrics_port must differ from its port and grpc_port (or be 0: /metrics on the HTTP port)" }}
{{- end }}

{{/* Scaling and lifecycle per pool. */}}
{{- range $component := list "prefill" "decode" }}
{{- $c := index $v $component }}
{{- if and $c.autoscaling.enabled $c.keda.enabled }}
{{- fail (printf "tandem: %s.autoscaling.enabled and %s.keda.enabled are both true; KEDA creates its own HorizontalPodAutoscaler, enable one of them" $component $component) }}
{{- end }}
{{- $live := mul (int $c.probes.liveness.periodSeconds) (int $c.probes.liveness.failureThreshold) }}
{{- if le (float64 $live) (float64 $c.settings.drain_timeout_s) }}
{{- fail (printf "tandem: %s liveness window (periodSeconds*failureThreshold = %ds) must exceed settings.drain_timeout_s (%v) or a draining pod is killed early" $component $live $c.settings.drain_timeout_s) }}
{{- end }}
{{- if eq (int $c.settings.grpc.port) 0 }}
{{- fail (printf "tandem: %s.settings.grpc.port must be a fixed port (0 = random is not probe-able)" $component) }}
{{- end }}
{{- end }}
{{- if and $v.gateway.autoscaling.enabled (lt (int $v.gateway.autoscaling.maxReplicas) (int $v.gateway.autoscaling.minReplicas)) }}
{{- fail "tandem: gateway.autoscaling.maxReplicas must be >= minReplicas" }}
{{- end }}
{{- if $v.grpcTLS.enabled }}
{{- range $component := list "prefill" "decode" }}
{{- $g := (index $v $component).settings.grpc }}
{{- if eq (int $g.health_port) 0 }}
{{- fail (printf "tandem: grpcTLS.enabled needs %s.settings.grpc.health_port (a plaintext port for the grpc: probes, which speak no TLS)" $component) }}
{{- end }}
{{- if eq (int $g.health_port) (int $g.port) }}
{{- fail (printf "tandem: %s.settings.grpc.health_port must differ from its grpc.port" $component) }}
{{- end }}
{{- end }}
{{- end }}
{{- include "tandem.validate.planner" . }}
{{- end }}

{{/* The planner: one owner of the worker replicas, bounds it can keep, a profile it can read. */}}
{{- define "tandem.validate.planner" -}}
{{- $v := .Values }}
{{- $pl := $v.planner }}
{{- if and $pl.keda (not $pl.enabled) }}
{{- fail "tandem: planner.keda=true makes KEDA follow the planner, but planner.enabled=false; enable the planner or set planner.keda=false" }}
{{- end }}
{{- if $pl.enabled }}
{{- $mode := toString $pl.settings.mode }}
{{- if eq $mode "local" }}
{{- fail "tandem: planner.settings.mode=local is for `tandem local --planner`; in a cluster use off (publish, optionally with planner.keda=true) or kubernetes (scale the Deployments)" }}
{{- end }}
{{- if and (gt (int $pl.replicas) 1) (ne $mode "kubernetes") }}
{{- fail (printf "tandem: planner.replicas=%d with planner.settings.mode=%s: each replica would decide on its own; use 1 replica, or mode=kubernetes where a Lease makes one of them active" (int $pl.replicas) $mode) }}
{{- end }}
{{- if ne (toString $pl.settings.pool) (toString $v.prefill.settings.pool) }}
{{- fail (printf "tandem: planner.settings.pool (%q) must equal prefill/decode settings.pool (%q): it sizes that pool" (toString $pl.settings.pool) (toString $v.prefill.settings.pool)) }}
{{- end }}
{{- range $component := list "prefill" "decode" }}
{{- $c := index $v $component }}
{{- $b := index $pl.settings $component }}
{{- if eq $mode "kubernetes" }}
{{- if $c.autoscaling.enabled }}
{{- fail (printf "tandem: planner.settings.mode=kubernetes scales %s itself, and %s.autoscaling.enabled=true gives the same Deployment an HPA; they would fight over its replicas. Turn one off (planner.keda=true with mode=off lets KEDA follow the planner)" $component $component) }}
{{- end }}
{{- if or $c.keda.enabled $pl.keda }}
{{- fail (printf "tandem: planner.settings.mode=kubernetes scales %s itself, and KEDA (%s) would scale the same Deployment; they would fight over its replicas. Either the planner scales (set %s.keda.enabled=false and planner.keda=false) or KEDA follows the planner (planner.keda=true with planner.settings.mode=off)" $component (ternary "planner.keda" (printf "%s.keda.enabled" $component) (eq (toString $pl.keda) "true")) $component) }}
{{- end }}
{{- end }}
{{- if and $pl.keda $c.autoscaling.enabled }}
{{- fail (printf "tandem: planner.keda=true and %s.autoscaling.enabled=true; KEDA creates its own HorizontalPodAutoscaler for %s, turn %s.autoscaling off" $component $component $component) }}
{{- end }}
{{- if and (eq (int $b.min_replicas) 0) (not $b.allow_zero) }}
{{- fail (printf "tandem: planner.settings.%s.min_replicas=0 lets the planner scale %s to zero when idle; set planner.settings.%s.allow_zero=true to mean it" $component $component $component) }}
{{- end }}
{{- if gt (int $b.min_replicas) (int $b.max_replicas) }}
{{- fail (printf "tandem: planner.settings.%s.min_replicas (%d) > max_replicas (%d)" $component (int $b.min_replicas) (int $b.max_replicas)) }}
{{- end }}
{{- end }}
{{- $source := include "tandem.planner.profileSource" . }}
{{- if eq $source "inline" }}
{{- $doc := fromJson (include "tandem.planner.profileJson" .) }}
{{- if hasKey $doc "Error" }}
{{- fail (printf "tandem: planner.profile is not valid JSON (%s); give the capacity profile's JSON (--set-file planner.profile=profile.json) or the name of a ConfigMap holding it" (get $doc "Error")) }}
{{- end }}
{{- if ne (toString (get $doc "format")) "tandem-capacity-profile/v1" }}
{{- fail (printf "tandem: planner.profile has format %q, want \"tandem-capacity-profile/v1\" (make one with python bench/capacity.py)" (toString (get $doc "format"))) }}
{{- end }}
{{- $dec := get $doc "decode" }}
{{- $slots := ternary (get (default dict $dec) "slots") 0 (kindIs "map" $dec) }}
{{- if and $slots (ne (int $slots) (int $v.decode.settings.slots)) }}
{{- fail (printf "tandem: planner.profile was measured with %d decode slots but decode.settings.slots=%d; profile the pods as they run (bench/capacity.py) or match the slots" (int $slots) (int $v.decode.settings.slots)) }}
{{- end }}
{{- else if eq $source "configmap" }}
{{- if not (regexMatch "^[a-z0-9]([-a-z0-9.]*[a-z0-9])?$" (trim (toString $pl.profile))) }}
{{- fail (printf "tandem: planner.profile %q is neither JSON (it must start with '{') nor a ConfigMap name" (trunc 40 (trim (toString $pl.profile)))) }}
{{- end }}
{{- end }}
{{- end }}
{{- end }}
