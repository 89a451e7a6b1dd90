{{/* Names, labels, images and the settings -> environment mapping. */}}

{{- define "tandem.name" -}}
{{- default .Chart.Name .Values.nameOverride | trunc 63 | trimSuffix "-" }}
{{- end }}

{{- define "tandem.fullname" -}}
{{- if .Values.fullnameOverride }}
{{- .Values.fullnameOverride | trunc 63 | trimSuffix "-" }}
{{- else }}
{{- $name := default .Chart.Name .Values.nameOverride }}
{{- if contains $name .Release.Name }}
{{- .Release.Name | trunc 63 | trimSuffix "-" }}
{{- else }}
{{- printf "%s-%s" .Release.Name $name | trunc 63 | trimSuffix "-" }}
{{- end }}
{{- end }}
{{- end }}

{{/* "<fullname>-<component>"; component names are short so 63 is never exceeded by much. */}}
{{- define "tandem.componentName" -}}
{{- printf "%s-%s" (include "tandem.fullname" .root | trunc 52 | trimSuffix "-") .component }}
{{- end }}

{{- define "tandem.chart" -}}
{{- printf "%s-%s" .Chart.Name .Chart.Version | replace "+" "_" | trunc 63 | trimSuffix "-" }}
{{- end }}

{{/* Selector labels: stable across upgrades (never add version labels here). */}}
{{- define "tandem.selectorLabels" -}}
app.kubernetes.io/name: {{ include "tandem.name" .root }}
app.kubernetes.io/instance: {{ .root.Release.Name }}
app.kubernetes.io/component: {{ .component }}
{{- end }}

{{- define "tandem.labels" -}}
helm.sh/chart: {{ include "tandem.chart" .root }}
{{ include "tandem.selectorLabels" . }}
app.kubernetes.io/part-of: tandem
app.kubernetes.io/version: {{ .root.Chart.AppVersion | quote }}
app.kubernetes.io/managed-by: {{ .root.Release.Service }}
{{- with .root.Values.commonLabels }}
{{ toYaml . }}
{{- end }}
{{- end }}

{{/* Label that lets a client pod in this namespace through the gateway NetworkPolicy. */}}
{{- define "tandem.clientLabel" -}}
{{- printf "%s-client" (include "tandem.fullname" .) | trunc 63 | trimSuffix "-" }}
{{- end }}

{{- define "tandem.serviceAccountName" -}}
{{- if .Values.serviceAccount.create }}
{{- default (include "tandem.fullname" .) .Values.serviceAccount.name }}
{{- else }}
{{- default "default" .Values.serviceAccount.name }}
{{- end }}
{{- end }}

{{/* image reference from {repository, tag, digest}; args: dict "root" $ "image" $img */}}
{{- define "tandem.image" -}}
{{- $img := .image }}
{{- if $img.digest }}
{{- printf "%s@%s" $img.repository $img.digest }}
{{- else }}
{{- printf "%s:%s" $img.repository (default .root.Chart.AppVersion $img.tag | toString) }}
{{- end }}
{{- end }}

{{/*
A settings value as the string pydantic-settings parses. Helm keeps every number as float64, and
Go prints large whole floats in exponent form (268435456 -> 2.68435456e+08), so whole numbers are
printed as integers. Lists and maps become JSON.
*/}}
{{- define "tandem.envValue" -}}
{{- $v := . }}
{{- if or (kindIs "slice" $v) (kindIs "map" $v) }}
{{- toJson $v }}
{{- else if kindIs "float64" $v }}
{{- if eq $v (floor $v) }}{{ int64 $v }}{{ else }}{{ $v }}{{ end }}
{{- else }}
{{- $v }}
{{- end }}
{{- end }}

{{/*
Flatten a settings map into env: nested maps are joined with "__" (pydantic-settings'
env_nested_delimiter), names upper-cased. args: dict "prefix" "TANDEM_PREFILL_" "settings" map
Output: YAML map NAME: "value" (a ConfigMap's data).
*/}}
{{- define "tandem.settingsEnv" -}}
{{- $prefix := .prefix }}
{{- range $k, $v := .settings }}
{{- $name := printf "%s%s" $prefix (upper $k) }}
{{- if kindIs "map" $v }}
{{- include "tandem.settingsEnv" (dict "prefix" (printf "%s__" $name) "settings" $v) }}
{{- else if not (kindIs "invalid" $v) }}
{{ $name }}: {{ include "tandem.envValue" $v | quote }}
{{- end }}
{{- end }}
{{- end }}

