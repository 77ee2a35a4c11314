output "tracking_uri" {
  description = "MLflow's in-cluster URL."
  value       = local.tracking_uri
}

output "artifact_root" {
  description = "Where MLflow keeps artifacts."
  value       = "s3://${var.bucket}/${trim(var.artifact_prefix, "/")}"
}

output "tracking_username" {
  description = "The admin's user name; null without auth."
  value       = var.auth_enabled ? var.admin_username : null
}

output "tracking_password" {
  description = "The admin's password; null without auth."
  value       = one(random_password.admin[*].result)
  sensitive   = true
}

output "release" {
  description = "Name of the MLflow Helm release (and of its service)."
  value       = helm_release.mlflow.name
}
