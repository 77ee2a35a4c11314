"""infra/terraform: the modules parse, declare what kfrl needs (outputs, the credentials secret's
variables, a hardened S3 bucket, pinned providers, typed and described variables), hold together
(module arguments, variable and output references), and pass checkov. Static: no cluster, no
network, no `terraform init`."""
from __future__ import annotations

import json
import os
import re
import shutil
import subprocess
import sys
from pathlib import Path

import hcl2
import pytest

REPO = Path(__file__).resolve().parents[1]
TF = REPO / "infra" / "terraform"
MODULES = TF / "modules"
# Any attempt to reach the network fails fast: checkov runs with --skip-download and must not need it.
OFFLINE = {"HTTP_PROXY": "http://127.0.0.1:9", "HTTPS_PROXY": "http://127.0.0.1:9", "ALL_PROXY": "http://127.0.0.1:9",
           "http_proxy": "http://127.0.0.1:9", "https_proxy": "http://127.0.0.1:9", "NO_PROXY": "", "no_proxy": ""}

# What kfrl reads from the root module's outputs, and its pods from the credentials secret.
KFRL_OUTPUTS = {"store_uri", "tracking_uri", "kfp_host", "namespace", "credentials_secret", "aws_endpoint_url"}
SECRET_VARIABLES = {"AWS_ACCESS_KEY_ID", "AWS_SECRET_ACCESS_KEY", "AWS_ENDPOINT_URL", "AWS_DEFAULT_REGION",
                    "MLFLOW_TRACKING_URI", "MLFLOW_TRACKING_USERNAME", "MLFLOW_TRACKING_PASSWORD"}
# A module block's arguments that are not the module's variables.
MODULE_META = {"source", "version", "count", "for_each", "depends_on", "providers"}
SKIP_COMMENT = re.compile(r"#\s*checkov:skip=(?P<id>[^:\s]*)(?P<rest>.*)")
SKIP_WITH_REASON = re.compile(r"^CKV2?_[A-Z0-9]+_\d+$")


# --- Parsing -------------------------------------------------------------------------------------

def _plain(value):
    """python-hcl2's output without its markers (__is_block__, __comments__, ...) and with the
    surrounding quotes of strings and block labels removed, whatever the library version keeps."""
    if isinstance(value, dict):
        return {_unquote(k): _plain(v) for k, v in value.items() if not (isinstance(k, str) and k.startswith("__"))}
    if isinstance(value, list):
        return [_plain(v) for v in value]
    return _unquote(value)


def _unquote(value):
    if isinstance(value, str) and len(value) >= 2 and value[0] == value[-1] == '"':
        return value[1:-1]
    return value


def parse(path: Path) -> dict:
    options = None
    if hasattr(hcl2, "SerializationOptions"):  # python-hcl2 >= 8
        options = hcl2.SerializationOptions(with_comments=False, explicit_blocks=False, strip_string_quotes=True)
    with path.open() as f:
        data = hcl2.load(f, serialization_options=options) if options else hcl2.load(f)
    return _plain(data)


def module_dirs() -> list[Path]:
    return [TF] + sorted(p for p in MODULES.iterdir() if p.is_dir())


def tf_files(directory: Path | None = None, recursive: bool = True) -> list[Path]:
    directory = directory or TF
    files = directory.rglob("*.tf") if recursive else directory.glob("*.tf")
    return sorted(p for p in files if ".terraform" not in p.parts)


def blocks(directory: Path, kind: str) -> dict[str, object]:
    """Every `kind` block of the module in `directory` (not its submodules), by name; for
    `resource` and `data`, by "type.name"."""
    found: dict[str, object] = {}
    for path in tf_files(directory, recursive=False):
        for entry in parse(path).get(kind, []):
            for name, body in entry.items():
                if kind in ("resource", "data"):
                    for label, inner in body.items():
                        found[f"{name}.{label}"] = inner
                else:
                    found[name] = body
    return found


def merged(kind: str, directory: Path) -> dict:
    """`terraform` and `locals` blocks, merged across a module's files."""
    out: dict = {}
    for path in tf_files(directory, recursive=False):
        for entry in parse(path).get(kind, []):
            out.update(entry)
    return out