{{/* ---- Redis wiring ---- */}}

{{- define "tandem.redis.fullname" -}}
{{- include "tandem.componentName" (dict "root" . "component" "redis") }}
{{- end }}

{{/* Mount path of the external Redis CA. */}}
{{- define "tandem.redis.caDir" -}}/etc/tandem/redis-ca{{- end }}

{{/* Whether the services find Redis through Sentinel (externalRedis.sentinel.hosts). */}}
{{- define "tandem.redis.sentinel" -}}
{{- if and (not .Values.redis.enabled) .Values.externalRedis.sentinel.hosts }}true{{ end }}
{{- end }}

{{/*
A component's settings (as JSON) with settings.redis.sentinel taken from externalRedis.sentinel,
so the sentinels are written once for all three services. args: dict "root" $ "settings" map
*/}}
{{- define "tandem.redis.withSentinel" -}}
{{- $s := deepCopy .settings }}
{{- $x := .root.Values.externalRedis.sentinel }}
{{- $_ := set $s.redis "sentinel" (dict "hosts" $x.hosts "master_name" $x.masterName "auth" $x.auth) }}
{{- toJson $s }}
{{- end }}

{{/* The URL every service gets as <PREFIX>REDIS__URL ("" with Sentinel: the sentinels say where). */}}
{{- define "tandem.redis.url" -}}
{{- if include "tandem.redis.sentinel" . }}
{{- else if .Values.redis.enabled }}
{{- printf "redis://%s.%s.svc:%d/0" (include "tandem.redis.fullname" .) .Release.Namespace (int .Values.redis.port) }}
{{- else }}
{{- $url := .Values.externalRedis.url }}
{{- if .Values.externalRedis.tls.caSecret }}
{{- $sep := ternary "&" "?" (contains "?" $url) }}
{{- printf "%s%sssl_ca_certs=%s/%s" $url $sep (include "tandem.redis.caDir" .) .Values.externalRedis.tls.caKey }}
{{- else }}
{{- $url }}
{{- end }}
{{- end }}
{{- end }}

{{/*
redis.cluster and redis.shards of every service, from the one value of each (redis.cluster,
redis.shards): services that disagreed would not find each other's keys. args: dict "root" $ "prefix" "TANDEM_PREFILL_"
*/}}
{{- define "tandem.redis.keysEnv" -}}
{{ .prefix }}REDIS__CLUSTER: {{ ternary "true" "false" (eq (toString .root.Values.redis.cluster) "true") | quote }}
{{ .prefix }}REDIS__SHARDS: {{ int .root.Values.redis.shards | quote }}
{{- end }}

{{/* Secret name and key of the Redis password, or "" when there is none. */}}
{{- define "tandem.redis.passwordSecret" -}}
{{- if .Values.redis.enabled }}
{{- default (include "tandem.redis.fullname" .) .Values.redis.auth.existingSecret }}
{{- else }}
{{- .Values.externalRedis.existingSecret }}
{{- end }}
{{- end }}

{{- define "tandem.redis.passwordKey" -}}
{{- if .Values.redis.enabled }}
{{- .Values.redis.auth.existingSecretPasswordKey }}
{{- else }}
{{- .Values.externalRedis.existingSecretPasswordKey }}
{{- end }}
{{- end }}

{{/* host:port of Redis for KEDA (with Sentinel: the sentinels, comma-separated). */}}
{{- define "tandem.redis.address" -}}
{{- if include "tandem.redis.sentinel" . }}
{{- join "," .Values.externalRedis.sentinel.hosts }}
{{- else if .Values.redis.enabled }}
{{- printf "%s.%s.svc:%d" (include "tandem.redis.fullname" .) .Release.Namespace (int .Values.redis.port) }}
{{- else }}
{{- $u := urlParse .Values.externalRedis.url }}
{{- if contains ":" $u.host }}{{ $u.host }}{{ else }}{{ printf "%s:6379" $u.host }}{{ end }}
{{- end }}
{{- end }}

