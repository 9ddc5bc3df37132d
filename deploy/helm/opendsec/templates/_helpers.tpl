{{/* SPDX-License-Identifier: AGPL-3.0-only */}}

{{/* The chart name, or nameOverride. */}}
{{- define "opendsec.name" -}}
{{- default .Chart.Name .Values.nameOverride | trunc 40 | trimSuffix "-" -}}
{{- end -}}

{{/* The prefix of every object name. Short enough for "<prefix>-iam-4" as a DNS label. */}}
{{- define "opendsec.fullname" -}}
{{- if .Values.fullnameOverride -}}
{{- .Values.fullnameOverride | trunc 40 | trimSuffix "-" -}}
{{- else -}}
{{- $name := default .Chart.Name .Values.nameOverride -}}
{{- if contains $name .Release.Name -}}
{{- .Release.Name | trunc 40 | trimSuffix "-" -}}
{{- else -}}
{{- printf "%s-%s" .Release.Name $name | trunc 40 | trimSuffix "-" -}}
{{- end -}}
{{- end -}}
{{- end -}}

{{- define "opendsec.chart" -}}
{{- printf "%s-%s" .Chart.Name .Chart.Version | replace "+" "_" | trunc 63 | trimSuffix "-" -}}
{{- end -}}

{{/* Selector labels of a component: (dict "ctx" $ "component" "iam"). */}}
{{- define "opendsec.selectorLabels" -}}
app.kubernetes.io/name: {{ include "opendsec.name" .ctx }}
app.kubernetes.io/instance: {{ .ctx.Release.Name }}
app.kubernetes.io/component: {{ .component }}
{{- end -}}

{{/* Every label of a component's objects: (dict "ctx" $ "component" "iam"). */}}
{{- define "opendsec.labels" -}}
{{ include "opendsec.selectorLabels" . }}
app.kubernetes.io/part-of: opendsec
app.kubernetes.io/version: {{ .ctx.Chart.AppVersion | quote }}
app.kubernetes.io/managed-by: {{ .ctx.Release.Service }}
helm.sh/chart: {{ include "opendsec.chart" .ctx }}
{{- with .ctx.Values.commonLabels }}
{{ toYaml . }}
{{- end }}
{{- end -}}

{{- define "opendsec.image" -}}
{{- printf "%s:%s" .Values.image.repository (default .Chart.AppVersion .Values.image.tag) -}}
{{- end -}}

{{/* "<prefix>-<component>": the name of a component's objects. */}}
{{- define "opendsec.componentName" -}}
{{- printf "%s-%s" (include "opendsec.fullname" .ctx) .component -}}
{{- end -}}

{{/* The DNS suffix of the release namespace's services: "<ns>.svc.<domain>". */}}
{{- define "opendsec.svcDomain" -}}
{{- printf "%s.svc.%s" .Release.Namespace .Values.clusterDomain -}}
{{- end -}}

{{/* An IAM replica's stable DNS name (through the headless service); . = (dict "ctx" $ "ordinal" 0). */}}
{{- define "opendsec.iamHost" -}}
{{- $iam := include "opendsec.componentName" (dict "ctx" .ctx "component" "iam") -}}
{{- printf "%s-%d.%s.%s" $iam (int .ordinal) $iam (include "opendsec.svcDomain" .ctx) -}}
{{- end -}}

{{/* The TOML array of every IAM replica's cluster listener. */}}
{{- define "opendsec.iamPeers" -}}
{{- $ctx := . -}}
{{- $peers := list -}}
{{- range $i := until (int .Values.iam.replicas) -}}
{{- $peers = append $peers (printf "%q" (printf "%s:%d" (include "opendsec.iamHost" (dict "ctx" $ctx "ordinal" $i)) (int $ctx.Values.clusterPort))) -}}
{{- end -}}
[{{ join ", " $peers }}]
{{- end -}}

{{/* The watcher's service address, host:port. */}}
{{- define "opendsec.watcherAddr" -}}
{{- printf "%s.%s:%d" (include "opendsec.componentName" (dict "ctx" . "component" "watcher")) (include "opendsec.svcDomain" .) (int .Values.clusterPort) -}}
{{- end -}}

{{/* The [cluster.edges] table: every edge's name and cluster listener. */}}
{{- define "opendsec.edgesTable" -}}
[cluster.edges]
{{- range .Values.edge.nodes }}
{{ .name }} = {{ printf "%s:%d" (include "opendsec.hostPort" .address) (int $.Values.clusterPort) | quote }}
{{- end }}
{{- end -}}

