{{- define "pagefleet.fullname" -}}
{{- if contains .Chart.Name .Release.Name -}}
{{- .Release.Name | trunc 63 | trimSuffix "-" -}}
{{- else -}}
{{- printf "%s-%s" .Release.Name .Chart.Name | trunc 63 | trimSuffix "-" -}}
{{- end -}}
{{- end -}}

{{- define "pagefleet.operatorName" -}}
{{- printf "%s-operator" (include "pagefleet.fullname" .) | trunc 63 | trimSuffix "-" -}}
{{- end -}}

{{- define "pagefleet.gatewayName" -}}
{{- printf "%s-gateway" (include "pagefleet.fullname" .) | trunc 63 | trimSuffix "-" -}}
{{- end -}}

{{- define "pagefleet.serviceAccountName" -}}
{{- if .Values.serviceAccount.create -}}
{{- default (include "pagefleet.operatorName" .) .Values.serviceAccount.name -}}
{{- else -}}
{{- default "default" .Values.serviceAccount.name -}}
{{- end -}}
{{- end -}}

{{- define "pagefleet.image" -}}
{{- printf "%s:%s" .Values.image.repository (default .Chart.AppVersion .Values.image.tag) -}}
{{- end -}}

{{- define "pagefleet.labels" -}}
helm.sh/chart: {{ printf "%s-%s" .Chart.Name .Chart.Version | replace "+" "_" }}
app.kubernetes.io/part-of: pagefleet
app.kubernetes.io/instance: {{ .Release.Name }}
app.kubernetes.io/managed-by: {{ .Release.Service }}
app.kubernetes.io/version: {{ .Chart.AppVersion | quote }}
{{- end -}}

{{- define "pagefleet.operatorSelector" -}}
app.kubernetes.io/name: pagefleet-operator
app.kubernetes.io/instance: {{ .Release.Name }}
{{- end -}}

{{- define "pagefleet.gatewaySelector" -}}
app.kubernetes.io/name: pagefleet-gateway
app.kubernetes.io/instance: {{ .Release.Name }}
{{- end -}}

{{- define "pagefleet.gatewaySecretName" -}}
{{- default (include "pagefleet.gatewayName" .) .Values.gateway.existingSecret -}}
{{- end -}}

{{/* What the operator may do to run InferenceServices: no delete anywhere (children go by garbage collection),
     read-only on pods and claims. */}}
{{- define "pagefleet.operatorRules" -}}
- apiGroups: [pagefleet.io]
  resources: [inferenceservices]
  verbs: [get, list, watch, patch]
- apiGroups: [pagefleet.io]
  resources: [inferenceservices/status, inferenceservices/scale]
  verbs: [get, patch]
# Owner references with blockOwnerDeletion need update on the owner's finalizers.
- apiGroups: [pagefleet.io]
  resources: [inferenceservices/finalizers]
  verbs: [update]
- apiGroups: [apps]
  resources: [deployments]
  verbs: [get, list, watch, create, patch]
- apiGroups: [""]
  resources: [services]
  verbs: [get, list, watch, create, patch]
- apiGroups: [""]
  resources: [pods, persistentvolumeclaims]
  verbs: [get, list, watch]
- apiGroups: [""]
  resources: [events]
  verbs: [list, create, patch]
- apiGroups: [events.k8s.io]
  resources: [events]
  verbs: [create, patch]
{{- end -}}
