{{/* GatewaySettings as env (TANDEM_GATEWAY_*); redis.url is chart-owned. */}}
{{- define "tandem.gateway.configData" -}}
{{- $s := .Values.gateway.settings }}
{{- if include "tandem.redis.sentinel" . }}{{ $s = include "tandem.redis.withSentinel" (dict "root" . "settings" $s) | fromJson }}{{ end }}
{{- include "tandem.settingsEnv" (dict "prefix" "TANDEM_GATEWAY_" "settings" $s) | trim }}
TANDEM_GATEWAY_REDIS__URL: {{ include "tandem.redis.url" . | quote }}
{{ include "tandem.redis.keysEnv" (dict "root" . "prefix" "TANDEM_GATEWAY_") }}
{{- end }}

{{/* Secret holding api_keys (JSON list) and admin_key, or "" when auth is off. */}}
{{- define "tandem.gateway.authSecret" -}}
{{- if .Values.gateway.auth.enabled }}
{{- default (include "tandem.componentName" (dict "root" . "component" "gateway-auth")) .Values.gateway.auth.existingSecret }}
{{- end }}
{{- end }}
