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
  # Where the standalone manifests install KFP and run pipeline pods.
  namespace = "kubeflow"
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

# --- Multi-node updates: pipeline pods submit training jobs ---
# With trainer.nnodes > 1 the update task of a pipeline creates a Kubeflow Trainer TrainJob
# (cluster.multi_node = "trainjob") or a training-operator PyTorchJob ("pytorchjob") in the namespace
# the pipeline runs in, then reads its status until it ends (kfrl.distributed.multinode). Standalone
# KFP runs pipeline pods as the pipeline-runner service account of "kubeflow"; it gets create and get
# on those two kinds there, nothing else (no delete: a failed job stays for its logs until a person
# deletes it). The Role names the kinds whether or not their CRDs are installed.

resource "kubernetes_role_v1" "multi_node_jobs" {
  count = var.multi_node_rbac ? 1 : 0

  metadata {
    name      = "kfrl-multi-node-jobs"
    namespace = local.namespace
    labels    = { "app.kubernetes.io/part-of" = "kfrl" }
  }

  rule {
    api_groups = ["trainer.kubeflow.org"]
    resources  = ["trainjobs"]
    verbs      = ["create", "get"]
  }

  rule {
    api_groups = ["kubeflow.org"]
    resources  = ["pytorchjobs"]
    verbs      = ["create", "get"]
  }

  depends_on = [kustomization_resource.platform_p2]
}

resource "kubernetes_role_binding_v1" "multi_node_jobs" {
  count = var.multi_node_rbac ? 1 : 0

  metadata {
    name      = "kfrl-multi-node-jobs"
    namespace = local.namespace
    labels    = { "app.kubernetes.io/part-of" = "kfrl" }
  }

  role_ref {
    api_group = "rbac.authorization.k8s.io"
    kind      = "Role"
    name      = kubernetes_role_v1.multi_node_jobs[0].metadata[0].name
  }

  subject {
    kind      = "ServiceAccount"
    name      = var.pipeline_service_account
    namespace = local.namespace
  }
}

# --- The run's engine: the driver creates it as a workload ---
# With pipeline.engines = "resident" the rl_train driver task creates, per run, the engine Pod, a
# Service in front of it, a NetworkPolicy admitting only the run's own task pods, and a Secret with
# the run's engine token (kfrl.driver.engine.workload); it reads the pod's status to wait for it and
# to replace it when it dies, and deletes all four when the run ends (the exit handler does so by
# label: deletecollection). Nothing more: no list, no get on secrets (the driver never reads one
# back: it replaces it), no exec, no logs. tests/test_engine_workload.py checks the verbs against the
# requests the code sends.

resource "kubernetes_role_v1" "engine" {
  count = var.engine_rbac ? 1 : 0

  metadata {
    name      = "kfrl-engine"
    namespace = local.namespace
    labels    = { "app.kubernetes.io/part-of" = "kfrl" }
  }

  rule {
    api_groups = [""]
    resources  = ["pods"]
    verbs      = ["create", "get", "delete", "deletecollection"]
  }

  rule {
    api_groups = [""]
    resources  = ["services"]
    verbs      = ["create", "deletecollection"]
  }

  rule {
    api_groups = [""]
    resources  = ["secrets"]
    verbs      = ["create", "update", "deletecollection"]
  }

  rule {
    api_groups = ["networking.k8s.io"]
    resources  = ["networkpolicies"]
    verbs      = ["create", "deletecollection"]
  }

  depends_on = [kustomization_resource.platform_p2]
}

resource "kubernetes_role_binding_v1" "engine" {
  count = var.engine_rbac ? 1 : 0

  metadata {
    name      = "kfrl-engine"
    namespace = local.namespace
    labels    = { "app.kubernetes.io/part-of" = "kfrl" }
  }

  role_ref {
    api_group = "rbac.authorization.k8s.io"
    kind      = "Role"
    name      = kubernetes_role_v1.engine[0].metadata[0].name
  }

  subject {
    kind      = "ServiceAccount"
    name      = var.pipeline_service_account
    namespace = local.namespace
  }
}