{{- define "tandem.redis.db" -}}
{{- if or .Values.redis.enabled (include "tandem.redis.sentinel" .) }}0{{ else }}{{ default "0" (trimPrefix "/" (urlParse .Values.externalRedis.url).path) }}{{ end }}
{{- end }}

{{- define "tandem.redis.tls" -}}
{{- if and (not .Values.redis.enabled) (hasPrefix "rediss://" .Values.externalRedis.url) }}true{{ end }}
{{- end }}

{{/* ---- TPU ---- */}}

{{/* Chips in a topology "AxB" or "AxBxC". */}}
{{- define "tandem.tpu.topologyChips" -}}
{{- $n := 1 }}
{{- range (splitList "x" .) }}{{ $n = mul $n (atoi .) }}{{ end }}
{{- $n }}
{{- end }}

{{/*
GKE's TPU types (the node label cloud.google.com/gke-tpu-accelerator) and the most chips one host
(TPU VM) of each has: a Deployment's pod runs on one host, so its slice can be no larger.
Kept in step with values.schema.json's enum and docs/deploy-gke.md's table.
*/}}
{{- define "tandem.tpu.hostChips" -}}
{{- toJson (dict "tpu-v4-podslice" 4 "tpu-v5-lite-device" 8 "tpu-v5-lite-podslice" 8 "tpu-v5p-slice" 4 "tpu-v6e-slice" 8 "tpu7x" 4) }}
{{- end }}

{{- define "tandem.tpu.maxChipsPerHost" -}}
{{- get (include "tandem.tpu.hostChips" . | fromJson) . | default 0 }}
{{- end }}

{{/* ---- Secrets ---- */}}

{{/*
A secret derived from `secretSeed`: the same seed, release and purpose give the same value on every
render (helm template, Argo CD, Flux, helm upgrade), so nothing rotates between syncs; without the
seed nobody can compute it. 64 hex characters. args: dict "root" $ "purpose" "redis-password"
*/}}
{{- define "tandem.derivedSecret" -}}
{{- $r := .root }}
{{- printf "tandem/v1/%s/%s/%s/%s" $r.Values.secretSeed $r.Release.Namespace $r.Release.Name .purpose | sha256sum }}
{{- end }}

{{/*
"true" when this render sees the cluster: `helm install`/`helm upgrade` (and Flux's helm-controller,
which runs them), where `lookup` lists the release namespace's Secrets (Helm's own release storage
needs that right anyway). `helm template`, Argo CD and post-renderers see nothing: "".
*/}}
{{- define "tandem.clusterSeen" -}}
{{- if (lookup "v1" "Secret" .Release.Namespace "") }}true{{ end }}
{{- end }}

{{/*
A secret made once and kept: the base64 value under `key` of this chart's Secret `name` when the
cluster has it (every upgrade after the install), else `new` (base64 of a fresh random value).
Used only when nothing else gives the secret and the cluster is seen (tandem.clusterSeen).
args: dict "root" $ "name" "..." "key" "..." "new" "<base64>"
*/}}
{{- define "tandem.keptSecret" -}}
{{- /* One value per render: the Secret and every checksum/secrets that includes it see the same
(a template included twice would otherwise draw two random values). */}}
{{- if not (hasKey .root.Values "tandemKeptSecrets") }}{{ $_ := set .root.Values "tandemKeptSecrets" dict }}{{ end }}
{{- $memo := .root.Values.tandemKeptSecrets }}
{{- $id := printf "%s/%s" .name .key }}
{{- if not (hasKey $memo $id) }}
{{- $old := lookup "v1" "Secret" .root.Release.Namespace .name }}
{{- $was := "" }}
{{- if and $old $old.data }}{{ $was = index $old.data .key | default "" }}{{ end }}
{{- $_ := set $memo $id ($was | default .new) }}
{{- end }}
{{- index $memo $id }}
{{- end }}

{{/* Secrets the Tandem pods that reach Redis mount: the external Redis CA. */}}
{{- define "tandem.commonVolumes" -}}
{{- if and (not .Values.redis.enabled) .Values.externalRedis.tls.caSecret }}
- name: redis-ca
  secret:
    secretName: {{ .Values.externalRedis.tls.caSecret }}
    defaultMode: 0444
{{- end }}
{{- end }}