def source_text(directory: Path) -> str:
    """The module's code without comments (for reference checks)."""
    text = "\n".join(p.read_text() for p in tf_files(directory, recursive=False))
    return "\n".join(re.sub(r"(^|\s)#.*$", "", line) for line in text.splitlines())


# --- Structure -----------------------------------------------------------------------------------

def test_layout_and_every_file_parses():
    for name in ("main.tf", "variables.tf", "outputs.tf", "versions.tf", "terraform.tfvars.example", "README.md"):
        assert (TF / name).is_file(), name
    assert {p.name for p in MODULES.iterdir() if p.is_dir()} >= {"namespace", "object_store", "mlflow", "kfp"}
    files = tf_files()
    assert len(files) >= 20
    for path in files:
        parse(path)  # raises on a syntax error
    parse(TF / "terraform.tfvars.example")


def test_root_outputs_are_what_kfrl_needs():
    outputs = blocks(TF, "output")
    assert KFRL_OUTPUTS <= outputs.keys()
    for name, body in outputs.items():
        assert body.get("description"), f"output {name} has no description"
    assert "ml-pipeline." in source_text(TF) and ":8888" in source_text(TF)
    mlflow = source_text(MODULES / "mlflow")
    assert re.search(r'tracking_uri\s*=\s*"http://\$\{local\.service_host\}:\$\{local\.service_port\}"', mlflow)
    store = parse(MODULES / "object_store" / "outputs.tf")
    store_uri = next(e["store_uri"] for e in store["output"] if "store_uri" in e)
    assert store_uri["value"].startswith("s3://")


@pytest.mark.parametrize("directory", module_dirs(), ids=lambda p: p.name)
def test_every_variable_has_a_description_and_a_type(directory):
    variables = blocks(directory, "variable")
    assert variables, directory
    for name, body in variables.items():
        assert body.get("description"), f"{directory.name}: variable {name} has no description"
        assert body.get("type"), f"{directory.name}: variable {name} has no type"


def test_providers_are_pinned():
    terraform = merged("terraform", TF)
    assert re.fullmatch(r">=\s*1\.([5-9]|\d\d)(\.\d+)?", terraform["required_version"]), terraform["required_version"]
    providers = {k: v for entry in terraform["required_providers"] for k, v in entry.items()}
    assert {"kubernetes", "helm", "aws", "kustomization"} <= providers.keys()
    for name, spec in providers.items():
        assert "/" in spec["source"], name
        version = spec.get("version", "")
        # Bounded above: "~> X.Y[.Z]" or an exact version; a bare ">=" would take the next major.
        assert re.fullmatch(r"(~>\s*|=\s*)?\d+\.\d+(\.\d+)?", version), f"provider {name} is not pinned: {version!r}"
    assert providers["kustomization"]["source"] == "kbst/kustomization"


@pytest.mark.parametrize("directory", module_dirs(), ids=lambda p: p.name)
def test_modules_declare_the_providers_they_use(directory):
    """A provider outside hashicorp/ (kbst/kustomization) must be declared in each module that uses
    it, or Terraform looks for hashicorp/kustomization."""
    declared = {k: v["source"] for entry in merged("terraform", directory).get("required_providers", []) for k, v in entry.items()}
    used = {key.split(".")[0].split("_")[0] for kind in ("resource", "data") for key in blocks(directory, kind)}
    assert used <= declared.keys(), f"{directory.name} uses {used - declared.keys()} without required_providers"


def test_module_calls_match_module_variables():
    """What `terraform validate` would catch first: unknown or missing module arguments."""
    calls = blocks(TF, "module")
    assert {"namespace", "object_store", "mlflow", "kfp"} <= {Path(c["source"]).name for c in calls.values()}
    for name, call in calls.items():
        directory = (TF / call["source"]).resolve()
        variables = blocks(directory, "variable")
        arguments = set(call) - MODULE_META
        assert arguments <= variables.keys(), f"module {name}: unknown arguments {arguments - variables.keys()}"
        required = {v for v, body in variables.items() if "default" not in body}
        assert required <= arguments, f"module {name}: missing {required - arguments}"


