{{/*
Shared names, labels, image references, Redis connection settings and the resolved worker
pools. Every template takes its names from here.
*/}}

{{- define "specd.name" -}}
{{- default .Chart.Name .Values.nameOverride | trunc 63 | trimSuffix "-" -}}
{{- end -}}

{{- define "specd.fullname" -}}
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

{{/* Labels of every object: (dict "root" $ ["component" "gateway"] ["pool" name]). */}}
{{- define "specd.labels" -}}
{{ include "specd.selectorLabels" . }}
helm.sh/chart: {{ printf "%s-%s" .root.Chart.Name .root.Chart.Version | replace "+" "_" }}
app.kubernetes.io/version: {{ .root.Chart.AppVersion | quote }}
app.kubernetes.io/managed-by: {{ .root.Release.Service }}
app.kubernetes.io/part-of: specd
{{- end -}}

{{/* Selector labels: the stable subset of specd.labels, same argument. */}}
{{- define "specd.selectorLabels" -}}
app.kubernetes.io/name: {{ include "specd.name" .root }}
app.kubernetes.io/instance: {{ .root.Release.Name }}
{{- if .component }}
app.kubernetes.io/component: {{ .component }}
{{- end }}
{{- if .pool }}
specd-pool: {{ .pool }}
{{- end }}
{{- end -}}

{{- define "specd.serviceAccountName" -}}
{{- if .Values.serviceAccount.create -}}
{{- default (include "specd.fullname" .) .Values.serviceAccount.name -}}
{{- else -}}
{{- default "default" .Values.serviceAccount.name -}}
{{- end -}}
{{- end -}}

{{/* Image reference: (dict "root" $ "image" {repository, tag}). */}}
{{- define "specd.image" -}}
{{- $tag := .image.tag | default .root.Values.image.tag | default .root.Chart.AppVersion -}}
{{- if .root.Values.image.registry -}}
{{- printf "%s/%s:%s" (trimSuffix "/" .root.Values.image.registry) .image.repository $tag -}}
{{- else -}}
{{- printf "%s:%s" .image.repository $tag -}}
{{- end -}}
{{- end -}}

{{/* ---- Redis: bundled StatefulSet or external ---- */}}

{{- define "specd.redis.host" -}}
{{- if .Values.redis.enabled -}}
{{- printf "%s-redis" (include "specd.fullname" .) -}}
{{- else if .Values.externalRedis.host -}}
{{- .Values.externalRedis.host -}}
{{- else -}}
{{- fail "Redis: set redis.enabled=true (bundled) or externalRedis.host" -}}
{{- end -}}
{{- end -}}

{{- define "specd.redis.port" -}}
{{- if .Values.redis.enabled }}6379{{ else }}{{ .Values.externalRedis.port }}{{ end -}}
{{- end -}}

{{- define "specd.redis.db" -}}
{{- if .Values.redis.enabled }}0{{ else }}{{ .Values.externalRedis.db }}{{ end -}}
{{- end -}}

{{/* Name of the Secret holding the Redis password; empty when Redis has none. */}}
{{- define "specd.redis.secretName" -}}
{{- if .Values.redis.enabled -}}
{{- .Values.redis.auth.existingSecret | default (printf "%s-redis" (include "specd.fullname" .)) -}}
{{- else -}}
{{- .Values.externalRedis.existingSecret -}}
{{- end -}}
{{- end -}}

{{- define "specd.redis.secretKey" -}}
{{- if .Values.redis.enabled -}}
{{- .Values.redis.auth.existingSecretKey -}}
{{- else -}}
{{- .Values.externalRedis.existingSecretKey -}}
{{- end -}}
{{- end -}}

{{/* Environment of every specd container: the Redis URL (password expanded by Kubernetes
from the Secret, $(VAR) syntax) and the key prefix. */}}
{{- define "specd.redisEnv" -}}
{{- $scheme := ternary "rediss" "redis" (and (not .Values.redis.enabled) .Values.externalRedis.tls) -}}
{{- $hostPort := printf "%s:%s/%s" (include "specd.redis.host" .) (include "specd.redis.port" .) (include "specd.redis.db" .) -}}
{{- if include "specd.redis.secretName" . }}
- name: REDIS_PASSWORD
  valueFrom:
    secretKeyRef:
      name: {{ include "specd.redis.secretName" . }}
      key: {{ include "specd.redis.secretKey" . }}
