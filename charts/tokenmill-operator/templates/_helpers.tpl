{{/* Chart name, truncated to the 63 characters a label value allows. */}}
{{- define "tokenmill-operator.name" -}}
{{- .Chart.Name | trunc 63 | trimSuffix "-" }}
{{- end }}

{{/* Full name: the release name, or release-chart when the release name does not contain the chart's. */}}
{{- define "tokenmill-operator.fullname" -}}
{{- if contains .Chart.Name .Release.Name }}
{{- .Release.Name | trunc 63 | trimSuffix "-" }}
{{- else }}
{{- printf "%s-%s" .Release.Name .Chart.Name | trunc 63 | trimSuffix "-" }}
{{- end }}
{{- end }}

{{- define "tokenmill-operator.selectorLabels" -}}
app.kubernetes.io/name: {{ include "tokenmill-operator.name" . }}
app.kubernetes.io/instance: {{ .Release.Name }}
{{- end }}

{{- define "tokenmill-operator.labels" -}}
helm.sh/chart: {{ printf "%s-%s" .Chart.Name .Chart.Version | replace "+" "_" | trunc 63 | trimSuffix "-" }}
{{ include "tokenmill-operator.selectorLabels" . }}
app.kubernetes.io/version: {{ .Chart.AppVersion | quote }}
app.kubernetes.io/component: operator
app.kubernetes.io/part-of: tokenmill
app.kubernetes.io/managed-by: {{ .Release.Service }}
{{- end }}

{{- define "tokenmill-operator.serviceAccountName" -}}
{{- if .Values.serviceAccount.create }}
{{- default (include "tokenmill-operator.fullname" .) .Values.serviceAccount.name }}
{{- else }}
{{- required "serviceAccount.name is required when serviceAccount.create is false" .Values.serviceAccount.name }}
{{- end }}
{{- end }}

{{- define "tokenmill-operator.image" -}}
{{- printf "%s:%s" .Values.image.repository (default .Chart.AppVersion .Values.image.tag) }}
{{- end }}

{{- define "tokenmill-operator.engineImage" -}}
{{- printf "%s:%s" .Values.engineImage.repository (default .Chart.AppVersion .Values.engineImage.tag) }}
{{- end }}

{{/* Peering is only needed (and only coordinates anything) with more than one replica. */}}
{{- define "tokenmill-operator.peering" -}}
{{- if gt (int .Values.replicaCount) 1 }}true{{ end }}
{{- end }}

{{/* Kueue's read-only rules: rbac.kueue true, or "auto" (the default) when the API server serves Kueue's
API at install time (discovery, as `helm install` sees it). */}}
{{- define "tokenmill-operator.kueue" -}}
{{- $v := toString .Values.rbac.kueue }}
{{- if or (eq $v "true") (and (eq $v "auto") (.Capabilities.APIVersions.Has "kueue.x-k8s.io/v1beta2")) }}true{{ end }}
{{- end }}

{{/* Routing's rules (rbac.routing): true, or "auto" when the API server serves the InferencePool API at install
time; and the Gateway API's (rbac.gateway) likewise. */}}
{{- define "tokenmill-operator.routing" -}}
{{- $v := toString .Values.rbac.routing }}
{{- if or (eq $v "true") (and (eq $v "auto") (.Capabilities.APIVersions.Has "inference.networking.k8s.io/v1")) }}true{{ end }}
{{- end }}
{{- define "tokenmill-operator.gateway" -}}
{{- $v := toString .Values.rbac.gateway }}
{{- if or (eq $v "true") (and (eq $v "auto") (.Capabilities.APIVersions.Has "gateway.networking.k8s.io/v1")) }}true{{ end }}
{{- end }}

{{/* The ClusterRole holding the endpoint picker's rights, bound to each router's ServiceAccount. */}}
{{- define "tokenmill-operator.eppRole" -}}
{{- printf "%s-epp" (include "tokenmill-operator.fullname" .) }}
{{- end }}
