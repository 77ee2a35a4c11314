# kfrl on an existing Kubernetes cluster: the run namespace and its credentials secret, the object
# store (AWS S3 or in-cluster MinIO), MLflow (Postgres backend, artifacts in the store) and Kubeflow
# Pipelines standalone. outputs.tf turns the result into kfrl's flags.

locals {
  use_s3          = var.object_store == "s3"
  static_keys     = !local.use_s3 || var.create_iam_user
  kubeconfig_path = var.kubeconfig_path == null ? null : pathexpand(var.kubeconfig_path)

  # The standalone manifests always install into "kubeflow"; var.kfp_namespace describes a KFP
  # that exists already (install_kfp = false).
  kfp_namespace = var.install_kfp ? "kubeflow" : var.kfp_namespace
  kfp_host      = coalesce(var.kfp_host, "http://ml-pipeline.${local.kfp_namespace}.svc.cluster.local:8888")

  # What kfrl's pods read (docs/operations.md, "S3" and "MLflow"). AWS_ENDPOINT_URL only for MinIO:
  # on AWS the SDK's own endpoint resolution must win. MLFLOW_S3_ENDPOINT_URL is the same endpoint
  # for MLflow's artifact client, which reads that name.
  credentials = merge(
    {
      AWS_DEFAULT_REGION  = module.object_store.region
      MLFLOW_TRACKING_URI = module.mlflow.tracking_uri
    },
    var.mlflow_auth_enabled ? {
      MLFLOW_TRACKING_USERNAME = module.mlflow.tracking_username
      MLFLOW_TRACKING_PASSWORD = module.mlflow.tracking_password
    } : {},
    local.static_keys ? {
      AWS_ACCESS_KEY_ID     = module.object_store.access_key_id
      AWS_SECRET_ACCESS_KEY = module.object_store.secret_access_key
    } : {},
    local.use_s3 ? {} : {
      AWS_ENDPOINT_URL       = module.object_store.endpoint_url
      MLFLOW_S3_ENDPOINT_URL = module.object_store.endpoint_url
    },
  )

  # Standalone (single-user) KFP runs every pipeline pod in its own namespace, so the pods find the
  # secret only there; the copy is made once KFP (and with it that namespace) exists.
  copy_secret_to_kfp_namespace = var.copy_credentials_to_kfp_namespace && local.kfp_namespace != var.namespace
}

module "namespace" {
  source = "./modules/namespace"

  name             = var.namespace
  create_namespace = var.create_namespace
  labels           = var.labels
  secret_name      = var.credentials_secret_name
  secret_data      = local.credentials
}

module "object_store" {
  source = "./modules/object_store"

  type        = var.object_store
  bucket_name = var.bucket_name
  prefix      = var.store_prefix
  namespace   = module.namespace.name
  aws_region  = var.aws_region
  tags        = var.tags

  create_iam_user                    = var.create_iam_user
  iam_user_name                      = var.iam_user_name
  kms_key_arn                        = var.kms_key_arn
  force_destroy                      = var.s3_force_destroy
  noncurrent_version_expiration_days = var.s3_noncurrent_version_expiration_days
  access_log_bucket                  = var.s3_access_log_bucket

  minio_chart_version  = var.minio_chart_version
  minio_storage_size   = var.minio_storage_size
  minio_memory_request = var.minio_memory_request
  storage_class        = var.storage_class
}

module "mlflow" {
  source = "./modules/mlflow"

  namespace       = module.namespace.name
  chart_version   = var.mlflow_chart_version
  bucket          = module.object_store.bucket
  artifact_prefix = var.mlflow_artifact_prefix
  aws_region      = module.object_store.region
  s3_endpoint_url = module.object_store.endpoint_url
  # A static key pair (MinIO's kfrl user, or the IAM user's access key); without one (S3 with
  # create_iam_user = false) MLflow's pod uses workload identity through its service account.
  s3_static_credentials = local.static_keys
  s3_access_key_id      = module.object_store.access_key_id
  s3_secret_access_key  = module.object_store.secret_access_key

  auth_enabled                = var.mlflow_auth_enabled
  admin_username              = var.mlflow_admin_username
  allowed_hosts               = var.mlflow_allowed_hosts
  service_account_annotations = var.mlflow_service_account_annotations

  external_database_url  = var.external_database_url
  auth_database          = var.mlflow_auth_database
  postgres_chart_version = var.postgres_chart_version
  postgres_image         = var.postgres_image
  postgres_storage_size  = var.postgres_storage_size
  storage_class          = var.storage_class

  # The MinIO bucket must exist before MLflow writes its first artifact.
  depends_on = [module.object_store]
}

module "kfp" {
  source = "./modules/kfp"
  count  = var.install_kfp ? 1 : 0

  kfp_version   = var.kfp_version
  manifests_env = var.kfp_manifests_env
}

# The same secret in KFP's namespace, where standalone KFP runs the pipeline pods.
module "kfp_namespace_secret" {
  source = "./modules/namespace"
  count  = local.copy_secret_to_kfp_namespace ? 1 : 0

  name             = local.kfp_namespace
  create_namespace = false
  labels           = var.labels
  secret_name      = var.credentials_secret_name
  secret_data      = local.credentials

  depends_on = [module.kfp]
}
