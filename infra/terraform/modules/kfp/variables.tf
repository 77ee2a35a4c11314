variable "kfp_version" {
  description = "Release tag of kubeflow/pipelines whose manifests are applied."
  type        = string
  default     = "2.17.3"

  validation {
    condition     = can(regex("^[0-9]+\\.[0-9]+\\.[0-9]+(-[0-9A-Za-z.]+)?$", var.kfp_version))
    error_message = "kfp_version must be a release tag such as 2.17.3 (a branch would not be reproducible)."
  }
}

variable "manifests_env" {
  description = "Kustomize environment under manifests/kustomize/env/ (platform-agnostic runs on any conformant cluster)."
  type        = string
  default     = "platform-agnostic"
}

variable "repository" {
  description = "Git location of the manifests, in kustomize's remote-target syntax (a mirror for air-gapped clusters)."
  type        = string
  default     = "github.com/kubeflow/pipelines"
}

variable "wait_timeout" {
  description = "How long to wait for KFP's deployments to become ready."
  type        = string
  default     = "15m"
}

variable "multi_node_rbac" {
  description = "Let pipeline pods create and read Kubeflow Trainer TrainJobs and training-operator PyTorchJobs in the KFP namespace (kfrl's multi-node updates, trainer.nnodes > 1)."
  type        = bool
  default     = true
}

variable "engine_rbac" {
  description = "Let pipeline pods create, read and delete each run's engine (a Pod, a Service, a NetworkPolicy and a token Secret) in the KFP namespace (pipeline.engines = resident on a cluster)."
  type        = bool
  default     = true
}

variable "pipeline_service_account" {
  description = "Service account the standalone KFP runs pipeline pods as (bound to the multi-node and engine Roles)."
  type        = string
  default     = "pipeline-runner"
}