- name: SPECD_REDIS_URL
  value: {{ printf "%s://:$(REDIS_PASSWORD)@%s" $scheme $hostPort | quote }}
{{- else }}
- name: SPECD_REDIS_URL
  value: {{ printf "%s://%s" $scheme $hostPort | quote }}
{{- end }}
- name: SPECD_REDIS_PREFIX
  value: {{ .Values.prefix | quote }}
{{- end -}}

{{/* ---- Worker pools ----
The pools with workerDefaults filled in and these derived keys:
  device  --device of `specd worker` (cpu, cuda:0 for nvidia.com/*, hip:0 for amd.com/*)
  served  the model name clients send = worker/service.py served_name()
  queue   the RQ list KEDA watches: rq:queue:<prefix>:model:<served> (worker/protocol.py Keys)
  known   whether model is a known name (pulled by the init container) rather than a path
  args    the container's argv: specd worker ...
Use: range $pool := (include "specd.pools" . | fromYaml).pools */}}
{{- define "specd.pools" -}}
{{- $out := list -}}
{{- $seen := dict -}}
{{- $nested := list "keda" "startupProbe" "podDisruptionBudget" -}}
{{- range $p := .Values.pools -}}
{{- $pool := deepCopy $.Values.workerDefaults -}}
{{- range $k, $v := $p -}}
{{- if and (has $k $nested) (kindIs "map" $v) -}}
{{- $sub := deepCopy (index $.Values.workerDefaults $k) -}}
{{- range $k2, $v2 := $v }}{{ $_ := set $sub $k2 $v2 }}{{ end -}}
{{- $_ := set $pool $k $sub -}}
{{- else -}}
{{- $_ := set $pool $k $v -}}
{{- end -}}
{{- end -}}
{{- if hasKey $seen $pool.name -}}
{{- fail (printf "pools: the name %q is used twice" $pool.name) -}}
{{- end -}}
{{- $_ := set $seen $pool.name true -}}
{{- $device := $pool.device -}}
{{- if not $device -}}
{{- if not $pool.gpu -}}
{{- $device = "cpu" -}}
{{- else if hasPrefix "nvidia.com/" $pool.gpu -}}
{{- $device = "cuda:0" -}}
{{- else if hasPrefix "amd.com/" $pool.gpu -}}
{{- $device = "hip:0" -}}
{{- else -}}
{{- fail (printf "pool %s: gpu %q is neither nvidia.com/* nor amd.com/*; set device: cuda:0 or hip:0" $pool.name $pool.gpu) -}}
{{- end -}}
{{- end -}}
{{- $model := toString $pool.model -}}
{{- $known := not (or (contains "/" $model) (hasSuffix ".gguf" (lower $model))) -}}
{{- $served := $pool.servedName -}}
{{- if not $served -}}
{{- $served = ternary $model (regexReplaceAll "\\.[^.]*$" (base $model) "") $known -}}
{{- end -}}
{{- $args := list "specd" "worker" "--model" $model "--device" $device -}}
{{- if $pool.servedName }}{{ $args = concat $args (list "--name" $pool.servedName) }}{{ end -}}
{{- if $pool.threads }}{{ $args = concat $args (list "--threads" (toString (int $pool.threads))) }}{{ end -}}
{{- if $pool.ctxSize }}{{ $args = concat $args (list "--ctx-size" (toString (int $pool.ctxSize))) }}{{ end -}}
{{- $args = concat $args $pool.extraArgs -}}
{{- $_ := set $pool "device" $device -}}
{{- $_ := set $pool "served" $served -}}
{{- $_ := set $pool "queue" (printf "rq:queue:%s:model:%s" $.Values.prefix $served) -}}
{{- $_ := set $pool "known" $known -}}
{{- $_ := set $pool "args" $args -}}
{{- $out = append $out $pool -}}
{{- end -}}
{{- toYaml (dict "pools" $out) -}}
{{- end -}}
