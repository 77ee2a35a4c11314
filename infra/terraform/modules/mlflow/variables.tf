variable "namespace" {
  description = "Namespace for MLflow and its Postgres."
  type        = string
}

variable "chart_version" {
  description = "Version of the community-charts mlflow chart."
  type        = string
  default     = "1.12.0"
}

variable "bucket" {
  description = "Bucket for MLflow's artifacts."
  type        = string
}

variable "artifact_prefix" {
  description = "Key prefix of the artifacts in the bucket."
  type        = string
  default     = "mlflow"
}

variable "aws_region" {
  description = "Region name for MLflow's S3 client."
  type        = string
}

variable "s3_endpoint_url" {
  description = "S3 endpoint (MinIO); null for AWS S3."
  type        = string
  default     = null
}

variable "s3_static_credentials" {
  description = "Whether s3_access_key_id / s3_secret_access_key are given (false: the pod's service account carries a workload identity)."
  type        = bool
}

variable "s3_access_key_id" {
  description = "Access key id for the bucket; null with s3_static_credentials = false."
  type        = string
  default     = null
  sensitive   = true
}

variable "s3_secret_access_key" {
  description = "Secret access key for the bucket; null with s3_static_credentials = false."
  type        = string
  default     = null
  sensitive   = true
}

variable "auth_enabled" {
  description = "Turn on MLflow's basic-auth app with a generated admin password."
  type        = bool
  default     = true
}

variable "admin_username" {
  description = "User name of MLflow's admin."
  type        = string
  default     = "kfrl"
}

variable "allowed_hosts" {
  description = "Extra Host header values MLflow accepts, besides the in-cluster service names and localhost."
  type        = list(string)
  default     = []
}

variable "service_account_annotations" {
  description = "Annotations of MLflow's service account (workload identity)."
  type        = map(string)
  default     = {}
}

variable "external_database_url" {
  description = "postgresql://USER:PASSWORD@HOST[:PORT]/DATABASE[?sslmode=...] of an existing Postgres; null = deploy one (Bitnami chart)."
  type        = string
  default     = null
  sensitive   = true
}

variable "auth_database" {
  description = "Database of the auth app on the same server."
  type        = string
  default     = "mlflow_auth"
}

variable "postgres_chart_version" {
  description = "Version of the Bitnami postgresql chart."
  type        = string
  default     = "16.7.27"
}

variable "postgres_image" {
  description = "Image of the bundled Postgres."
  type = object({
    registry   = string
    repository = string
    tag        = string
  })
}

variable "postgres_storage_size" {
  description = "Size of the bundled Postgres's volume."
  type        = string
  default     = "20Gi"
}

variable "storage_class" {
  description = "Storage class of the bundled Postgres's volume; \"\" = the cluster's default."
  type        = string
  default     = ""
}
