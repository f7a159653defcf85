{{/*
The alerting rules, as the `groups` of a Prometheus rule file. alerts-prometheusrule.yaml wraps them in
a PrometheusRule; tests/test_alerts.py extracts them for `promtool check rules` and `promtool test rules`.
Every threshold and window comes from .Values.alerts. Label `job` is the GuardedTrainingJob's name and
`namespace` its namespace on every trainguard_* series (the monitors set honorLabels).
*/}}
{{- define "trainguard.alertGroups" -}}
{{- $a := .Values.alerts -}}
{{- $runbook := $a.runbookBaseUrl -}}
- name: trainguard.rules
  rules:
  {{- with $a.rollbackRate }}
  {{- if .enabled }}
  # Every rank of a job rolls back together, so the job's count is the largest of its ranks'.
  - alert: TrainguardRollbackRateHigh
    expr: |-
      max by (namespace, job) (increase(trainguard_worker_rollbacks_total[{{ .window }}])) >= {{ .threshold }}
    for: {{ .for }}
    labels:
      severity: {{ .severity }}
      {{- with $a.labels }}
      {{- toYaml . | nindent 6 }}
      {{- end }}
    annotations:
      summary: {{ `GuardedTrainingJob {{ $labels.namespace }}/{{ $labels.job }} keeps rolling back` | quote }}
      description: {{ printf "Job {{ $labels.job }} in namespace {{ $labels.namespace }} rolled back at least %v times in the last %s. Its training diverges: non-finite losses or gradients, or loss spikes, several steps in a row." .threshold .window | quote }}
      runbook_url: {{ printf "%s#trainguardrollbackratehigh" $runbook | quote }}
  {{- end }}
  {{- end }}
  {{- with $a.batchDropRate }}
  {{- if .enabled }}
  # Dropped over seen samples, summed over the ranks (each rank reads its own shard).
  - alert: TrainguardBatchDropRateHigh
    expr: |-
      (
        sum by (namespace, job) (rate(trainguard_worker_dropped_samples_total[{{ .window }}]))
      /
        sum by (namespace, job) (rate(trainguard_worker_samples_total[{{ .window }}]))
      ) > {{ .threshold }}
    for: {{ .for }}
    labels:
      severity: {{ .severity }}
      {{- with $a.labels }}
      {{- toYaml . | nindent 6 }}
      {{- end }}
    annotations:
      summary: {{ `GuardedTrainingJob {{ $labels.namespace }}/{{ $labels.job }} drops too many samples` | quote }}
      description: {{ printf "Job {{ $labels.job }} in namespace {{ $labels.namespace }} dropped {{ $value | humanizePercentage }} of its training samples over the last %s (alert threshold: %v %%; normal is below 0.01 %%). The data guard drops empty samples and samples holding NaN or Inf." .window (mulf .threshold 100) | quote }}
      runbook_url: {{ printf "%s#trainguardbatchdropratehigh" $runbook | quote }}
  {{- end }}
  {{- end }}
  {{- with $a.jobHung }}
  {{- if .enabled }}
  {{- $seconds := int .afterSeconds }}
  # Either the operator reports the job active (Running or Restarting) now and a window ago, and no
  # worker completed a step in between (hung ranks, crash loops, pods that never start), or a worker's
  # sidecar is up and its worker has not stepped for that long.
  - alert: TrainguardJobHung
    expr: |-
      (
          (max by (namespace, job) (trainguard_job_phase{phase=~"Running|Restarting"}) == 1)
        and on (namespace, job)
          (max by (namespace, job) (trainguard_job_phase{phase=~"Running|Restarting"} offset {{ $seconds }}s) == 1)
        unless on (namespace, job)
          (sum by (namespace, job) (increase(trainguard_worker_steps_total[{{ $seconds }}s])) > 0)
      )
      or
        (max by (namespace, job) (trainguard_worker_seconds_since_last_step) > {{ $seconds }})
    for: {{ .for }}
    labels:
      severity: {{ .severity }}
      {{- with $a.labels }}
      {{- toYaml . | nindent 6 }}
      {{- end }}
    annotations:
      summary: {{ `GuardedTrainingJob {{ $labels.namespace }}/{{ $labels.job }} makes no progress` | quote }}
      description: {{ printf "Job {{ $labels.job }} in namespace {{ $labels.namespace }} has completed no training step for more than %d s although it should be running: a rank is hung, the gang keeps crashing before its first step, or its pods cannot start." $seconds | quote }}
      runbook_url: {{ printf "%s#trainguardjobhung" $runbook | quote }}
  {{- end }}
  {{- end }}
  {{- with $a.restartsExhausted }}
  {{- if .enabled }}
  # The operator gave up: the job is Failed (its restarts are used up, or a worker failed permanently).
  - alert: TrainguardRestartsExhausted
    expr: |-
      max by (namespace, job) (trainguard_job_phase{phase="Failed"}) == 1
    for: {{ .for }}
    labels:
      severity: {{ .severity }}
      {{- with $a.labels }}
      {{- toYaml . | nindent 6 }}
      {{- end }}
    annotations:
      summary: {{ `GuardedTrainingJob {{ $labels.namespace }}/{{ $labels.job }} failed: trainguard gave up` | quote }}
      description: {{ `Job {{ $labels.job }} in namespace {{ $labels.namespace }} is Failed: the operator used up recovery.maxRestarts gang restarts, or a worker exited with a permanent error. Nothing restarts it any more; its newest clean checkpoint is kept.` | quote }}
      runbook_url: {{ printf "%s#trainguardrestartsexhausted" $runbook | quote }}
  {{- end }}
  {{- end }}
  {{- with $a.checkpointStale }}
  {{- if .enabled }}
  {{- $seconds := int .maxAgeSeconds }}
  # Either the newest clean checkpoint is older than the limit, or the job has been stepping for that
  # long without any clean checkpoint.
  - alert: TrainguardCheckpointStale
    expr: |-
      (
        time() - max by (namespace, job) (trainguard_worker_last_clean_checkpoint_timestamp_seconds)
      ) > {{ $seconds }}
      or
      (
          max by (namespace, job) (trainguard_worker_step offset {{ $seconds }}s)
        and on (namespace, job)
          max by (namespace, job) (trainguard_worker_step)
        unless on (namespace, job)
          max by (namespace, job) (trainguard_worker_last_clean_checkpoint_timestamp_seconds)
      )
    for: {{ .for }}
    labels:
      severity: {{ .severity }}
      {{- with $a.labels }}
      {{- toYaml . | nindent 6 }}
      {{- end }}
    annotations:
      summary: {{ `GuardedTrainingJob {{ $labels.namespace }}/{{ $labels.job }} has no recent clean checkpoint` | quote }}
      description: {{ printf "Job {{ $labels.job }} in namespace {{ $labels.namespace }} has written no clean checkpoint for more than %d s. A crash now loses that much training." $seconds | quote }}
      runbook_url: {{ printf "%s#trainguardcheckpointstale" $runbook | quote }}
  {{- end }}
  {{- end }}
  {{- with $a.straggler }}
  {{- if .enabled }}
  # The operator scores each rank's own compute per step against the other ranks' median (the gang view
  # the job's health.straggler acts on); one series a rank.
  - alert: TrainguardStragglerRank
    expr: |-
      max by (namespace, job, rank) (trainguard_worker_straggler_score) > {{ .threshold }}
    for: {{ .for }}
    labels:
      severity: {{ .severity }}
      {{- with $a.labels }}
      {{- toYaml . | nindent 6 }}
      {{- end }}
    annotations:
      summary: {{ `GuardedTrainingJob {{ $labels.namespace }}/{{ $labels.job }} has a straggler: rank {{ $labels.rank }}` | quote }}
      description: {{ printf "Rank {{ $labels.rank }} of job {{ $labels.job }} in namespace {{ $labels.namespace }} computes each step {{ $value | printf \"%%.2f\" }} times as long as the other ranks' median (alert threshold: %v, held for %s). The whole gang steps at its pace; status.straggler and the StragglerDetected Event name its pod and node." .threshold .for | quote }}
      runbook_url: {{ printf "%s#trainguardstragglerrank" $runbook | quote }}
  {{- end }}
  {{- end }}
{{- end -}}