{{- define "tandem.commonVolumeMounts" -}}
{{- if and (not .Values.redis.enabled) .Values.externalRedis.tls.caSecret }}
- name: redis-ca
  mountPath: {{ include "tandem.redis.caDir" . }}
  readOnly: true
{{- end }}
{{- end }}

{{/* ---- Scaling ---- */}}

{{/*
Who sets a worker Deployment's replicas: "hpa" (autoscaling), "keda" (stream lag), "planner-keda"
(KEDA on the planner's /keda), "planner" (the planner through the scale subresource) or "" (the
chart's `replicas`). Conflicting combinations are refused in _validate.tpl.
args: dict "root" $ "component" "prefill"|"decode"
*/}}
{{- define "tandem.scaler" -}}
{{- $v := .root.Values }}
{{- $c := index $v .component }}
{{- if $c.autoscaling.enabled }}hpa
{{- else if and $v.planner.enabled $v.planner.keda }}planner-keda
{{- else if $c.keda.enabled }}keda
{{- else if and $v.planner.enabled (eq (toString $v.planner.settings.mode) "kubernetes") }}planner
{{- end }}
{{- end }}

{{/*
checksum/secrets: a hash of the Secrets this chart renders (empty for existingSecret ones, which
it cannot see), so pods that read them restart when a key or password changes. args: dict
"root" $ "files" (list "redis" "gateway")
*/}}
{{- define "tandem.secretsChecksum" -}}
{{- $root := .root }}
{{- $out := list }}
{{- range .files }}{{ $out = append $out (include (printf "%s/%s/secret.yaml" $root.Template.BasePath .) $root) }}{{ end }}
{{- join "\n" $out | sha256sum }}
{{- end }}

{{/* "true" when one of the given pod volume sources is a Cloud Storage FUSE CSI volume (GKE then
needs the pod annotation gke-gcsfuse/volumes: "true" to inject its sidecar). args: list of maps */}}
{{- define "tandem.usesGcsFuse" -}}
{{- range . }}{{ if and (kindIs "map" .) .csi }}{{ if eq (toString .csi.driver) "gcsfuse.csi.storage.gke.io" }}true{{ end }}{{ end }}{{ end }}
{{- end }}

{{/* The worker's JAX compilation cache volume source (compilationCache: volume, a PVC, or an emptyDir).
args: dict "root" $ "component" "prefill"|"decode" */}}
{{- define "tandem.worker.cacheVolume" -}}
{{- $cache := (index .root.Values .component).compilationCache }}
{{- if $cache.volume }}
{{- toYaml $cache.volume }}
{{- else if $cache.persistentVolumeClaim.create }}
persistentVolumeClaim:
  claimName: {{ include "tandem.componentName" (dict "root" .root "component" (printf "%s-jax-cache" .component)) }}
{{- else }}
emptyDir:
  sizeLimit: {{ $cache.sizeLimit }}
{{- end }}
{{- end }}

{{/* ---- Internal gRPC mTLS (grpcTLS) ---- */}}

{{/* The Secret with tls.crt, tls.key, ca.crt: grpcTLS.secretName, or the one the chart (or
cert-manager, for the chart) makes. */}}
{{- define "tandem.grpcTLS.secret" -}}
{{- .Values.grpcTLS.secretName | default (printf "%s-grpc-tls" (include "tandem.fullname" .)) }}
{{- end }}

{{/* The DNS name in the certificate, which every peer checks (settings.grpc.tls_server_name). */}}
{{- define "tandem.grpcTLS.serverName" -}}
{{- .Values.grpcTLS.serverName | default (printf "%s-grpc" (include "tandem.fullname" .)) }}
{{- end }}

{{/* "true" when the chart asks cert-manager for the certificate: certManager.enabled true, or
auto and the cluster serves cert-manager.io/v1 (Argo CD passes the cluster's API versions). */}}
{{- define "tandem.grpcTLS.certManager" -}}
{{- $t := .Values.grpcTLS }}
{{- if and $t.enabled (not $t.secretName) }}
{{- $cm := toString $t.certManager.enabled }}
{{- if eq $cm "auto" }}{{ .Capabilities.APIVersions.Has "cert-manager.io/v1" }}{{ else }}{{ eq $cm "true" }}{{ end }}
{{- else }}false{{ end }}
{{- end }}

