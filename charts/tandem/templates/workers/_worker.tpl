{{/*
Prefill and decode pods are built from one definition: same lifecycle, same TPU scheduling, their
own settings. args: dict "root" $ "component" "prefill"|"decode" "prefix" "TANDEM_PREFILL_"
*/}}

{{/* The settings ConfigMap data for a worker (redis.url is chart-owned, added here). */}}
{{- define "tandem.worker.configData" -}}
{{- $c := index .root.Values .component }}
{{- $s := $c.settings }}
{{- if include "tandem.redis.sentinel" .root }}{{ $s = include "tandem.redis.withSentinel" (dict "root" .root "settings" $s) | fromJson }}{{ end }}
{{- include "tandem.settingsEnv" (dict "prefix" .prefix "settings" $s) | trim }}
{{ .prefix }}REDIS__URL: {{ include "tandem.redis.url" .root | quote }}
{{ include "tandem.redis.keysEnv" (dict "root" .root "prefix" .prefix) }}
{{- end }}

{{- define "tandem.worker.configmap" -}}
{{- $root := .root }}
apiVersion: v1
kind: ConfigMap
metadata:
  name: {{ include "tandem.componentName" . }}
  namespace: {{ $root.Release.Namespace }}
  labels:
    {{- include "tandem.labels" . | nindent 4 }}
data:
  {{- include "tandem.worker.configData" . | nindent 2 }}
{{- end }}

{{- define "tandem.worker.deployment" -}}
{{- $root := .root }}
{{- $component := .component }}
{{- $prefix := .prefix }}
{{- $c := index $root.Values $component }}
{{- $s := $c.settings }}
{{- $image := ternary $root.Values.images.workerTpu $root.Values.images.workerCpu (eq (toString $c.tpu.enabled) "true") }}
{{- $grace := add (int $c.preStopSleepSeconds) (int (ceil (float64 $s.drain_timeout_s))) (int $c.terminationGraceExtraSeconds) }}
{{- $passwordSecret := include "tandem.redis.passwordSecret" $root }}
apiVersion: apps/v1
kind: Deployment
metadata:
  name: {{ include "tandem.componentName" . }}
  namespace: {{ $root.Release.Namespace }}
  labels:
    {{- include "tandem.labels" . | nindent 4 }}
