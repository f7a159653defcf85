{{/*
The operator's pod template, shared by the Deployment (one replica, kopf standalone) and the
StatefulSet (several replicas, kopf peering). Restricted Pod Security profile: non-root, read-only
root filesystem, no privilege escalation, no capabilities, seccomp RuntimeDefault.
*/}}
{{- define "trainguard.operatorPodTemplate" -}}
{{- $op := .Values.operator -}}
metadata:
  labels:
    {{- include "trainguard.labels" . | nindent 4 }}
    app.kubernetes.io/component: operator
    {{- with $op.podLabels }}
    {{- toYaml . | nindent 4 }}
    {{- end }}
  annotations:
    kubectl.kubernetes.io/default-container: operator
    {{- with $op.podAnnotations }}
    {{- toYaml . | nindent 4 }}
    {{- end }}
spec:
  serviceAccountName: {{ include "trainguard.serviceAccountName" . }}
  automountServiceAccountToken: true
  {{- with $op.imagePullSecrets }}
  imagePullSecrets:
    {{- toYaml . | nindent 4 }}
  {{- end }}
  {{- with $op.priorityClassName }}
  priorityClassName: {{ . }}
  {{- end }}
  securityContext:
    runAsNonRoot: true
    runAsUser: {{ $op.runAsUser }}
    runAsGroup: {{ $op.runAsUser }}
    fsGroup: {{ $op.runAsUser }}
    seccompProfile:
      type: RuntimeDefault
  # kopf deletes its own peering entry on SIGTERM; give it time to finish a reconcile step first.
  terminationGracePeriodSeconds: 30
  containers:
    - name: operator
      image: {{ include "trainguard.image" (list $op.image .) | quote }}
      imagePullPolicy: {{ $op.image.pullPolicy }}
      command: ["python", "-m", "trainguard_operator"]
      args:
        {{- if include "trainguard.clusterwide" . }}
        - --all-namespaces
        {{- else }}
        {{- range include "trainguard.watchNamespaces" . | fromJsonArray }}
        - --namespace={{ . }}
        {{- end }}
        {{- end }}
        {{- if include "trainguard.peering" . }}
        - --peering={{ include "trainguard.peeringName" . }}
        # The replica's ordinal (0, 1, ...) as its kopf priority: replicas of equal priority would all
        # pause each other; with distinct ones the highest live replica works and the others stand by.
        - --priority=$(TRAINGUARD_PEERING_PRIORITY)
        {{- end }}
        - --liveness=http://0.0.0.0:{{ $op.healthPort }}/healthz
        {{- if $op.verbose }}
        - --verbose
        {{- end }}
      env:
        # kopf's identity in the peering object and its log lines: the pod's name.
        - name: POD_ID
          valueFrom:
            fieldRef:
              fieldPath: metadata.name
        {{- if include "trainguard.peering" . }}
        - name: TRAINGUARD_PEERING_PRIORITY
          valueFrom:
            fieldRef:
              fieldPath: metadata.labels['apps.kubernetes.io/pod-index']
        {{- end }}
        - name: TRAINGUARD_OPERATOR_METRICS_PORT
          value: {{ $op.metricsPort | quote }}
        - name: TRAINGUARD_OPERATOR_SIDECAR_IMAGE
          value: {{ include "trainguard.image" (list .Values.sidecar.image .) | quote }}
        - name: TRAINGUARD_OPERATOR_SIDECAR_IMAGE_PULL_POLICY
          value: {{ .Values.sidecar.image.pullPolicy | quote }}
        - name: TRAINGUARD_OPERATOR_SIDECAR_RESOURCES
          value: {{ toJson .Values.sidecar.resources | quote }}
        - name: TRAINGUARD_OPERATOR_IN_PLACE_RESTARTS
          value: {{ .Values.restartInPlace.maxPerPyTorchJob | quote }}
        - name: TRAINGUARD_OPERATOR_WARM_SPARES
          value: {{ .Values.restartInPlace.warmSpares | quote }}
        # The ClusterTrainingRuntime a job's TrainJobs name, and its probe period (trainJobRuntime).
        - name: TRAINGUARD_OPERATOR_TRAINJOB_RUNTIME
          value: {{ .Values.trainJobRuntime.name | quote }}
        - name: TRAINGUARD_OPERATOR_TRAINJOB_PROBE_PERIOD_SECONDS
          value: {{ .Values.trainJobRuntime.probePeriodSeconds | quote }}
        {{- if gt (int .Values.restartInPlace.maxPerPyTorchJob) 0 }}
        - name: TRAINGUARD_OPERATOR_ORDER_KEY
          valueFrom:
            secretKeyRef:
              name: {{ include "trainguard.orderKeySecret" . }}
              key: order-key
        {{- end }}
        # The root filesystem is read-only: no bytecode files; temporary files go to the /tmp volume.
        - name: PYTHONDONTWRITEBYTECODE
          value: "1"
        - name: PYTHONUNBUFFERED
          value: "1"
        - name: TMPDIR
          value: /tmp
      ports:
        - name: metrics
          containerPort: {{ $op.metricsPort }}
          protocol: TCP
        - name: health
          containerPort: {{ $op.healthPort }}
          protocol: TCP
      # kopf's liveness endpoint: it answers while the operator's event loop runs (also on a replica
      # that stands by under peering).
      livenessProbe:
        httpGet:
          path: /healthz
          port: health
        initialDelaySeconds: 10
        periodSeconds: 20
        timeoutSeconds: 5
        failureThreshold: 3
      resources:
        {{- toYaml $op.resources | nindent 8 }}
      securityContext:
        runAsNonRoot: true
        runAsUser: {{ $op.runAsUser }}
        runAsGroup: {{ $op.runAsUser }}
        allowPrivilegeEscalation: false
        readOnlyRootFilesystem: true
        privileged: false
        capabilities:
          drop: ["ALL"]
        seccompProfile:
          type: RuntimeDefault
      volumeMounts:
        - name: tmp
          mountPath: /tmp
  volumes:
    - name: tmp
      emptyDir:
        sizeLimit: 64Mi
  {{- with $op.nodeSelector }}
  nodeSelector:
    {{- toYaml . | nindent 4 }}
  {{- end }}
  {{- with $op.affinity }}
  affinity:
    {{- toYaml . | nindent 4 }}
  {{- end }}
  {{- with $op.tolerations }}
  tolerations:
    {{- toYaml . | nindent 4 }}
  {{- end }}
{{- end -}}