@pytest.mark.parametrize("directory", module_dirs(), ids=lambda p: p.name)
def test_references_resolve(directory):
    text = source_text(directory)
    variables = blocks(directory, "variable")
    for ref in set(re.findall(r"\bvar\.([a-z0-9_]+)", text)):
        assert ref in variables, f"{directory.name}: var.{ref} is not declared"
    locals_ = merged("locals", directory)
    for ref in set(re.findall(r"\blocal\.([a-z0-9_]+)", text)):
        assert ref in locals_, f"{directory.name}: local.{ref} is not defined"
    calls = blocks(directory, "module")
    for module, output in set(re.findall(r"\bmodule\.([a-z0-9_]+)(?:\[[^\]]*\])?\.([a-z0-9_]+)", text)):
        assert module in calls, f"{directory.name}: module.{module} is not called"
        outputs = blocks((directory / calls[module]["source"]).resolve(), "output")
        assert output in outputs, f"{directory.name}: module.{module} has no output {output}"
    resources = blocks(directory, "resource")
    data = blocks(directory, "data")
    for kind, name in set(re.findall(r"(?<![.\w])((?:aws|kubernetes|helm|random|kustomization)_[a-z0-9_]+)\.([a-z0-9_]+)", text)):
        assert f"{kind}.{name}" in resources or f"{kind}.{name}" in data, f"{directory.name}: {kind}.{name} is not declared"
    for kind, name in set(re.findall(r"\bdata\.([a-z0-9_]+)\.([a-z0-9_]+)", text)):
        assert f"{kind}.{name}" in data, f"{directory.name}: data.{kind}.{name} is not declared"


def test_tfvars_example_sets_declared_variables():
    variables = blocks(TF, "variable")
    example = parse(TF / "terraform.tfvars.example")
    assert example.keys() <= variables.keys(), example.keys() - variables.keys()
    required = {v for v, body in variables.items() if "default" not in body}
    assert required <= example.keys(), f"the example misses required {required - example.keys()}"


# --- What the modules provision ------------------------------------------------------------------

def s3_findings(resources: dict[str, dict]) -> list[str]:
    """What is missing for each aws_s3_bucket among `resources` ("type.name" => body): default
    encryption, versioning, a full public access block and bucket-owner-enforced ownership."""
    def for_bucket(kind: str, bucket: str) -> list[dict]:
        return [body for key, body in resources.items()
                if key.startswith(kind + ".") and re.search(rf"\baws_s3_bucket\.{bucket}\b", str(body.get("bucket", "")))]

    def first(body: dict, *path: str):
        for key in path:
            body = body.get(key, {}) if isinstance(body, dict) else {}
            if isinstance(body, list):
                body = body[0] if body else {}
        return body

    findings = []
    for key in [k for k in resources if k.startswith("aws_s3_bucket.")]:
        bucket = key.split(".", 1)[1]
        sse = for_bucket("aws_s3_bucket_server_side_encryption_configuration", bucket)
        if not sse or first(sse[0], "rule", "apply_server_side_encryption_by_default", "sse_algorithm") not in ("aws:kms", "aws:kms:dsse", "AES256"):
            findings.append(f"{key}: no default encryption")
        versioning = for_bucket("aws_s3_bucket_versioning", bucket)
        if not versioning or first(versioning[0], "versioning_configuration", "status") != "Enabled":
            findings.append(f"{key}: versioning not enabled")
        pab = for_bucket("aws_s3_bucket_public_access_block", bucket)
        flags = ("block_public_acls", "block_public_policy", "ignore_public_acls", "restrict_public_buckets")
        if not pab or not all(pab[0].get(flag) is True for flag in flags):
            findings.append(f"{key}: public access not blocked")
        ownership = for_bucket("aws_s3_bucket_ownership_controls", bucket)
        if not ownership or first(ownership[0], "rule", "object_ownership") != "BucketOwnerEnforced":
            findings.append(f"{key}: ACLs not disabled (BucketOwnerEnforced)")
    return findings


