# type = "minio": MinIO in the cluster (on-prem), one bucket, and a user limited to it.

resource "random_password" "minio_root" {
  count   = local.minio ? 1 : 0
  length  = 40
  special = false
}

resource "random_password" "minio_user" {
  count   = local.minio ? 1 : 0
  length  = 40
  special = false
}

# Credentials reach the chart through secrets, never as Helm values (which Helm keeps, readable, in
# its release records).
resource "kubernetes_secret_v1" "minio_root" {
  count = local.minio ? 1 : 0

  metadata {
    name      = "minio-root"
    namespace = var.namespace
  }

  type = "Opaque"
  data = {
    rootUser     = "minio-admin"
    rootPassword = random_password.minio_root[0].result
  }
}

resource "kubernetes_secret_v1" "minio_user" {
  count = local.minio ? 1 : 0

  metadata {
    name      = "minio-kfrl-user"
    namespace = var.namespace
  }

  type = "Opaque"
  data = {
    secretKey = random_password.minio_user[0].result
  }
}

resource "helm_release" "minio" {
  count = local.minio ? 1 : 0

  name       = "minio"
  namespace  = var.namespace
  repository = "https://charts.min.io/"
  chart      = "minio"
  version    = var.minio_chart_version
  wait       = true
  timeout    = 900

  values = [yamlencode({
    fullnameOverride = "minio"
    mode             = "standalone"
    replicas         = 1
    existingSecret   = kubernetes_secret_v1.minio_root[0].metadata[0].name

    persistence = {
      enabled      = true
      size         = var.minio_storage_size
      storageClass = var.storage_class
    }
    resources = {
      requests = { memory = var.minio_memory_request }
    }

    buckets = [{
      name          = var.bucket_name
      policy        = "none"
      purge         = false
      versioning    = true
      objectlocking = false
    }]

    policies = [{
      name = "kfrl-store"
      statements = [
        {
          resources = ["arn:aws:s3:::${var.bucket_name}"]
          actions   = local.bucket_actions
        },
        {
          resources = ["arn:aws:s3:::${var.bucket_name}/*"]
          actions   = local.object_actions
        },
      ]
    }]

    # Replaces the chart's default user list, whose "console" user has a published password.
    users = [{
      accessKey         = local.minio_user
      existingSecret    = kubernetes_secret_v1.minio_user[0].metadata[0].name
      existingSecretKey = "secretKey"
      policy            = "kfrl-store"
    }]
  })]
}
