# MLflow tracking server and model registry: the community-charts mlflow chart, Postgres as the
# backend store, artifacts in the object store, credentials from Kubernetes secrets.
#
# Chart choice: community-charts/mlflow (https://community-charts.github.io/helm-charts) rather than
# Bitnami's. It runs upstream MLflow (the burakince/mlflow image, released with every MLflow
# version), reads the database user/password, the S3 keys and the admin login from existing secrets,
# runs the schema migration as an init container, and has MLflow's basic-auth app with a Postgres
# auth database built in. Bitnami's chart also works, but since 2025 its versioned images are no
# longer published freely. 1.12.0 ships MLflow 3.14, a 3.x server for kfrl's mlflow 3.x client.

locals {
  release      = "mlflow"
  service_port = 5000
  service_host = "${local.release}.${var.namespace}.svc.cluster.local"
  tracking_uri = "http://${local.service_host}:${local.service_port}"

  # MLflow 3's server checks the Host header against MLFLOW_SERVER_ALLOWED_HOSTS: the service's
  # in-cluster names, and localhost for `kubectl port-forward`.
  allowed_hosts = concat(flatten([
    for host in [local.release, "${local.release}.${var.namespace}", "${local.release}.${var.namespace}.svc", local.service_host, "localhost", "127.0.0.1"] :
    [host, "${host}:*"]
  ]), var.allowed_hosts)

  extra_env = merge(
    { AWS_DEFAULT_REGION = var.aws_region },
    var.s3_endpoint_url == null ? {} : { MLFLOW_S3_ENDPOINT_URL = var.s3_endpoint_url },
    local.db.sslmode == null ? {} : { PGSSLMODE = local.db.sslmode },
  )
}

resource "random_password" "admin" {
  count = var.auth_enabled ? 1 : 0
  # Alphanumeric: the chart substitutes it into an INI file with sed.
  length  = 32
  special = false
}

resource "kubernetes_secret_v1" "db" {
  metadata {
    name      = "mlflow-db"
    namespace = var.namespace
  }

  type = "Opaque"
  data = {
    username = local.db.user
    password = local.bundled_postgres ? random_password.postgres_user[0].result : local.external.password
  }
}

resource "kubernetes_secret_v1" "admin" {
  count = var.auth_enabled ? 1 : 0

  metadata {
    name      = "mlflow-admin"
    namespace = var.namespace
  }

  type = "Opaque"
  data = {
    username = var.admin_username
    password = random_password.admin[0].result
  }
}

resource "kubernetes_secret_v1" "s3" {
  count = var.s3_static_credentials ? 1 : 0

  metadata {
    name      = "mlflow-s3"
    namespace = var.namespace
  }

  type = "Opaque"
  data = {
    AWS_ACCESS_KEY_ID     = var.s3_access_key_id
    AWS_SECRET_ACCESS_KEY = var.s3_secret_access_key
  }
}

resource "helm_release" "mlflow" {
  name       = local.release
  namespace  = var.namespace
  repository = "https://community-charts.github.io/helm-charts"
  chart      = "mlflow"
  version    = var.chart_version
  wait       = true
  timeout    = 900

  values = [yamlencode({
    fullnameOverride = local.release
    service          = { port = local.service_port }
    serviceAccount   = { annotations = var.service_account_annotations }

    backendStore = {
      databaseMigration       = true
      databaseConnectionCheck = true
      postgres = {
        enabled  = true
        host     = local.db.host
        port     = tonumber(local.db.port)
        database = local.db.database
      }
      existingDatabaseSecret = {
        name        = kubernetes_secret_v1.db.metadata[0].name
        usernameKey = "username"
        passwordKey = "password"
      }
    }

    # Clients read and write artifacts in the bucket directly (kfrl's pods have the keys), so large
    # model versions do not stream through the tracking server.
    artifactRoot = {
      proxiedArtifactStorage = false
      s3 = {
        enabled = true
        bucket  = var.bucket
        path    = trim(var.artifact_prefix, "/")
        existingSecret = var.s3_static_credentials ? {
          name                 = kubernetes_secret_v1.s3[0].metadata[0].name
          keyOfAccessKeyId     = "AWS_ACCESS_KEY_ID"
          keyOfSecretAccessKey = "AWS_SECRET_ACCESS_KEY"
          } : {
          name                 = ""
          keyOfAccessKeyId     = ""
          keyOfSecretAccessKey = ""
        }
      }
    }

    auth = {
      enabled           = var.auth_enabled
      defaultPermission = "READ"
      existingAdminSecret = {
        name        = var.auth_enabled ? kubernetes_secret_v1.admin[0].metadata[0].name : ""
        usernameKey = "username"
        passwordKey = "password"
      }
      postgres = {
        enabled  = var.auth_enabled
        host     = local.db.host
        port     = tonumber(local.db.port)
        database = var.auth_database
        existingSecret = {
          name        = kubernetes_secret_v1.db.metadata[0].name
          usernameKey = "username"
          passwordKey = "password"
        }
      }
    }

    serverAllowedHosts = local.allowed_hosts
    extraEnvVars       = local.extra_env
  })]

  depends_on = [helm_release.postgres]
}
