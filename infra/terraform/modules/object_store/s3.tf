# type = "s3": a private, versioned, KMS-encrypted bucket and an IAM user that may use only it.

data "aws_caller_identity" "current" {
  count = local.s3 ? 1 : 0
}

data "aws_partition" "current" {
  count = local.s3 ? 1 : 0
}

resource "aws_s3_bucket" "store" {
  count = local.s3 ? 1 : 0
  #checkov:skip=CKV_AWS_144: Cross-region replication doubles storage for a working store whose runs can be re-created; versioning (below) covers the recovery kfrl documents. Add replication where policy requires it.
  #checkov:skip=CKV2_AWS_62: Nothing consumes bucket events: kfrl finds commits through its manifests, not notifications.

  bucket        = var.bucket_name
  force_destroy = var.force_destroy
  tags          = var.tags
}

resource "aws_s3_bucket_ownership_controls" "store" {
  count  = local.s3 ? 1 : 0
  bucket = aws_s3_bucket.store[0].id

  rule {
    # ACLs off: the bucket owner owns every object, whoever wrote it.
    object_ownership = "BucketOwnerEnforced"
  }
}

resource "aws_s3_bucket_public_access_block" "store" {
  count  = local.s3 ? 1 : 0
  bucket = aws_s3_bucket.store[0].id

  block_public_acls       = true
  block_public_policy     = true
  ignore_public_acls      = true
  restrict_public_buckets = true
}

resource "aws_s3_bucket_versioning" "store" {
  count  = local.s3 ? 1 : 0
  bucket = aws_s3_bucket.store[0].id

  versioning_configuration {
    # A corrupt or edited _COMMITTED manifest is restored from its previous version.
    status = "Enabled"
  }
}

resource "aws_kms_key" "store" {
  count = local.s3 && var.kms_key_arn == "" ? 1 : 0

  description             = "Default encryption of the kfrl store bucket ${var.bucket_name}"
  enable_key_rotation     = true
  deletion_window_in_days = 30
  # The account's default key policy: the account administers the key, and IAM policies (the
  # store group's below) grant its use.
  policy = jsonencode({
    Version = "2012-10-17"
    Statement = [{
      Sid       = "AccountAdministersKey"
      Effect    = "Allow"
      Principal = { AWS = "arn:${data.aws_partition.current[0].partition}:iam::${data.aws_caller_identity.current[0].account_id}:root" }
      Action    = "kms:*"
      Resource  = "*"
    }]
  })
  tags = var.tags
}

locals {
  kms_key_arn = local.s3 ? coalesce(var.kms_key_arn, one(aws_kms_key.store[*].arn)) : null
}

resource "aws_s3_bucket_server_side_encryption_configuration" "store" {
  count  = local.s3 ? 1 : 0
  bucket = aws_s3_bucket.store[0].id

  rule {
    apply_server_side_encryption_by_default {
      sse_algorithm     = "aws:kms"
      kms_master_key_id = local.kms_key_arn
    }
    # One data key per bucket rather than per object: far fewer KMS requests for checkpoint shards.
    bucket_key_enabled = true
  }
}

resource "aws_s3_bucket_lifecycle_configuration" "store" {
  count  = local.s3 ? 1 : 0
  bucket = aws_s3_bucket.store[0].id

  rule {
    id     = "abort-incomplete-multipart-uploads"
    status = "Enabled"

    filter {}

    # A checkpoint upload killed half-way leaves parts that cost storage until aborted.
    abort_incomplete_multipart_upload {
      days_after_initiation = 7
    }
  }

  rule {
    id     = "expire-noncurrent-versions"
    status = "Enabled"

    filter {}

    noncurrent_version_expiration {
      noncurrent_days = var.noncurrent_version_expiration_days
    }
  }

  # Lifecycle rules on noncurrent versions need versioning in place first.
  depends_on = [aws_s3_bucket_versioning.store]
}

resource "aws_s3_bucket_logging" "store" {
  count  = local.s3 && var.access_log_bucket != "" ? 1 : 0
  bucket = aws_s3_bucket.store[0].id

  target_bucket = var.access_log_bucket
  target_prefix = "${var.bucket_name}/"
}

data "aws_iam_policy_document" "tls_only" {
  count = local.s3 ? 1 : 0

  statement {
    sid       = "DenyInsecureTransport"
    effect    = "Deny"
    actions   = ["s3:*"]
    resources = [aws_s3_bucket.store[0].arn, "${aws_s3_bucket.store[0].arn}/*"]

    principals {
      type        = "*"
      identifiers = ["*"]
    }

    condition {
      test     = "Bool"
      variable = "aws:SecureTransport"
      values   = ["false"]
    }
  }
}

resource "aws_s3_bucket_policy" "store" {
  count  = local.s3 ? 1 : 0
  bucket = aws_s3_bucket.store[0].id
  policy = data.aws_iam_policy_document.tls_only[0].json

  # A bucket policy is refused while the public access block is still being applied.
  depends_on = [aws_s3_bucket_public_access_block.store]
}

# --- The IAM user whose access key goes into the credentials secret ---

resource "aws_iam_user" "store" {
  count = local.s3 && var.create_iam_user ? 1 : 0
  #checkov:skip=CKV_AWS_273: A workload identity, not a person: kfrl's pods authenticate with an access key from a Kubernetes secret, which SSO cannot issue. Use create_iam_user = false with IRSA / Pod Identity to avoid the user.

  name = var.iam_user_name
  path = "/kfrl/"
  tags = var.tags
}

resource "aws_iam_access_key" "store" {
  count = local.s3 && var.create_iam_user ? 1 : 0
  user  = aws_iam_user.store[0].name
}

resource "aws_iam_group" "store" {
  count = local.s3 && var.create_iam_user ? 1 : 0

  name = "${var.iam_user_name}-bucket-access"
  path = "/kfrl/"
}

resource "aws_iam_group_membership" "store" {
  count = local.s3 && var.create_iam_user ? 1 : 0

  name  = "${var.iam_user_name}-bucket-access"
  group = aws_iam_group.store[0].name
  users = [aws_iam_user.store[0].name]
}

data "aws_iam_policy_document" "store_access" {
  count = local.s3 && var.create_iam_user ? 1 : 0

  statement {
    sid       = "Bucket"
    effect    = "Allow"
    actions   = local.bucket_actions
    resources = [aws_s3_bucket.store[0].arn]
  }

  statement {
    sid       = "Objects"
    effect    = "Allow"
    actions   = local.object_actions
    resources = ["${aws_s3_bucket.store[0].arn}/*"]
  }

  statement {
    sid       = "BucketKey"
    effect    = "Allow"
    actions   = ["kms:Decrypt", "kms:GenerateDataKey"]
    resources = [local.kms_key_arn]
  }
}

resource "aws_iam_group_policy" "store_access" {
  count = local.s3 && var.create_iam_user ? 1 : 0

  name   = "kfrl-store-bucket"
  group  = aws_iam_group.store[0].name
  policy = data.aws_iam_policy_document.store_access[0].json
}
