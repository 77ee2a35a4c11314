# The object store: an AWS S3 bucket (s3.tf) or MinIO in the cluster (minio.tf). Either way kfrl
# sees an S3 API, a bucket, and a key pair that may use that bucket only.

locals {
  s3    = var.type == "s3"
  minio = var.type == "minio"

  # The actions kfrl needs on its store (create-only commits, ranged reads, multipart uploads of
  # checkpoints, listing runs) and MLflow on its artifacts. Reading old versions lets an operator's
  # client restore a manifest; permanently deleting versions is left to the bucket's owner.
  bucket_actions = [
    "s3:GetBucketLocation",
    "s3:ListBucket",
    "s3:ListBucketMultipartUploads",
    "s3:ListBucketVersions",
  ]
  object_actions = [
    "s3:AbortMultipartUpload",
    "s3:DeleteObject",
    "s3:GetObject",
    "s3:GetObjectVersion",
    "s3:ListMultipartUploadParts",
    "s3:PutObject",
  ]

  minio_endpoint = "http://minio.${var.namespace}.svc.cluster.local:9000"
  minio_user     = "kfrl"
}
