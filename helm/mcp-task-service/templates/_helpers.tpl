{{/* Names, labels, the image reference, and the checks that refuse values that cannot work. */}}

{{- define "mcp-tasks.name" -}}
{{- default .Chart.Name .Values.nameOverride | trunc 63 | trimSuffix "-" -}}
{{- end -}}

{{- define "mcp-tasks.fullname" -}}
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

{{- define "mcp-tasks.selectorLabels" -}}
app.kubernetes.io/name: {{ include "mcp-tasks.name" . }}
app.kubernetes.io/instance: {{ .Release.Name }}
{{- end -}}

{{- define "mcp-tasks.labels" -}}
helm.sh/chart: {{ printf "%s-%s" .Chart.Name .Chart.Version | replace "+" "_" | trunc 63 | trimSuffix "-" }}
{{ include "mcp-tasks.selectorLabels" . }}
app.kubernetes.io/version: {{ .Chart.AppVersion | quote }}
app.kubernetes.io/managed-by: {{ .Release.Service }}
app.kubernetes.io/part-of: mcp-task-service
{{- with .Values.commonLabels }}
{{ toYaml . }}
{{- end }}
{{- end -}}

{{- define "mcp-tasks.serviceAccountName" -}}
{{- if .Values.serviceAccount.create -}}
{{- default (include "mcp-tasks.fullname" .) .Values.serviceAccount.name -}}
{{- else -}}
{{- default "default" .Values.serviceAccount.name -}}
{{- end -}}
{{- end -}}

{{- define "mcp-tasks.image" -}}
{{- if .Values.image.digest -}}
{{- printf "%s@%s" .Values.image.repository .Values.image.digest -}}
{{- else -}}
{{- printf "%s:%s" .Values.image.repository (default .Chart.AppVersion .Values.image.tag) -}}
{{- end -}}
{{- end -}}

{{- define "mcp-tasks.secretName" -}}
{{- default (include "mcp-tasks.fullname" .) .Values.secrets.existingSecret -}}
{{- end -}}

{{/* A setting as the string the environment carries; whole numbers stay whole (YAML numbers arrive as floats). */}}
{{- define "mcp-tasks.envValue" -}}
{{- if kindIs "float64" . -}}
{{- if eq (float64 (int64 .)) . -}}{{ int64 . }}{{- else -}}{{ . }}{{- end -}}
{{- else -}}
{{- toString . -}}
{{- end -}}
{{- end -}}

{{/* Refuse, at template time, values that cannot work, and say what to set. */}}
{{- define "mcp-tasks.validate" -}}
{{- $c := .Values.config -}}
{{- if and (not .Values.secrets.existingSecret) (not .Values.secrets.databaseUrl) -}}
{{- fail "no database: set secrets.databaseUrl (postgresql://mcp_tasks:…@host/db) or secrets.existingSecret (a Secret with the key secrets.keys.databaseUrl)" -}}
{{- end -}}
{{- $auth := $c.auth | default (ternary "oauth" "none" (not (empty $c.oauth_issuer))) -}}
{{- if eq $auth "none" -}}
{{- if not (has (toString $c.host) (list "127.0.0.1" "::1" "localhost")) -}}
{{- fail (printf "auth none (no config.oauth_issuer) is single-user mode and binds loopback only, not config.host=%s: set config.oauth_issuer to your identity provider for hosted mode" (toString $c.host)) -}}
{{- end -}}
{{- if or (gt (int .Values.serve.replicas) 1) .Values.serve.autoscaling.enabled .Values.worker.enabled -}}
{{- fail "auth none (no config.oauth_issuer) is single-user mode, one process: set config.oauth_issuer, or serve.replicas=1 with serve.autoscaling.enabled=false and worker.enabled=false" -}}
{{- end -}}
{{- end -}}
{{- if and (eq $auth "oauth") (empty $c.oauth_issuer) -}}
{{- fail "config.auth=oauth needs config.oauth_issuer (your identity provider's issuer URL)" -}}
{{- end -}}
{{- if and .Values.worker.enabled (lt (int .Values.worker.runnerConcurrency) 1) -}}
{{- fail "worker.runnerConcurrency must be at least 1 (a worker with no slots runs nothing); set worker.enabled=false to run tasks in serve only" -}}
{{- end -}}
{{- if and .Values.networkPolicy.enabled (empty $c.metrics_port) -}}
{{- fail "networkPolicy.enabled keeps /metrics to the monitoring namespace by port: set config.metrics_port (e.g. 9100)" -}}
{{- end -}}
{{- if and .Values.upstreams.file .Values.upstreams.existingConfigMap -}}
{{- fail "give the upstreams as upstreams.file or upstreams.existingConfigMap, not both" -}}
{{- end -}}
{{- if and (or .Values.upstreams.file .Values.upstreams.existingConfigMap) $c.upstreams_file -}}
{{- fail "upstreams.file / upstreams.existingConfigMap set MCP_TASKS_UPSTREAMS_FILE: leave config.upstreams_file null" -}}
{{- end -}}
{{- if and .Values.metrics.serviceMonitor.enabled (empty $c.metrics_port) -}}
{{- fail "metrics.serviceMonitor.enabled scrapes the metrics port: set config.metrics_port (e.g. 9100)" -}}
{{- end -}}
{{- end -}}