def test_s3_bucket_is_encrypted_versioned_and_private():
    resources = blocks(MODULES / "object_store", "resource")
    assert "aws_s3_bucket.store" in resources
    assert s3_findings(resources) == []
    sse = resources["aws_s3_bucket_server_side_encryption_configuration.store"]
    assert sse["rule"][0]["apply_server_side_encryption_by_default"][0]["sse_algorithm"] == "aws:kms"
    assert resources["aws_kms_key.store"]["enable_key_rotation"] is True
    # The IAM policy names the bucket, never "*".
    policy = blocks(MODULES / "object_store", "data")["aws_iam_policy_document.store_access"]
    for statement in policy["statement"]:
        for resource in statement["resources"]:
            assert resource != "*" and re.match(r"\$\{(aws_s3_bucket\.store\[0\]\.arn|local\.kms_key_arn)\}", resource), statement


def test_checks_catch_a_bad_bucket(tmp_path):
    bad = tmp_path / "bad"
    bad.mkdir()
    (bad / "main.tf").write_text('resource "aws_s3_bucket" "open" {\n  bucket = "kfrl-open"\n}\n')
    findings = s3_findings(blocks(bad, "resource"))
    assert any("no default encryption" in f for f in findings)
    assert any("public access not blocked" in f for f in findings)
    assert any("versioning" in f for f in findings)
    # And a skip without a reason is caught.
    assert skip_problems("  #checkov:skip=CKV_AWS_18\n") and skip_problems("#checkov:skip=CKV_AWS_18:\n")
    assert not skip_problems("  #checkov:skip=CKV_AWS_18: logs go to the account's central bucket\n")

    checkov = find_checkov()
    if checkov:
        result = run_checkov(checkov, bad)
        assert result.returncode != 0, result.stdout
        failed = {c["check_id"] for c in failed_checks(result)}
        assert {"CKV_AWS_145", "CKV2_AWS_6"} <= failed, failed


def test_credentials_secret_holds_kfrl_variables():
    locals_ = merged("locals", TF)
    keys = set(re.findall(r"\b([A-Z][A-Z0-9_]+)\s*=", locals_["credentials"]))
    assert SECRET_VARIABLES <= keys, SECRET_VARIABLES - keys
    calls = blocks(TF, "module")
    assert calls["namespace"]["secret_data"] == "${local.credentials}"
    assert calls["namespace"]["secret_name"] == "${var.credentials_secret_name}"
    assert blocks(TF, "variable")["credentials_secret_name"]["default"] == "kfrl-credentials"
    assert blocks(TF, "variable")["namespace"]["default"] == "kfrl"
    secret = blocks(MODULES / "namespace", "resource")["kubernetes_secret_v1.credentials"]
    assert secret["data"] == "${var.secret_data}"
    assert blocks(MODULES / "namespace", "variable")["secret_data"]["sensitive"] is True


def test_object_store_and_kfp_switches():
    variables = blocks(TF, "variable")
    assert variables["object_store"]["default"] in ("s3", "minio")
    assert '"s3", "minio"' in str(variables["object_store"]["validation"])
    assert variables["install_kfp"]["default"] is True
    assert blocks(TF, "module")["kfp"]["count"] == "${var.install_kfp ? 1 : 0}"
    kfp = blocks(MODULES / "kfp", "data")
    manifests = merged("locals", MODULES / "kfp")["manifests"]
    repository = blocks(MODULES / "kfp", "variable")["repository"]["default"]
    assert manifests == "${var.repository}/manifests/kustomize" and repository == "github.com/kubeflow/pipelines"
    paths = " ".join(body["path"].replace("${local.manifests}", "manifests/kustomize") for body in kfp.values())
    assert "manifests/kustomize/cluster-scoped-resources?ref=${var.kfp_version}" in paths
    assert "manifests/kustomize/env/${var.manifests_env}?ref=${var.kfp_version}" in paths
    assert not any(k.startswith("null_resource.") for k in blocks(MODULES / "kfp", "resource"))
    # Charts are pinned.
    for directory in (MODULES / "object_store", MODULES / "mlflow"):
        for key, body in blocks(directory, "resource").items():
            if key.startswith("helm_release."):
                assert body.get("version"), f"{key} has no chart version"


