# MLflow's backend store: an existing Postgres (external_database_url) or a Bitnami postgresql
# release in the namespace. Either way MLflow gets host, port and database as values and the user
# and password from the secret "mlflow-db".

locals {
  bundled_postgres = var.external_database_url == null

  # postgresql://USER:PASSWORD@HOST[:PORT]/DATABASE[?QUERY], validated by the root variable.
  external = local.bundled_postgres ? null : regex(
    "^postgres(?:ql)?(?:\\+[a-z0-9]+)?://(?P<user>[^:@/]+):(?P<password>[^@/]+)@(?P<host>[^:/?@]+)(?::(?P<port>[0-9]+))?/(?P<database>[^/?]+)(?:\\?(?P<query>.*))?$",
    var.external_database_url,
  )

  db = local.bundled_postgres ? {
    host     = "mlflow-postgresql.${var.namespace}.svc.cluster.local"
    port     = "5432"
    database = "mlflow"
    user     = "mlflow"
    sslmode  = null
    } : {
    # Where the database is, is no secret; who may use it is.
    host     = nonsensitive(local.external.host)
    port     = try(nonsensitive(coalesce(local.external.port, "5432")), "5432")
    database = nonsensitive(local.external.database)
    user     = local.external.user
    sslmode  = try(nonsensitive(regex("(?:^|&)sslmode=([^&]+)", local.external.query)[0]), null)
  }
}

resource "random_password" "postgres_admin" {
  count   = local.bundled_postgres ? 1 : 0
  length  = 32
  special = false
}

resource "random_password" "postgres_user" {
  count   = local.bundled_postgres ? 1 : 0
  length  = 32
  special = false
}

# Keys as the Bitnami chart expects them (auth.existingSecret).
resource "kubernetes_secret_v1" "postgres" {
  count = local.bundled_postgres ? 1 : 0

  metadata {
    name      = "mlflow-postgresql-auth"
    namespace = var.namespace
  }

  type = "Opaque"
  data = {
    "postgres-password" = random_password.postgres_admin[0].result
    "password"          = random_password.postgres_user[0].result
  }
}

# Bitnami postgresql, pinned. Bitnami stopped publishing versioned images under docker.io/bitnami
# in 2025; 16.7.27 is a chart whose own image (postgresql 17.6.0-debian-12-r4) was frozen in
# docker.io/bitnamilegacy, so the pair is known to exist. Frozen means no more security updates:
# for production use a managed Postgres through external_database_url.
resource "helm_release" "postgres" {
  count = local.bundled_postgres ? 1 : 0

  name       = "mlflow-postgresql"
  namespace  = var.namespace
  repository = "oci://registry-1.docker.io/bitnamicharts"
  chart      = "postgresql"
  version    = var.postgres_chart_version
  wait       = true
  timeout    = 900

  values = [yamlencode({
    fullnameOverride = "mlflow-postgresql"
    # The chart refuses images other than its own unless told to; this one is the same image,
    # from the legacy repository.
    global = { security = { allowInsecureImages = true } }
    image  = var.postgres_image

    auth = {
      username       = local.db.user
      database       = local.db.database
      existingSecret = kubernetes_secret_v1.postgres[0].metadata[0].name
      secretKeys = {
        adminPasswordKey = "postgres-password"
        userPasswordKey  = "password"
      }
    }

    primary = {
      persistence = {
        enabled      = true
        size         = var.postgres_storage_size
        storageClass = var.storage_class
      }
      # The auth app keeps users and permissions in a database of its own (its migrations would
      # collide with the tracking store's in one database). Runs once, on an empty volume.
      initdb = {
        scripts = {
          "10-mlflow-auth-database.sql" = "CREATE DATABASE \"${var.auth_database}\" OWNER \"${local.db.user}\";"
        }
      }
    }
  })]
}
