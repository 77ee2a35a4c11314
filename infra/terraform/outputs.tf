output "store_uri" {
  description = "kfrl's store: `kfrl train --store <store_uri>` (store.uri)."
  value       = module.object_store.store_uri
}

output "tracking_uri" {
  description = "MLflow's in-cluster URL: `--tracking-uri` / tracking.uri, and MLFLOW_TRACKING_URI in the secret."
  value       = module.mlflow.tracking_uri
}

output "kfp_host" {
  description = "KFP API server's in-cluster URL: pipeline.host (with pipeline.runner=kfp)."
  value       = local.kfp_host
}

output "namespace" {
  description = "The namespace created (or used) for kfrl: the credentials secret, MLflow and its database, MinIO."
  value       = module.namespace.name
}

output "credentials_secret" {
  description = "Name of the secret holding AWS_* and MLFLOW_TRACKING_* for kfrl's pods (cluster.secret); it exists in every namespace of credentials_secret_namespaces."
  value       = module.namespace.secret_name
}

output "credentials_secret_namespaces" {
  description = "Namespaces holding the credentials secret: the kfrl namespace and, for standalone KFP, KFP's own."
  value       = concat([module.namespace.name], [for m in module.kfp_namespace_secret : m.name])
}

output "aws_endpoint_url" {
  description = "S3 endpoint for MinIO (AWS_ENDPOINT_URL); null on AWS S3."
  value       = module.object_store.endpoint_url
}

output "aws_region" {
  description = "AWS_DEFAULT_REGION for kfrl's clients."
  value       = module.object_store.region
}

output "bucket" {
  description = "The bucket holding the store and MLflow's artifacts."
  value       = module.object_store.bucket
}

output "mlflow_artifact_root" {
  description = "Where MLflow keeps artifacts: s3://<bucket>/<mlflow_artifact_prefix>."
  value       = module.mlflow.artifact_root
}

output "mlflow_tracking_username" {
  description = "MLflow admin user (MLFLOW_TRACKING_USERNAME); null with mlflow_auth_enabled = false."
  value       = module.mlflow.tracking_username
}

output "mlflow_tracking_password" {
  description = "MLflow admin password (MLFLOW_TRACKING_PASSWORD): `terraform output -raw mlflow_tracking_password`."
  value       = module.mlflow.tracking_password
  sensitive   = true
}

output "kfrl_args" {
  description = "The flags and config overrides for `kfrl train` driven from inside the cluster (a CI job or a pod in the namespace)."
  value = join(" ", [
    "--store ${module.object_store.store_uri}",
    "--tracking-uri ${module.mlflow.tracking_uri}",
    "pipeline.runner=kfp",
    "pipeline.host=${local.kfp_host}",
  ])
}