{{/* Environment shared by serve and worker: settings from the ConfigMap, secrets by key. */}}
{{- define "mcp-tasks.env" -}}
- name: MCP_TASKS_DATABASE_URL
  valueFrom:
    secretKeyRef: {name: {{ include "mcp-tasks.secretName" . }}, key: {{ .Values.secrets.keys.databaseUrl }}}
- name: MCP_TASKS_OAUTH_CLIENT_SECRET
  valueFrom:
    secretKeyRef: {name: {{ include "mcp-tasks.secretName" . }}, key: {{ .Values.secrets.keys.oauthClientSecret }}, optional: true}
- name: MCP_TASKS_RATE_LIMIT_STORAGE
  valueFrom:
    secretKeyRef: {name: {{ include "mcp-tasks.secretName" . }}, key: {{ .Values.secrets.keys.rateLimitStorage }}, optional: true}
{{- if or .Values.upstreams.file .Values.upstreams.existingConfigMap }}
- name: MCP_TASKS_UPSTREAMS_FILE
  value: /etc/mcp-tasks/upstreams/upstreams.toml
{{- end }}
{{- range $name, $ref := .Values.upstreams.secretEnv }}
- name: {{ $name }}
  valueFrom:
    secretKeyRef: {name: {{ $ref.secret }}, key: {{ $ref.key }}}
{{- end }}
{{- end -}}

{{/* The upstreams file and its secret files, mounted in serve and worker (volumeMounts, then volumes). */}}
{{- define "mcp-tasks.upstreamMounts" -}}
{{- if or .Values.upstreams.file .Values.upstreams.existingConfigMap }}
- {name: upstreams, mountPath: /etc/mcp-tasks/upstreams, readOnly: true}
{{- end }}
{{- range .Values.upstreams.secretFiles }}
- {name: {{ printf "upstream-secret-%s" . | trunc 63 | trimSuffix "-" }}, mountPath: /etc/mcp-tasks/secrets/{{ . }}, readOnly: true}
{{- end }}
{{- end -}}

{{- define "mcp-tasks.upstreamVolumes" -}}
{{- if or .Values.upstreams.file .Values.upstreams.existingConfigMap }}
- name: upstreams
  configMap: {name: {{ default (printf "%s-upstreams" (include "mcp-tasks.fullname" .)) .Values.upstreams.existingConfigMap }}}
{{- end }}
{{- range .Values.upstreams.secretFiles }}
- name: {{ printf "upstream-secret-%s" . | trunc 63 | trimSuffix "-" }}
  secret: {secretName: {{ . }}}
{{- end }}
{{- end -}}

{{- define "mcp-tasks.topologySpread" -}}
{{- $component := index . 1 -}}
{{- with index . 2 -}}
{{ toYaml . }}
{{- else -}}
{{- $ctx := index . 0 -}}
- maxSkew: 1
  topologyKey: topology.kubernetes.io/zone
  whenUnsatisfiable: ScheduleAnyway
  labelSelector:
    matchLabels:
      {{- include "mcp-tasks.selectorLabels" $ctx | nindent 6 }}
      app.kubernetes.io/component: {{ $component }}
- maxSkew: 1
  topologyKey: kubernetes.io/hostname
  whenUnsatisfiable: ScheduleAnyway
  labelSelector:
    matchLabels:
      {{- include "mcp-tasks.selectorLabels" $ctx | nindent 6 }}
      app.kubernetes.io/component: {{ $component }}
{{- end -}}
{{- end -}}
