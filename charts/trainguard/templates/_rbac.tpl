{{/*
The operator's RBAC, in one place: what python -m trainguard_operator does against the API, nothing
more. No wildcards, no Secrets. tests/test_chart.py holds the same contract as data and fails when the
rendered Roles and ClusterRoles grant less or more, in both scopes.
*/}}

{{/* Rules on namespaced resources: in a Role per watched namespace, or the ClusterRole when cluster-wide. */}}
{{- define "trainguard.rbac.namespacedRules" -}}
# kopf lists and watches GuardedTrainingJobs, and patches their metadata: its progress and diff-base
# annotations (trainguard.dev/*) and its finalizer.
- apiGroups: ["trainguard.dev"]
  resources: ["guardedtrainingjobs"]
  verbs: ["get", "list", "watch", "patch"]
# The operator keeps the job's state in its status subresource (phase, attempt, restarts, conditions)
# and reads it back before every decision.
- apiGroups: ["trainguard.dev"]
  resources: ["guardedtrainingjobs/status"]
  verbs: ["get", "patch", "update"]
# Each PyTorchJob's owner reference to its job sets blockOwnerDeletion; clusters running the
# OwnerReferencesPermissionEnforcement admission plugin require update on the owner's finalizers for that.
- apiGroups: ["trainguard.dev"]
  resources: ["guardedtrainingjobs/finalizers"]
  verbs: ["update"]
# One Kubeflow PyTorchJob per attempt: created from the job's template, listed by the job's label,
# deleted (foreground) when the gang restarts.
- apiGroups: ["kubeflow.org"]
  resources: ["pytorchjobs"]
  verbs: ["get", "list", "watch", "create", "delete", "patch"]
# Or one Kubeflow Trainer v2 TrainJob per attempt (spec.backend TrainJob): created on trainguard's
# runtime, listed and watched by the job's label (also to learn whether the cluster has Trainer),
# deleted (foreground) when the gang restarts. The JobSets under them are not read: their pods are.
- apiGroups: ["trainer.kubeflow.org"]
  resources: ["trainjobs"]
  verbs: ["list", "watch", "create", "delete"]
# The workers' pods: phase, container exit codes, and the IPs of the sidecars the operator polls; and
# the pods of a broken gang, stopped with a short grace before a restart.
- apiGroups: [""]
  resources: ["pods"]
  verbs: ["get", "list", "watch", "delete"]
# Events on GuardedTrainingJobs (restarts, give-ups, refused spec changes), posted by kopf through the
# core API...
- apiGroups: [""]
  resources: ["events"]
  verbs: ["create", "patch"]
# ...and through events.k8s.io.
- apiGroups: ["events.k8s.io"]
  resources: ["events"]
  verbs: ["create", "patch"]
{{- if and (include "trainguard.peering" .) (not (include "trainguard.clusterwide" .)) }}
# kopf peering (more than one replica): each replica keeps its liveness and priority in the
# namespace's KopfPeering; only the highest-priority live replica handles jobs.
- apiGroups: ["kopf.dev"]
  resources: ["kopfpeerings"]
  verbs: ["get", "list", "watch", "patch"]
{{- end }}
{{- end -}}

{{/* Rules on cluster-scoped resources: always in a ClusterRole. */}}
{{- define "trainguard.rbac.clusterRules" -}}
# kopf checks which CRDs exist (its own and the watched ones); the operator reports a missing
# backend CRD (PyTorchJob, TrainJob) on the job instead of failing blindly.
- apiGroups: ["apiextensions.k8s.io"]
  resources: ["customresourcedefinitions"]
  verbs: ["get", "list", "watch"]
{{- if include "trainguard.clusterwide" . }}
# Cluster-wide kopf follows namespaces as they come and go.
- apiGroups: [""]
  resources: ["namespaces"]
  verbs: ["get", "list", "watch"]
{{- if include "trainguard.peering" . }}
# kopf peering (more than one replica), cluster-wide: the ClusterKopfPeering object.
- apiGroups: ["kopf.dev"]
  resources: ["clusterkopfpeerings"]
  verbs: ["get", "list", "watch", "patch"]
{{- end }}
{{- end }}
{{- end -}}
