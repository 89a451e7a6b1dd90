{{/*
The planner (`tandem planner`, planner/): settings as env like the other services. Chart-owned:
redis.url / redis.password, profile_path (from planner.profile), prefill.deployment /
decode.deployment, kubernetes.namespace and kubernetes.lease_name (this release's objects).
*/}}

{{/*
Where planner.profile comes from: "inline" (JSON text, or the profile written as a YAML map),
"configmap" (an existing ConfigMap's name) or "" (built in).
*/}}
{{- define "tandem.planner.profileSource" -}}
{{- $p := .Values.planner.profile }}
{{- if kindIs "map" $p }}{{ if $p }}inline{{ end }}
{{- else if hasPrefix "{" (trim (toString $p)) }}inline
{{- else if trim (toString $p) }}configmap
{{- end }}
{{- end }}

{{/* The inline profile as JSON text. */}}
{{- define "tandem.planner.profileJson" -}}
{{- $p := .Values.planner.profile }}
{{- if kindIs "map" $p }}{{ toJson $p }}{{ else }}{{ trim (toString $p) }}{{ end }}
{{- end }}

{{/* The ConfigMap holding the profile (the chart's own for inline JSON). */}}
{{- define "tandem.planner.profileConfigMap" -}}
{{- if eq (include "tandem.planner.profileSource" .) "inline" }}
{{- include "tandem.componentName" (dict "root" . "component" "planner-profile") }}
{{- else }}
{{- trim (toString .Values.planner.profile) }}
{{- end }}
{{- end }}

{{- define "tandem.planner.profileDir" -}}/etc/tandem/planner{{- end }}

{{/* Whether the planner scales the Deployments itself (and so needs its ServiceAccount and RBAC). */}}
{{- define "tandem.planner.scales" -}}
{{- if and .Values.planner.enabled (eq (toString .Values.planner.settings.mode) "kubernetes") }}true{{ end }}
{{- end }}

{{- define "tandem.planner.configData" -}}
{{- $s := .Values.planner.settings }}
{{- if include "tandem.redis.sentinel" . }}{{ $s = include "tandem.redis.withSentinel" (dict "root" . "settings" $s) | fromJson }}{{ end }}
{{- include "tandem.settingsEnv" (dict "prefix" "TANDEM_PLANNER_" "settings" $s) | trim }}
TANDEM_PLANNER_REDIS__URL: {{ include "tandem.redis.url" . | quote }}
{{ include "tandem.redis.keysEnv" (dict "root" . "prefix" "TANDEM_PLANNER_") }}
TANDEM_PLANNER_PROFILE_PATH: {{ ternary (printf "%s/profile.json" (include "tandem.planner.profileDir" .)) "" (ne (include "tandem.planner.profileSource" .) "") | quote }}
TANDEM_PLANNER_PREFILL__DEPLOYMENT: {{ include "tandem.componentName" (dict "root" . "component" "prefill") | quote }}
TANDEM_PLANNER_DECODE__DEPLOYMENT: {{ include "tandem.componentName" (dict "root" . "component" "decode") | quote }}
TANDEM_PLANNER_KUBERNETES__NAMESPACE: {{ .Release.Namespace | quote }}
TANDEM_PLANNER_KUBERNETES__LEASE_NAME: {{ include "tandem.componentName" (dict "root" . "component" "planner") | quote }}
{{- end }}
