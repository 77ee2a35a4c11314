output "name" {
  description = "The namespace's name (known once it exists, so dependents wait for it)."
  value       = var.create_namespace ? kubernetes_namespace_v1.this[0].metadata[0].name : var.name
}

output "secret_name" {
  description = "The credentials secret's name."
  value       = kubernetes_secret_v1.credentials.metadata[0].name
}
