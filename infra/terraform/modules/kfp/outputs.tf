output "namespace" {
  description = "Namespace the standalone manifests install into."
  value       = "kubeflow"
}

output "host" {
  description = "In-cluster URL of the KFP API server."
  value       = "http://ml-pipeline.kubeflow.svc.cluster.local:8888"
}

output "resource_count" {
  description = "Number of Kubernetes objects applied from the manifests."
  value = sum([
    length(kustomization_resource.cluster_scoped_p0), length(kustomization_resource.cluster_scoped_p1),
    length(kustomization_resource.cluster_scoped_p2), length(kustomization_resource.platform_p0),
    length(kustomization_resource.platform_p1), length(kustomization_resource.platform_p2),
  ])
}
