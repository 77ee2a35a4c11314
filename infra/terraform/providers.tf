# All three Kubernetes-facing providers read the same kubeconfig and context: the existing cluster.
provider "kubernetes" {
  config_path    = local.kubeconfig_path
  config_context = var.kube_context
}

provider "helm" {
  kubernetes = {
    config_path    = local.kubeconfig_path
    config_context = var.kube_context
  }
}

provider "kustomization" {
  kubeconfig_path = local.kubeconfig_path
  context         = var.kube_context
}

provider "aws" {
  region = var.aws_region

  # With object_store = "minio" no AWS resource exists, but Terraform still configures the
  # provider, and the provider then insists on credentials (hashicorp/terraform-provider-aws#38039).
  # In that mode it gets inert placeholders and makes no AWS call at all; with "s3" these are null
  # and the usual credential chain (environment, profile, SSO, instance role) applies.
  access_key                  = local.use_s3 ? null : "unused-object-store-is-minio"
  secret_key                  = local.use_s3 ? null : "unused-object-store-is-minio"
  skip_credentials_validation = !local.use_s3
  skip_requesting_account_id  = !local.use_s3
  skip_metadata_api_check     = !local.use_s3

  default_tags {
    tags = merge({ "app.kubernetes.io/part-of" = "kfrl" }, var.tags)
  }
}
