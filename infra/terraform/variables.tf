# --- Cluster -------------------------------------------------------------------------------------

variable "kubeconfig_path" {
  description = "Kubeconfig of the existing cluster, used by the kubernetes, helm and kustomization providers. null = the providers' defaults (KUBECONFIG, in-cluster config)."
  type        = string
  default     = "~/.kube/config"
}

variable "kube_context" {
  description = "Kubeconfig context to use; null = the file's current context."
  type        = string
  default     = null
}

variable "namespace" {
  description = "Namespace for kfrl: its credentials secret, MLflow, its Postgres and (object_store = \"minio\") MinIO."
  type        = string
  default     = "kfrl"

  validation {
    condition     = can(regex("^[a-z0-9]([-a-z0-9]{0,61}[a-z0-9])?$", var.namespace))
    error_message = "namespace must be a DNS-1123 label (lower-case letters, digits and '-', at most 63 characters)."
  }
}

variable "create_namespace" {
  description = "Create the namespace (false: it exists already and is only used)."
  type        = bool
  default     = true
}

variable "labels" {
  description = "Extra labels for the namespace and the credentials secret."
  type        = map(string)
  default     = {}
}

variable "credentials_secret_name" {
  description = "Name of the Kubernetes secret holding the variables kfrl's pods read (AWS_*, MLFLOW_TRACKING_*)."
  type        = string
  default     = "kfrl-credentials"
}

# --- Object store --------------------------------------------------------------------------------

variable "object_store" {
  description = "Where the store lives: \"s3\" (an AWS S3 bucket, created here) or \"minio\" (MinIO in the cluster through its Helm chart, for on-prem)."
  type        = string
  default     = "s3"

  validation {
    condition     = contains(["s3", "minio"], var.object_store)
    error_message = "object_store must be \"s3\" or \"minio\"."
  }
}

variable "bucket_name" {
  description = "Bucket for kfrl's store (runs under store_prefix) and MLflow's artifacts (under mlflow_artifact_prefix). S3 bucket names are global: pick a unique one."
  type        = string

  validation {
    condition     = can(regex("^[a-z0-9][a-z0-9.-]{1,61}[a-z0-9]$", var.bucket_name))
    error_message = "bucket_name must be 3-63 characters of lower-case letters, digits, '.' and '-'."
  }
}

variable "store_prefix" {
  description = "Key prefix of kfrl's store inside the bucket: store_uri = s3://<bucket>/<store_prefix>."
  type        = string
  default     = "runs"
}

variable "mlflow_artifact_prefix" {
  description = "Key prefix of MLflow's artifacts inside the bucket (s3://<bucket>/<prefix>)."
  type        = string
  default     = "mlflow"
}

variable "aws_region" {
  description = "AWS region of the S3 bucket (and the AWS provider). With MinIO it is only the region name the clients send (MinIO's default is us-east-1)."
  type        = string
  default     = "us-east-1"
}

variable "create_iam_user" {
  description = "S3 only: create an IAM user limited to the bucket (and its KMS key) whose access key goes into the credentials secret. false = no static keys; give the pods a role through workload identity (IRSA, Pod Identity) yourself."
  type        = bool
  default     = true
}

variable "iam_user_name" {
  description = "S3 only: name of the IAM user (and, suffixed, of its group) that may use the bucket."
  type        = string
  default     = "kfrl-store"
}

variable "kms_key_arn" {
  description = "S3 only: ARN of a KMS key for the bucket's default encryption. \"\" = create a dedicated key with rotation."
  type        = string
  default     = ""
}

variable "s3_force_destroy" {
  description = "S3 only: let `terraform destroy` delete a bucket that still holds objects (every run and checkpoint). Leave false outside experiments."
  type        = bool
  default     = false
}

variable "s3_noncurrent_version_expiration_days" {
  description = "S3 only: days a replaced or deleted object version is kept (versioning is what lets a corrupted manifest be restored; see docs/operations.md)."
  type        = number
  default     = 30

  validation {
    condition     = var.s3_noncurrent_version_expiration_days >= 1
    error_message = "s3_noncurrent_version_expiration_days must be at least 1."
  }
}

variable "s3_access_log_bucket" {
  description = "S3 only: existing bucket that receives the store bucket's server access logs (prefix <bucket>/). \"\" = no access logging."
  type        = string
  default     = ""
}

variable "tags" {
  description = "Tags for the AWS resources."
  type        = map(string)
  default     = {}
}

variable "minio_chart_version" {
  description = "MinIO only: version of the minio chart from https://charts.min.io/."
  type        = string
  default     = "5.4.0"
}