{{/* A worker's TLS settings (env), from grpcTLS. args: dict "root" $ "prefix" "TANDEM_PREFILL_" */}}
{{- define "tandem.grpcTLS.env" -}}
{{- $t := .root.Values.grpcTLS }}
{{- if $t.enabled }}
- name: {{ .prefix }}GRPC__TLS_CERT_FILE
  value: {{ printf "%s/tls.crt" $t.mountPath | quote }}
- name: {{ .prefix }}GRPC__TLS_KEY_FILE
  value: {{ printf "%s/tls.key" $t.mountPath | quote }}
- name: {{ .prefix }}GRPC__TLS_CA_FILE
  value: {{ printf "%s/ca.crt" $t.mountPath | quote }}
- name: {{ .prefix }}GRPC__TLS_SERVER_NAME
  value: {{ include "tandem.grpcTLS.serverName" .root | quote }}
{{- end }}
{{- end }}

{{/* The port a worker's probes use: the plaintext health port when set, else the gRPC port. */}}
{{- define "tandem.worker.probePort" -}}
{{- $g := .settings.grpc }}{{ ternary $g.health_port $g.port (gt (int $g.health_port) 0) }}
{{- end }}

{{/* Where the bundled Redis reads its password (a file of its Secret, mounted read-only). */}}
{{- define "tandem.redis.authFile" -}}/etc/redis-auth/password{{- end }}

{{/* The port the gateway serves /metrics on: settings.metrics_port, or its HTTP port when 0. */}}
{{- define "tandem.gateway.metricsPort" -}}
{{- $s := .Values.gateway.settings }}{{ ternary $s.metrics_port $s.port (gt (int $s.metrics_port) 0) }}
{{- end }}

{{/* The internal gRPC mTLS material: mounted into the worker pods only (the KV transfer's two
ends); the gateway, which faces clients, and the planner speak no internal gRPC and hold no key. */}}
{{- define "tandem.grpcTLS.volumes" -}}
{{- if .Values.grpcTLS.enabled }}
- name: grpc-tls
  secret:
    secretName: {{ include "tandem.grpcTLS.secret" . }}
    defaultMode: 0440
{{- end }}
{{- end }}

{{- define "tandem.grpcTLS.volumeMounts" -}}
{{- if .Values.grpcTLS.enabled }}
- name: grpc-tls
  mountPath: {{ .Values.grpcTLS.mountPath }}
  readOnly: true
{{- end }}
{{- end }}

{{/* "true" when the bundled Redis has one ACL user per role (redis.acl.enabled; null, the default:
on unless redis.auth.existingSecret is given, whose Secret an upgrade would otherwise need the four
role keys in): each role
connects as tandem-<role> with its own password (tandem_core/bus/acl.py, files/redis-acl.txt). */}}
{{- define "tandem.redis.aclOn" -}}
{{- $acl := .Values.redis.acl.enabled -}}
{{- if kindIs "invalid" $acl }}{{ $acl = not .Values.redis.auth.existingSecret }}{{ end -}}
{{- if and .Values.redis.enabled $acl }}true{{ end }}
{{- end }}

{{/* The roles of files/redis-acl.txt, in its order (each line: tandem-<role> <rules>). */}}
{{- define "tandem.redis.aclRoles" -}}
{{- range splitList "\n" (.Files.Get "files/redis-acl.txt" | trim) }}{{ trimPrefix "tandem-" (first (splitList " " .)) }} {{ end }}
{{- end }}

{{/* The Secret key of a role's Redis password: its own with the ACL users, else the shared one.
args: dict "root" $ "role" "gateway" */}}
{{- define "tandem.redis.rolePasswordKey" -}}
{{- if include "tandem.redis.aclOn" .root }}{{ printf "%s-%s" .root.Values.redis.auth.existingSecretPasswordKey .role }}{{ else }}{{ include "tandem.redis.passwordKey" .root }}{{ end }}
{{- end }}

{{/* A role's Redis user name, as an env entry, with the ACL users. args: dict "root" $ "role" "gateway" "prefix" "TANDEM_GATEWAY_" */}}
{{- define "tandem.redis.usernameEnv" -}}
{{- if include "tandem.redis.aclOn" .root }}
- name: {{ .prefix }}REDIS__USERNAME
  value: {{ printf "tandem-%s" .role | quote }}
{{- end }}
{{- end }}
