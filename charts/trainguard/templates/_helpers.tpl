{{/*
Names. Kubernetes object names (and label values) are at most 63 characters, so every name is
truncated to 63 and loses a trailing dash; a suffix is added before truncating, never after.
*/}}

{{/* The chart's name: "trainguard" or nameOverride. */}}
{{- define "trainguard.name" -}}
{{- default .Chart.Name .Values.nameOverride | trunc 63 | trimSuffix "-" -}}
{{- end -}}

{{/*
The release's full name, the prefix of every object's name: fullnameOverride, or "<release>-<chart>",
or just the release name when it already contains the chart name.
*/}}
{{- define "trainguard.fullname" -}}
{{- if .Values.fullnameOverride -}}
{{- .Values.fullnameOverride | trunc 63 | trimSuffix "-" -}}
{{- else -}}
{{- $name := default .Chart.Name .Values.nameOverride -}}
{{- if contains $name .Release.Name -}}
{{- .Release.Name | trunc 63 | trimSuffix "-" -}}
{{- else -}}
{{- printf "%s-%s" .Release.Name $name | trunc 63 | trimSuffix "-" -}}
{{- end -}}
{{- end -}}
{{- end -}}

{{/* A component's name: "<fullname>-<component>", truncated as a whole. Call with (list . "operator"). */}}
{{- define "trainguard.componentName" -}}
{{- $root := index . 0 -}}
{{- printf "%s-%s" (include "trainguard.fullname" $root | trunc 50 | trimSuffix "-") (index . 1) | trunc 63 | trimSuffix "-" -}}
{{- end -}}

{{/* "<chart>-<version>" for the helm.sh/chart label. */}}
{{- define "trainguard.chart" -}}
{{- printf "%s-%s" .Chart.Name .Chart.Version | replace "+" "_" | trunc 63 | trimSuffix "-" -}}
{{- end -}}

{{/* The labels every object carries. */}}
{{- define "trainguard.labels" -}}
helm.sh/chart: {{ include "trainguard.chart" . }}
{{ include "trainguard.selectorLabels" . }}
app.kubernetes.io/version: {{ .Chart.AppVersion | quote }}
app.kubernetes.io/managed-by: {{ .Release.Service }}
app.kubernetes.io/part-of: trainguard
{{- end -}}

{{/* The labels that select the operator's pods (immutable once installed: keep them few). */}}
{{- define "trainguard.selectorLabels" -}}
app.kubernetes.io/name: {{ include "trainguard.name" . }}
app.kubernetes.io/instance: {{ .Release.Name | trunc 63 | trimSuffix "-" }}
{{- end -}}

{{/* labels plus app.kubernetes.io/component. Call with (list . "operator"). */}}
{{- define "trainguard.componentLabels" -}}
{{ include "trainguard.labels" (index . 0) }}
app.kubernetes.io/component: {{ index . 1 }}
{{- end -}}

{{/* The operator's pod selector. */}}
{{- define "trainguard.operatorSelectorLabels" -}}
{{ include "trainguard.selectorLabels" . }}
app.kubernetes.io/component: operator
{{- end -}}

{{/* The operator's ServiceAccount name. */}}
{{- define "trainguard.serviceAccountName" -}}
{{- if .Values.serviceAccount.create -}}
{{- default (include "trainguard.componentName" (list . "operator")) .Values.serviceAccount.name -}}
{{- else -}}
{{- default "default" .Values.serviceAccount.name -}}
{{- end -}}
{{- end -}}

{{/* "true" when the operator watches every namespace, "" otherwise. */}}
{{- define "trainguard.clusterwide" -}}
{{- if eq .Values.operator.scope "cluster" -}}true{{- end -}}
{{- end -}}

{{/* The namespaces a namespace-scoped operator watches: watchNamespaces, or the release's namespace. */}}
{{- define "trainguard.watchNamespaces" -}}
{{- $namespaces := .Values.operator.watchNamespaces | default (list .Release.Namespace) -}}
{{- toJson (uniq $namespaces) -}}
{{- end -}}

{{/* "true" when kopf peering is on (more than one replica: one is active, the others stand by). */}}
{{- define "trainguard.peering" -}}
{{- if gt (int .Values.operator.replicas) 1 -}}true{{- end -}}
{{- end -}}

{{/* The kopf peering object's name. */}}
{{- define "trainguard.peeringName" -}}
{{- default (include "trainguard.fullname" .) .Values.operator.peering.name -}}
{{- end -}}

{{/* An image reference from {repository, tag}; the tag defaults to the chart's appVersion. */}}
{{- define "trainguard.image" -}}
{{- $image := index . 0 -}}
{{- $root := index . 1 -}}
{{- printf "%s:%s" $image.repository (default $root.Chart.AppVersion $image.tag) -}}
{{- end -}}

{{/*
"true" when trainguard's ClusterTrainingRuntime is rendered: trainJobRuntime.install true, or auto and
the cluster serves trainer.kubeflow.org/v1alpha1 (Kubeflow Trainer v2; `helm template` needs
--api-versions).
*/}}
{{- define "trainguard.trainJobRuntime" -}}
{{- $install := .Values.trainJobRuntime.install -}}
{{- if or (eq (toString $install) "true") (and (eq (toString $install) "auto") (.Capabilities.APIVersions.Has "trainer.kubeflow.org/v1alpha1")) -}}true{{- end -}}
{{- end -}}

{{/*
"true" when the Prometheus Operator's objects are rendered: the cluster serves monitoring.coreos.com/v1
(helm install/upgrade see the real API list; `helm template` needs --api-versions), or monitoring.force.
*/}}
{{- define "trainguard.monitoring" -}}
{{- if or .Values.monitoring.force (.Capabilities.APIVersions.Has "monitoring.coreos.com/v1") -}}true{{- end -}}
{{- end -}}

{{/* The labels of a Prometheus Operator object: the chart's, the component's, and monitoring.labels. */}}
{{- define "trainguard.monitoringLabels" -}}
{{ include "trainguard.componentLabels" . }}
{{- with (index . 0).Values.monitoring.labels }}
{{ toYaml . }}
{{- end }}
{{- end -}}

{{/* The annotations of a CRD the chart installs: helm.sh/resource-policy keep unless crds.keep is false. */}}
{{- define "trainguard.crdAnnotations" -}}
{{- if .Values.crds.keep -}}
annotations:
  # Helm leaves this CRD (and so every object of its kind) in place on `helm uninstall`.
  helm.sh/resource-policy: keep
{{- end -}}
{{- end -}}

{{/*
The name of the chart's cluster-scoped RBAC objects. Cluster-scoped names are shared by every release
in the cluster, so they carry the release's namespace too.
*/}}
{{- define "trainguard.clusterRoleName" -}}
{{- printf "%s-%s-operator" .Release.Namespace (include "trainguard.fullname" .) | trunc 63 | trimSuffix "-" -}}
{{- end -}}

{{/* The Secret holding the key restart orders are signed with: the user's, or the chart's own. */}}
{{- define "trainguard.orderKeySecret" -}}
{{- default (include "trainguard.componentName" (list . "order-key")) .Values.restartInPlace.existingSecret -}}
{{- end -}}
