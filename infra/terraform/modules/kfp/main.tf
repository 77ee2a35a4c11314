# Kubeflow Pipelines standalone, the documented two-step install
#   kubectl apply -k github.com/kubeflow/pipelines/manifests/kustomize/cluster-scoped-resources?ref=V
#   kubectl apply -k github.com/kubeflow/pipelines/manifests/kustomize/env/platform-agnostic?ref=V
# done by the kbst/kustomization provider: kustomize builds both (it clones the tag with git, which
# must be on the PATH of whoever runs terraform), and every object becomes a resource in the state,
# planned with server-side dry runs, updated in place or replaced, and pruned when it leaves the
# manifests. Within each step the objects go in the provider's three tiers (namespaces and CRDs,
# then everything else, then webhooks), and the second step waits for the first, so the CRDs
# exist before anything uses them (the `kubectl wait ... crd/applications.app.k8s.io` of the docs).

locals {
  manifests = "${var.repository}/manifests/kustomize"
}

data "kustomization_build" "cluster_scoped" {
  path = "${local.manifests}/cluster-scoped-resources?ref=${var.kfp_version}"
}

data "kustomization_build" "platform" {
  path = "${local.manifests}/env/${var.manifests_env}?ref=${var.kfp_version}"
}

# --- Step 1: namespace, CRDs, cluster roles ---

resource "kustomization_resource" "cluster_scoped_p0" {
  for_each = data.kustomization_build.cluster_scoped.ids_prio[0]

  manifest = data.kustomization_build.cluster_scoped.manifests[each.value]
}

resource "kustomization_resource" "cluster_scoped_p1" {
  for_each = data.kustomization_build.cluster_scoped.ids_prio[1]

  manifest = data.kustomization_build.cluster_scoped.manifests[each.value]

  depends_on = [kustomization_resource.cluster_scoped_p0]
}

resource "kustomization_resource" "cluster_scoped_p2" {
  for_each = data.kustomization_build.cluster_scoped.ids_prio[2]

  manifest = data.kustomization_build.cluster_scoped.manifests[each.value]

  depends_on = [kustomization_resource.cluster_scoped_p1]
}

# --- Step 2: the KFP services in the "kubeflow" namespace ---
# Secrets (KFP's MySQL and artifact-store credentials) are marked sensitive so that plans do not
# print them.

resource "kustomization_resource" "platform_p0" {
  for_each = data.kustomization_build.platform.ids_prio[0]

  manifest = (
    contains(["_/Secret"], regex("(?P<group_kind>.*/.*)/.*/.*", each.value)["group_kind"])
    ? sensitive(data.kustomization_build.platform.manifests[each.value])
    : data.kustomization_build.platform.manifests[each.value]
  )

  depends_on = [kustomization_resource.cluster_scoped_p2]
}

resource "kustomization_resource" "platform_p1" {
  for_each = data.kustomization_build.platform.ids_prio[1]

  manifest = (
    contains(["_/Secret"], regex("(?P<group_kind>.*/.*)/.*/.*", each.value)["group_kind"])
    ? sensitive(data.kustomization_build.platform.manifests[each.value])
    : data.kustomization_build.platform.manifests[each.value]
  )
  # Wait for the deployments (ml-pipeline, the UI, MySQL, the artifact store) to become ready, so
  # that kfp_host answers once apply returns.
  wait = true

  timeouts {
    create = var.wait_timeout
    update = var.wait_timeout
  }

  depends_on = [kustomization_resource.platform_p0]
}

resource "kustomization_resource" "platform_p2" {
  for_each = data.kustomization_build.platform.ids_prio[2]

  manifest = (
    contains(["_/Secret"], regex("(?P<group_kind>.*/.*)/.*/.*", each.value)["group_kind"])
    ? sensitive(data.kustomization_build.platform.manifests[each.value])
    : data.kustomization_build.platform.manifests[each.value]
  )

  depends_on = [kustomization_resource.platform_p1]
}