{{/* An address as it goes before ":port" (an IPv6 address in brackets). */}}
{{- define "opendsec.hostPort" -}}
{{- if contains ":" . -}}[{{ . }}]{{- else -}}{{ . }}{{- end -}}
{{- end -}}

{{/* The Secret holding a component's certificate: (dict "ctx" $ "role" "iam" "name" "iam1"). */}}
{{- define "opendsec.tlsSecret" -}}
{{- printf "%s-tls-%s-%s" (include "opendsec.fullname" .ctx) .role .name -}}
{{- end -}}

{{/* The Secret holding the cluster CA. */}}
{{- define "opendsec.caSecret" -}}
{{- printf "%s-ca" (include "opendsec.fullname" .) -}}
{{- end -}}

{{/* A [tls] table for the certificate mounted in dir. */}}
{{- define "opendsec.tlsTable" -}}
[tls]
ca = "{{ . }}/ca.crt"
cert = "{{ . }}/tls.crt"
key = "{{ . }}/tls.key"
{{- end -}}

{{/* The DNS names of a Service in the release namespace, shortest first. */}}
{{- define "opendsec.serviceHosts" -}}
{{- $svc := include "opendsec.componentName" . -}}
{{- $ns := .ctx.Release.Namespace -}}
{{- list $svc (printf "%s.%s" $svc $ns) (printf "%s.%s.svc" $svc $ns) (printf "%s.%s.svc.%s" $svc $ns .ctx.Values.clusterDomain) | toJson -}}
{{- end -}}

{{/*
Every component's certificate: {items: [{role, name, hosts, ips}]}, where hosts are DNS
names and ips addresses others reach it by. The Job and the cert-manager Certificates are
both made from this list.
*/}}
{{- define "opendsec.components" -}}
{{- $ctx := . -}}
{{- $items := list -}}
{{- $iam := include "opendsec.componentName" (dict "ctx" $ctx "component" "iam") -}}
{{- range $i := until (int .Values.iam.replicas) -}}
{{- $pod := printf "%s-%d.%s" $iam $i $iam -}}
{{- $hosts := list $pod (printf "%s.%s" $pod $ctx.Release.Namespace) (printf "%s.%s.svc" $pod $ctx.Release.Namespace) (include "opendsec.iamHost" (dict "ctx" $ctx "ordinal" $i)) -}}
{{- $items = append $items (dict "role" "iam" "name" (printf "iam%d" (add1 $i)) "hosts" $hosts "ips" (list)) -}}
{{- end -}}
{{- $items = append $items (dict "role" "apiserver" "name" .Values.apiserver.name "hosts" (include "opendsec.serviceHosts" (dict "ctx" $ctx "component" "apiserver") | fromJsonArray) "ips" (list)) -}}
{{- $items = append $items (dict "role" "watcher" "name" "watcher" "hosts" (include "opendsec.serviceHosts" (dict "ctx" $ctx "component" "watcher") | fromJsonArray) "ips" (list)) -}}
{{- range .Values.edge.nodes -}}
{{- $hosts := list .node -}}
{{- $ips := list -}}
{{- if regexMatch "^[0-9.]+$|:" .address -}}
{{- $ips = append $ips .address -}}
{{- else if ne .address .node -}}
{{- $hosts = append $hosts .address -}}
{{- end -}}
{{- $items = append $items (dict "role" "edge" "name" .name "hosts" $hosts "ips" $ips) -}}
{{- end -}}
{{- toYaml (dict "items" $items) -}}
{{- end -}}

{{/* Fails the render on values dsec would refuse at start. */}}
{{- define "opendsec.validate" -}}
{{- if not (has (int .Values.iam.replicas) (list 3 5)) -}}
{{- fail (printf "iam.replicas must be 3 or 5 (Raft replicas), not %v" .Values.iam.replicas) -}}
{{- end -}}
{{- if not .Values.edge.nodes -}}
{{- fail "edge.nodes must list at least one node (the apiservers and the watcher are configured with the edges)" -}}
{{- end -}}
{{- $names := dict -}}
{{- $nodes := dict -}}
{{- range .Values.edge.nodes -}}
{{- if not (regexMatch "^[a-z][a-z0-9]{0,31}$" (toString .name)) -}}
{{- fail (printf "edge.nodes: name %q must be 1-32 of [a-z0-9], starting with a letter (it is part of sandbox ids)" (toString .name)) -}}
{{- end -}}
{{- if or (not .node) (not .address) -}}
{{- fail (printf "edge.nodes: %s needs node (the Kubernetes node) and address (how other pods reach it)" .name) -}}
{{- end -}}
{{- if hasKey $names .name -}}
{{- fail (printf "edge.nodes: the name %s is used twice" .name) -}}
{{- end -}}
{{- if hasKey $nodes .node -}}
{{- fail (printf "edge.nodes: the node %s is listed twice (one edge per node)" .node) -}}
{{- end -}}
{{- $_ := set $names .name true -}}
{{- $_ := set $nodes .node true -}}
{{- end -}}
{{- if not (has .Values.certificates.mode (list "job" "certManager")) -}}
{{- fail (printf "certificates.mode must be job or certManager, not %q" .Values.certificates.mode) -}}
{{- end -}}
{{- if and (eq .Values.edge.imageStore.type "pvc") (not .Values.edge.imageStore.claimName) -}}
{{- fail "edge.imageStore.claimName must name a ReadWriteMany claim when edge.imageStore.type is pvc" -}}
{{- end -}}
{{- if not (has .Values.edge.imageStore.type (list "hostPath" "pvc")) -}}
{{- fail (printf "edge.imageStore.type must be hostPath or pvc, not %q" .Values.edge.imageStore.type) -}}
{{- end -}}
{{- end -}}