spec:
  {{- if not (include "tandem.scaler" .) }}
  replicas: {{ $c.replicas }}
  {{- end }}
  revisionHistoryLimit: 5
  minReadySeconds: {{ $c.minReadySeconds }}
  strategy:
    {{- toYaml $c.strategy | nindent 4 }}
  selector:
    matchLabels:
      {{- include "tandem.selectorLabels" . | nindent 6 }}
  template:
    metadata:
      labels:
        {{- include "tandem.labels" . | nindent 8 }}
        {{- with $c.podLabels }}
        {{- toYaml . | nindent 8 }}
        {{- end }}
      {{- /* One map, so a key given twice (e.g. gke-gcsfuse/volumes) is written once. */}}
      {{- $ann := mergeOverwrite (deepCopy (default dict $root.Values.model.podAnnotations)) (deepCopy (default dict $c.podAnnotations)) }}
      {{- if include "tandem.usesGcsFuse" (list $root.Values.model.volume (ternary $c.compilationCache.volume dict (eq (toString $c.compilationCache.enabled) "true"))) }}
      {{- $_ := set $ann "gke-gcsfuse/volumes" "true" }}
      {{- end }}
      {{- $_ := set $ann "checksum/config" (include "tandem.worker.configData" . | sha256sum) }}
      {{- $_ := set $ann "checksum/secrets" (include "tandem.secretsChecksum" (dict "root" $root "files" (list "redis"))) }}
      annotations:
        {{- toYaml $ann | nindent 8 }}
    spec:
      serviceAccountName: {{ include "tandem.serviceAccountName" $root }}
      automountServiceAccountToken: {{ $root.Values.automountServiceAccountToken }}
      {{- with $root.Values.imagePullSecrets }}
      imagePullSecrets:
        {{- toYaml . | nindent 8 }}
      {{- end }}
      {{- with $c.priorityClassName }}
      priorityClassName: {{ . }}
      {{- end }}
      # Longer than the drain: preStop sleep + settings.drain_timeout_s + margin.
      terminationGracePeriodSeconds: {{ $grace }}
      securityContext:
        {{- toYaml $root.Values.podSecurityContext | nindent 8 }}
      {{- $nodeSelector := dict }}
      {{- if $c.tpu.enabled }}
      {{- $_ := set $nodeSelector "cloud.google.com/gke-tpu-accelerator" $c.tpu.accelerator }}
      {{- $_ := set $nodeSelector "cloud.google.com/gke-tpu-topology" (toString $c.tpu.topology) }}
      {{- end }}
      {{- $nodeSelector = merge $nodeSelector $c.nodeSelector }}
      {{- with $nodeSelector }}
      nodeSelector:
        {{- toYaml . | nindent 8 }}
      {{- end }}
      {{- if or $c.tpu.enabled $c.tolerations }}
      tolerations:
        {{- if $c.tpu.enabled }}
        - key: google.com/tpu
          operator: Exists
          effect: NoSchedule
        {{- end }}
        {{- with $c.tolerations }}
        {{- toYaml . | nindent 8 }}
        {{- end }}
      {{- end }}
      {{- with $c.affinity }}
      affinity:
        {{- toYaml . | nindent 8 }}
      {{- end }}
      {{- with $c.topologySpreadConstraints }}
      topologySpreadConstraints:
        {{- toYaml . | nindent 8 }}
      {{- end }}
      containers:
        - name: {{ $component }}
          image: {{ include "tandem.image" (dict "root" $root "image" $image) }}
          imagePullPolicy: {{ $root.Values.images.pullPolicy }}
          command: ["tandem", {{ $component | quote }}]
          securityContext:
            {{- toYaml $root.Values.containerSecurityContext | nindent 12 }}
          ports:
            - name: grpc
              containerPort: {{ $s.grpc.port }}
              protocol: TCP
            {{- if gt (int $s.grpc.health_port) 0 }}
            - name: grpc-health
              containerPort: {{ $s.grpc.health_port }}
              protocol: TCP
            {{- end }}
          envFrom:
            - configMapRef:
                name: {{ include "tandem.componentName" . }}
          env:
            # Chart-owned settings: identity and address come from the pod itself.
            - name: {{ $prefix }}WORKER_ID
              valueFrom:
                fieldRef: {fieldPath: metadata.name}
            - name: {{ $prefix }}GRPC__ADVERTISE_HOST
              valueFrom:
                fieldRef: {fieldPath: status.podIP}
            {{- with include "tandem.grpcTLS.env" (dict "root" $root "prefix" $prefix) }}{{ . | nindent 12 }}{{ end }}
            {{- if $passwordSecret }}
            - name: {{ $prefix }}REDIS__PASSWORD
              valueFrom:
                secretKeyRef:
                  name: {{ $passwordSecret }}
                  key: {{ include "tandem.redis.rolePasswordKey" (dict "root" $root "role" $component) }}
            {{- end }}
            {{- include "tandem.redis.usernameEnv" (dict "root" $root "role" $component "prefix" $prefix) | nindent 12 }}
            # Runtime (not Tandem settings).
            - name: HOME
              value: /tmp
            - name: JAX_PLATFORMS
              value: {{ ternary "tpu" "cpu" (eq (toString $c.tpu.enabled) "true") | quote }}
            {{- if $c.compilationCache.enabled }}
            - name: JAX_COMPILATION_CACHE_DIR
              value: /var/cache/jax
            {{- end }}
            {{- with $c.extraEnv }}
            {{- toYaml . | nindent 12 }}
            {{- end }}
          resources:
            {{- $res := deepCopy (default dict $c.resources) }}
            {{- if $c.tpu.enabled }}
            {{- $req := default dict $res.requests }}
            {{- $lim := default dict $res.limits }}
            {{- $_ := set $req "google.com/tpu" (int $c.tpu.chips) }}
            {{- $_ := set $lim "google.com/tpu" (int $c.tpu.chips) }}
            {{- $_ := set $res "requests" $req }}
            {{- $_ := set $res "limits" $lim }}
            {{- end }}
            {{- toYaml $res | nindent 12 }}
          # Health is grpc.health.v1 on the plaintext settings.grpc.health_port (settings.grpc.port
          # when that is 0: then without grpcTLS); NOT_SERVING until the engine has compiled, so
          # startup allows startup.periodSeconds*failureThreshold for compilation.
          {{- $probePort := include "tandem.worker.probePort" $c }}
          startupProbe:
            grpc: {port: {{ $probePort }}}
            {{- toYaml $c.probes.startup | nindent 12 }}
          readinessProbe:
            grpc: {port: {{ $probePort }}}
            {{- toYaml $c.probes.readiness | nindent 12 }}
          livenessProbe:
            grpc: {port: {{ $probePort }}}
            {{- toYaml $c.probes.liveness | nindent 12 }}
          lifecycle:
            # A short pause before SIGTERM; the drain itself (settings.drain_timeout_s) starts on
            # SIGTERM and terminationGracePeriodSeconds covers both.
            preStop:
              sleep: {seconds: {{ $c.preStopSleepSeconds }}}
          volumeMounts:
            - name: tmp
              mountPath: /tmp
            {{- if $c.compilationCache.enabled }}
            - name: jax-cache
              mountPath: /var/cache/jax
            {{- end }}
            {{- if $root.Values.model.volume }}
            - name: model
              mountPath: {{ $root.Values.model.mountPath }}
              readOnly: true
            {{- end }}
            {{- with include "tandem.commonVolumeMounts" $root }}{{ . | nindent 12 }}{{ end }}
            {{- with include "tandem.grpcTLS.volumeMounts" $root }}{{ . | nindent 12 }}{{ end }}
            {{- with $c.extraVolumeMounts }}
            {{- toYaml . | nindent 12 }}
            {{- end }}
      volumes:
        - name: tmp
          emptyDir: {sizeLimit: 1Gi}
        {{- if $c.compilationCache.enabled }}
        - name: jax-cache
          {{- include "tandem.worker.cacheVolume" . | nindent 10 }}
        {{- end }}
        {{- if $root.Values.model.volume }}
        - name: model
          {{- toYaml $root.Values.model.volume | nindent 10 }}
        {{- end }}
        {{- with include "tandem.commonVolumes" $root }}{{ . | nindent 8 }}{{ end }}
        {{- with include "tandem.grpcTLS.volumes" $root }}{{ . | nindent 8 }}{{ end }}
        {{- with $c.extraVolumes }}
        {{- toYaml . | nindent 8 }}
        {{- end }}
{{- end }}

{{/* The pool's shared JAX compilation cache claim (compilationCache.persistentVolumeClaim.create). */}}
{{- define "tandem.worker.cachePVC" -}}
{{- $root := .root }}
{{- $cache := (index $root.Values .component).compilationCache }}
{{- if and $cache.enabled $cache.persistentVolumeClaim.create (not $cache.volume) }}
{{- $pvc := $cache.persistentVolumeClaim }}
apiVersion: v1
kind: PersistentVolumeClaim
metadata:
  name: {{ include "tandem.componentName" (dict "root" $root "component" (printf "%s-jax-cache" .component)) }}
  namespace: {{ $root.Release.Namespace }}
  labels:
    {{- include "tandem.labels" . | nindent 4 }}
spec:
  accessModes:
    {{- toYaml $pvc.accessModes | nindent 4 }}
  {{- with $pvc.storageClassName }}
  storageClassName: {{ . | quote }}
  {{- end }}
  resources:
    requests:
      storage: {{ $pvc.size }}
{{- end }}
{{- end }}
