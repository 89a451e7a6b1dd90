{{/*
Gateway API Inference Extension (inference.networking.k8s.io/v1): an InferencePool of the
gateway pods and its endpoint picker (EPP, the upstream image at images.epp). The EPP watches the
pool and its pods, scrapes each gateway's /metrics for the vllm:* gauges (gateway/metrics.py) and
answers the Inference Gateway's ext-proc calls with the pod to send a request to.
*/}}

{{/* Ports of the EPP binary (its --grpc-port, --grpc-health-port and --metrics-port defaults). */}}
{{- define "tandem.epp.extProcPort" -}}9002{{- end }}
{{- define "tandem.epp.healthPort" -}}9003{{- end }}
{{- define "tandem.epp.metricsPort" -}}9090{{- end }}

{{/* The InferencePool: named like the gateway Service, a different kind. */}}
{{- define "tandem.inferencePool.name" -}}
{{- include "tandem.componentName" (dict "root" . "component" "gateway") }}
{{- end }}