{{/* The pod-level settings of the components that need no host access. */}}
{{- define "opendsec.podSecurity" -}}
runAsNonRoot: true
runAsUser: 65532
runAsGroup: 65532
fsGroup: 65532
seccompProfile:
  type: RuntimeDefault
{{- end -}}

{{- define "opendsec.containerSecurity" -}}
allowPrivilegeEscalation: false
readOnlyRootFilesystem: true
capabilities:
  drop: ["ALL"]
{{- end -}}

{{/*
TOML. Helm's toToml writes every number of the values as a float (4096.0, 2e+07), which
dsec's integer keys refuse: these write whole numbers as integers.
*/}}
{{- define "opendsec.toml.key" -}}
{{- if regexMatch "^[A-Za-z0-9_-]+$" . -}}{{ . }}{{- else -}}{{ toJson . }}{{- end -}}
{{- end -}}

{{- define "opendsec.toml.value" -}}
{{- if kindIs "string" . -}}
{{ toJson . }}
{{- else if kindIs "bool" . -}}
{{ ternary "true" "false" . }}
{{- else if or (kindIs "float64" .) (kindIs "float32" .) -}}
{{- if eq (floor .) (float64 .) -}}{{ printf "%d" (int64 .) }}{{- else -}}{{ printf "%v" . }}{{- end -}}
{{- else if kindIs "slice" . -}}
{{- $out := list -}}
{{- range . -}}{{- $out = append $out (include "opendsec.toml.value" .) -}}{{- end -}}
[{{ join ", " $out }}]
{{- else -}}
{{ printf "%v" . }}
{{- end -}}
{{- end -}}

{{/* A table and what it holds: (dict "path" "edge" "table" $map); arrays of tables as [[path.key]]. */}}
{{- define "opendsec.toml.table" -}}
{{- $path := .path -}}
{{- $t := .table -}}
[{{ $path }}]
{{- range $k := keys $t | sortAlpha }}
{{- $v := get $t $k }}
{{- if and (not (kindIs "map" $v)) (not (and (kindIs "slice" $v) $v (kindIs "map" (first $v)))) (not (kindIs "invalid" $v)) }}
{{ include "opendsec.toml.key" $k }} = {{ include "opendsec.toml.value" $v }}
{{- end }}
{{- end }}
{{- range $k := keys $t | sortAlpha }}
{{- $v := get $t $k }}
{{- if kindIs "map" $v }}

{{ include "opendsec.toml.table" (dict "path" (printf "%s.%s" $path (include "opendsec.toml.key" $k)) "table" $v) }}
{{- else if and (kindIs "slice" $v) $v (kindIs "map" (first $v)) }}
{{- range $v }}

{{ include "opendsec.toml.table" (dict "path" (printf "%s.%s" $path (include "opendsec.toml.key" $k)) "table" .) | replace (printf "[%s.%s]" $path (include "opendsec.toml.key" $k)) (printf "[[%s.%s]]" $path (include "opendsec.toml.key" $k)) }}
{{- end }}
{{- end }}
{{- end }}
{{- end -}}

{{/*
A ConfigMap's data from (dict "file name" "text"): each text as a literal block, with
blank lines left empty (no trailing spaces).
*/}}
{{- define "opendsec.configData" -}}
{{- range $file, $text := . }}
  {{ $file }}: |
{{- range splitList "\n" (trimSuffix "\n" $text) }}
{{ if . }}    {{ . }}{{ end }}
{{- end }}
{{- end }}
{{- end -}}
