# The namespace kfrl runs in and the secret its pods read their environment from.

locals {
  labels = merge({
    "app.kubernetes.io/managed-by" = "terraform"
    "app.kubernetes.io/part-of"    = "kfrl"
  }, var.labels)
}

resource "kubernetes_namespace_v1" "this" {
  count = var.create_namespace ? 1 : 0

  metadata {
    name   = var.name
    labels = local.labels
  }
}

resource "kubernetes_secret_v1" "credentials" {
  metadata {
    name      = var.secret_name
    namespace = var.create_namespace ? kubernetes_namespace_v1.this[0].metadata[0].name : var.name
    labels    = local.labels
  }

  type = "Opaque"
  # The provider base64-encodes the values. A pod takes them all with
  # `envFrom: [{secretRef: {name: <secret>}}]`, or kfp-kubernetes' use_secret_as_env.
  data = var.secret_data
}
