{{/*
How the official Apache Airflow Helm chart names the service accounts of the components that talk to the
Kubernetes API for this pipeline: verbatim from apache/airflow chart/templates/_helpers.yaml at commit
002843d6fe7e8c699af0b8f8f2f0efe0da178e9f (Apache License 2.0). Not used by Helm from here: tests/unit/k8s/test_airflow_rbac.py
evaluates these rules with k8s/airflow/values.yaml and the install command's release name, and checks that
k8s/base/rbac.yaml binds every resulting account. Update it from the chart version you install.
*/}}
{{- define "airflow.fullname" -}}
  {{- if .Values.fullnameOverride }}
    {{- .Values.fullnameOverride | trunc 63 | trimSuffix "-" }}
  {{- else }}
    {{- $name := default .Chart.Name .Values.nameOverride }}
    {{- if contains $name .Release.Name }}
      {{- .Release.Name | trunc 63 | trimSuffix "-" }}
    {{- else }}
      {{- printf "%s-%s" .Release.Name $name | trunc 63 | trimSuffix "-" }}
    {{- end }}
  {{- end }}
{{- end }}

{{/* Create the name of the worker service account to use */}}
{{- define "worker.serviceAccountName" -}}
  {{- if .Values.workers.serviceAccount.create }}
    {{- default (printf "%s-worker" (include "airflow.fullname" .)) .Values.workers.serviceAccount.name }}
  {{- else }}
    {{- default "default" .Values.workers.serviceAccount.name }}
  {{- end }}
{{- end }}

{{/* Create the name of the triggerer service account to use */}}
{{- define "triggerer.serviceAccountName" -}}
  {{- if .Values.triggerer.serviceAccount.create }}
    {{- default (printf "%s-triggerer" (include "airflow.fullname" .)) .Values.triggerer.serviceAccount.name }}
  {{- else }}
    {{- default "default" .Values.triggerer.serviceAccount.name }}
  {{- end }}
{{- end }}