variable "minio_storage_size" {
  description = "MinIO only: size of MinIO's persistent volume (checkpoints: 2 bytes per parameter per iteration, plus trainer states)."
  type        = string
  default     = "200Gi"
}

variable "minio_memory_request" {
  description = "MinIO only: memory request of the MinIO pod (the chart's default is 16Gi)."
  type        = string
  default     = "2Gi"
}

variable "storage_class" {
  description = "Storage class for MinIO's and Postgres's volumes; \"\" = the cluster's default."
  type        = string
  default     = ""
}

# --- MLflow --------------------------------------------------------------------------------------

variable "mlflow_chart_version" {
  description = "Version of the community-charts mlflow chart (https://community-charts.github.io/helm-charts)."
  type        = string
  default     = "1.12.0"
}

variable "mlflow_auth_enabled" {
  description = "Turn on MLflow's basic-auth app; the admin's user name and password go into the credentials secret as MLFLOW_TRACKING_USERNAME / _PASSWORD."
  type        = bool
  default     = true
}

variable "mlflow_admin_username" {
  description = "User name of MLflow's admin (the password is generated)."
  type        = string
  default     = "kfrl"
}

variable "mlflow_allowed_hosts" {
  description = "Extra Host header values MLflow's server accepts (an ingress host, say); the in-cluster service names and localhost are always allowed."
  type        = list(string)
  default     = []
}

variable "mlflow_service_account_annotations" {
  description = "Annotations of MLflow's service account, e.g. eks.amazonaws.com/role-arn when create_iam_user = false."
  type        = map(string)
  default     = {}
}

variable "external_database_url" {
  description = "An existing Postgres for MLflow: postgresql://USER:PASSWORD@HOST[:PORT]/DATABASE[?sslmode=require]. null = a Bitnami postgresql release in the namespace. User and password must not need percent-encoding."
  type        = string
  default     = null
  sensitive   = true

  validation {
    condition     = var.external_database_url == null || can(regex("^postgres(ql)?(\\+[a-z0-9]+)?://[^:@/%]+:[^@/%]+@[^:/?@]+(:[0-9]+)?/[^/?]+(\\?.*)?$", var.external_database_url))
    error_message = "external_database_url must look like postgresql://USER:PASSWORD@HOST[:PORT]/DATABASE, without percent-encoded characters."
  }
}

variable "mlflow_auth_database" {
  description = "Database of MLflow's auth app (users and permissions) on the same Postgres server and credentials. Created with the bundled Postgres; must exist already with external_database_url."
  type        = string
  default     = "mlflow_auth"
}

variable "postgres_chart_version" {
  description = "Version of the Bitnami postgresql chart (OCI registry-1.docker.io/bitnamicharts) used when external_database_url is null."
  type        = string
  default     = "16.7.27"
}

variable "postgres_image" {
  description = "Postgres image for the bundled release. The default is the frozen bitnamilegacy copy of the 16.7.27 chart's own image: Bitnami stopped publishing versioned images under docker.io/bitnami in 2025."
  type = object({
    registry   = string
    repository = string
    tag        = string
  })
  default = {
    registry   = "docker.io"
    repository = "bitnamilegacy/postgresql"
    tag        = "17.6.0-debian-12-r4"
  }
}

variable "postgres_storage_size" {
  description = "Size of the bundled Postgres's persistent volume."
  type        = string
  default     = "20Gi"
}

# --- Kubeflow Pipelines --------------------------------------------------------------------------

variable "install_kfp" {
  description = "Install Kubeflow Pipelines standalone (false: KFP exists already; set kfp_namespace or kfp_host to point at it)."
  type        = bool
  default     = true
}

variable "kfp_version" {
  description = "Release tag of kubeflow/pipelines whose manifests are applied (matched to the kfp SDK pinned in constraints.txt)."
  type        = string
  default     = "2.17.3"
}

variable "kfp_manifests_env" {
  description = "Kustomize environment under manifests/kustomize/env/ applied after cluster-scoped-resources."
  type        = string
  default     = "platform-agnostic"
}

variable "kfp_namespace" {
  description = "Namespace of an existing KFP (install_kfp = false); an install always uses \"kubeflow\"."
  type        = string
  default     = "kubeflow"
}

variable "kfp_host" {
  description = "KFP API URL for the kfp_host output when it is not http://ml-pipeline.<kfp namespace>.svc.cluster.local:8888 (an existing KFP behind a gateway, say)."
  type        = string
  default     = null
}

variable "copy_credentials_to_kfp_namespace" {
  description = "Also create the credentials secret in KFP's namespace: standalone (single-user) KFP runs the pipeline pods there, not in var.namespace."
  type        = bool
  default     = true
}
