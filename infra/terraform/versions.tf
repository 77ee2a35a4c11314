terraform {
  # Nothing here needs a feature newer than 1.5; formatted with `terraform fmt` 1.11.
  required_version = ">= 1.5.0"

  # Each provider is held to its current major series (kbst/kustomization, still 0.x, to 0.9.x);
  # `terraform init` writes the exact versions and their checksums to .terraform.lock.hcl: commit
  # that file with the first apply.
  required_providers {
    aws = {
      source  = "hashicorp/aws"
      version = "~> 6.0"
    }
    helm = {
      # 3.x: the `kubernetes = { ... }` provider attribute (2.x used a block).
      source  = "hashicorp/helm"
      version = "~> 3.0"
    }
    kubernetes = {
      source  = "hashicorp/kubernetes"
      version = "~> 2.38"
    }
    kustomization = {
      # Builds the Kubeflow Pipelines kustomize manifests in-process (kustomize as a library, no
      # kubectl) and applies them resource by resource with server-side dry-run plans.
      source  = "kbst/kustomization"
      version = "~> 0.9.6"
    }
    random = {
      source  = "hashicorp/random"
      version = "~> 3.7"
    }
  }
}
