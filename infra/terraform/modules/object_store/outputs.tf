output "bucket" {
  description = "The bucket's name."
  value       = coalesce(one(aws_s3_bucket.store[*].id), var.bucket_name)
}

output "store_uri" {
  description = "kfrl's store URI, s3://<bucket>/<prefix>."
  value       = "s3://${coalesce(one(aws_s3_bucket.store[*].id), var.bucket_name)}/${trim(var.prefix, "/")}"
}

output "endpoint_url" {
  description = "S3 endpoint of MinIO; null for AWS S3."
  value       = local.minio ? local.minio_endpoint : null
}

output "region" {
  description = "Region name for the S3 clients."
  value       = var.aws_region
}

output "access_key_id" {
  description = "Access key id limited to the bucket; null without static credentials."
  value       = local.minio ? local.minio_user : one(aws_iam_access_key.store[*].id)
  sensitive   = true
}

output "secret_access_key" {
  description = "Secret access key of access_key_id."
  value       = local.minio ? one(random_password.minio_user[*].result) : one(aws_iam_access_key.store[*].secret)
  sensitive   = true
}