def test_readme_maps_outputs_to_kfrl_flags():
    readme = (TF / "README.md").read_text()
    for word in ("terraform init", "terraform plan", "terraform apply", "--store", "--tracking-uri",
                 "pipeline.host", "cluster.secret", *KFRL_OUTPUTS):
        assert word in readme, word


# --- Security scan -------------------------------------------------------------------------------

def skip_problems(text: str) -> list[str]:
    """Inline checkov skips that name no check or give no reason."""
    problems = []
    for number, line in enumerate(text.splitlines(), 1):
        match = SKIP_COMMENT.search(line)
        if not match:
            continue
        reason = match["rest"][1:].strip() if match["rest"].startswith(":") else ""
        if not SKIP_WITH_REASON.match(match["id"]) or len(reason) < 15:
            problems.append(f"line {number}: {line.strip()}")
    return problems


def test_every_checkov_skip_has_a_reason():
    skips = 0
    for path in tf_files():
        text = path.read_text()
        assert not skip_problems(text), (path, skip_problems(text))
        skips += len(SKIP_COMMENT.findall(text))
    assert skips <= 5, "more skips than reviewed; explain each new one in infra/terraform/README.md"
    # No blanket skips through a config file.
    assert not list(TF.rglob(".checkov.y*ml"))


def find_checkov() -> str | None:
    candidates = [os.environ.get("CHECKOV"),
                  str(Path(sys.executable).with_name("checkov")),
                  str(REPO / ".venv" / "checkov" / "bin" / "checkov"),  # the tool venv of infra/terraform/README.md
                  shutil.which("checkov")]
    return next((c for c in candidates if c and os.access(c, os.X_OK)), None)


def run_checkov(checkov: str, directory: Path) -> subprocess.CompletedProcess:
    return subprocess.run([checkov, "-d", str(directory), "--framework", "terraform", "--skip-download",
                           "--quiet", "--compact", "-o", "json"],
                          capture_output=True, text=True, timeout=300, env={**os.environ, **OFFLINE})


def failed_checks(result: subprocess.CompletedProcess) -> list[dict]:
    reports = json.loads(result.stdout or "[]")
    reports = reports if isinstance(reports, list) else [reports]
    return [c for r in reports for c in r.get("results", {}).get("failed_checks", [])]


def test_checkov_passes():
    checkov = find_checkov()
    if not checkov:
        pytest.skip("checkov is not installed: see infra/terraform/README.md, 'Security scan'")
    result = run_checkov(checkov, TF)
    failed = [f"{c['check_id']} {c['resource']} ({c['file_path']}:{c['file_line_range']}): {c['check_name']}"
              for c in failed_checks(result)] if result.stdout.strip().startswith(("{", "[")) else []
    assert result.returncode == 0, "checkov failed:\n" + ("\n".join(failed) or result.stdout[-4000:] + result.stderr[-4000:])
    reports = json.loads(result.stdout)
    reports = reports if isinstance(reports, list) else [reports]
    summary = reports[0]["summary"]
    assert summary["failed"] == 0 and summary["parsing_errors"] == 0 and summary["passed"] > 40, summary


def test_terraform_fmt(tmp_path):
    terraform = shutil.which("terraform")
    if not terraform:
        pytest.skip("no terraform binary")
    example = tmp_path / "example.tfvars"
    example.write_text((TF / "terraform.tfvars.example").read_text())
    env = {**os.environ, **OFFLINE, "TF_IN_AUTOMATION": "1", "CHECKPOINT_DISABLE": "1"}
    for args in (["-recursive", str(TF)], [str(example)]):
        result = subprocess.run([terraform, "fmt", "-check", "-diff", *args], capture_output=True, text=True,
                                timeout=60, env=env)
        assert result.returncode == 0, result.stdout + result.stderr
