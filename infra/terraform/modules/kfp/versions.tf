terraform {
  required_version = ">= 1.5.0"

  required_providers {
    kubernetes = {
      source  = "hashicorp/kubernetes"
      version = ">= 2.38"
    }
    kustomization = {
      source  = "kbst/kustomization"
      version = ">= 0.9.6"
    }
  }
}
