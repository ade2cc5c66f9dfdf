{{/* Objects carry the same names and labels as deploy/k8s/base; one release per namespace. */}}
{{- define "kvmesh.partOf" -}}
app.kubernetes.io/part-of: kvmesh
{{- end }}

{{- define "kvmesh.image" -}}
{{ .Values.image.repository }}:{{ .Values.image.tag }}
{{- end }}

{{- define "kvmesh.workerImage" -}}
{{- if .Values.gpu.enabled -}}
{{ .Values.image.cudaRepository }}:{{ .Values.image.cudaTag }}
{{- else -}}
{{ .Values.image.repository }}:{{ .Values.image.tag }}
{{- end }}
{{- end }}

{{- define "kvmesh.tokenSecret" -}}
{{- if .Values.auth.existingSecret -}}
{{ .Values.auth.existingSecret }}
{{- else -}}
kvmesh-cluster-token
{{- end }}
{{- end }}

{{- define "kvmesh.modelPath" -}}
{{- $root := index . 0 -}}{{- $role := index . 1 -}}
{{- default (printf "/models/checkpoints/%s" $root.Values.model.name) (index $root.Values.model $role) -}}
{{- end }}

{{/* The env every kvmesh container gets for tracing. */}}
{{- define "kvmesh.otelEnv" -}}
{{- $root := index . 0 -}}{{- $service := index . 1 -}}
- name: OTEL_SERVICE_NAME
  value: {{ $service }}
- name: OTEL_EXPORTER_OTLP_ENDPOINT
  value: {{ $root.Values.otelEndpoint }}
- name: OTEL_EXPORTER_OTLP_INSECURE
  value: "true"
- name: OTEL_TRACES_EXPORTER
  value: otlp
- name: OTEL_RESOURCE_ATTRIBUTES
  value: service.namespace=kvmesh,k8s.pod.name=$(POD_NAME)
{{- end }}

{{- define "kvmesh.podSecurityContext" -}}
runAsNonRoot: true
runAsUser: 10001
runAsGroup: 10001
fsGroup: 10001
seccompProfile:
  type: RuntimeDefault
{{- end }}

{{- define "kvmesh.containerSecurityContext" -}}
allowPrivilegeEscalation: false
readOnlyRootFilesystem: true
capabilities:
  drop: ["ALL"]
{{- end }}

{{- define "kvmesh.modelEnv" -}}
{{- $role := index . 1 -}}
- name: KVMESH_MODEL
  valueFrom:
    configMapKeyRef:
      name: kvmesh-model
      key: {{ $role }}-model
{{- end }}

{{/* Resources of a worker, with the GPU added when gpu.enabled. */}}
{{- define "kvmesh.workerResources" -}}
{{- $root := index . 0 -}}{{- $resources := deepCopy (index . 1) -}}
{{- if $root.Values.gpu.enabled -}}
{{- $_ := set $resources.requests "nvidia.com/gpu" (int $root.Values.gpu.count) -}}
{{- $_ := set $resources.limits "nvidia.com/gpu" (int $root.Values.gpu.count) -}}
{{- end -}}
{{ toYaml $resources }}
{{- end }}
