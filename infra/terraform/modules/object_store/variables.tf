variable "type" {
  description = "\"s3\" (an AWS S3 bucket) or \"minio\" (MinIO in the cluster)."
  type        = string

  validation {
    condition     = contains(["s3", "minio"], var.type)
    error_message = "type must be \"s3\" or \"minio\"."
  }
}

variable "bucket_name" {
  description = "The bucket's name."
  type        = string
}

variable "prefix" {
  description = "Key prefix of kfrl's store in the bucket."
  type        = string
}

variable "namespace" {
  description = "Namespace for MinIO (type = \"minio\")."
  type        = string
}

variable "aws_region" {
  description = "AWS region of the bucket; with MinIO the region name clients send."
  type        = string
}

variable "tags" {
  description = "Tags for the AWS resources."
  type        = map(string)
  default     = {}
}

variable "create_iam_user" {
  description = "S3: create an IAM user (and group) limited to the bucket, with an access key."
  type        = bool
  default     = true
}

variable "iam_user_name" {
  description = "S3: the IAM user's name."
  type        = string
  default     = "kfrl-store"
}

variable "kms_key_arn" {
  description = "S3: KMS key for default encryption; \"\" = create one."
  type        = string
  default     = ""
}

variable "force_destroy" {
  description = "S3: allow destroying a non-empty bucket."
  type        = bool
  default     = false
}

variable "noncurrent_version_expiration_days" {
  description = "S3: days noncurrent object versions are kept."
  type        = number
  default     = 30
}

variable "access_log_bucket" {
  description = "S3: existing bucket for server access logs; \"\" = none."
  type        = string
  default     = ""
}

variable "minio_chart_version" {
  description = "MinIO: version of the minio chart (https://charts.min.io/)."
  type        = string
  default     = "5.4.0"
}

variable "minio_storage_size" {
  description = "MinIO: size of the persistent volume."
  type        = string
  default     = "200Gi"
}

variable "minio_memory_request" {
  description = "MinIO: memory request of the pod."
  type        = string
  default     = "2Gi"
}

variable "storage_class" {
  description = "MinIO: storage class of the volume; \"\" = the cluster's default."
  type        = string
  default     = ""
}
