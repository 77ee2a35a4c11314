"""The policy checkpoint folder as an MLflow model, written with MLflow's own model API.

The folder the store commits is at once an HF directory (``AutoModelForCausalLM.from_pretrained``) and
an MLflow model of the transformers flavour with a pyfunc entry: ``mlflow.transformers.load_model``,
``mlflow.pyfunc.load_model``, ``mlflow models serve`` and ``get_model_dependencies`` read it, and its
``requirements.txt`` / ``python_env.yaml`` / ``conda.yaml`` let ``mlflow models build-docker`` or
``--env-manager virtualenv`` rebuild the environment. The weights are the folder's own files
(``model_binary: .``): there is no second copy.

``mlflow.transformers.save_model`` itself is not used: it copies the weights into the model folder
(a checkpoint path or a pipeline: ``save_pretrained``), fetches a model card from the Hub, and with
transformers 5 its local-checkpoint path fails (MLflow 3.17 reads a task's ``impl`` as a class). This
module builds the same ``MLmodel`` with MLflow's public pieces for an existing folder
(``mlflow.models.Model``, ``Model.add_flavor``, ``mlflow.pyfunc.add_to_model``) and the environment
files with MLflow's writers.

A process without MLflow (a slim inference image) writes the HF directory only; ``write_mlmodel`` then
returns None, the commit records it (``mlflow_model: false``) and registering that checkpoint fails
saying why.
"""
from __future__ import annotations

import importlib.util
import json
import re
from importlib import metadata
from pathlib import Path

MLMODEL_FILE = "MLmodel"
TOKENIZER_COMPONENT = "components/tokenizer"
ENVIRONMENT_FILES = ("requirements.txt", "python_env.yaml", "conda.yaml")
# What loading and serving the folder imports. mlflow itself is added by MLflow's environment writers.
SERVING_PACKAGES = ("torch", "transformers", "tokenizers", "safetensors", "accelerate")
# Generation defaults of the pyfunc entry (a request's params override them): a policy's answer, not
# an echo of the prompt.
GENERATION_DEFAULTS = {"max_new_tokens": 256, "return_full_text": False}


def mlflow_available() -> bool:
    return importlib.util.find_spec("mlflow") is not None


def pinned_requirements(packages=SERVING_PACKAGES) -> list[str]:
    """``name==version`` of each installed package; a local version label (``2.13.0+cpu``) is dropped so
    an index can resolve the pin. Packages not installed are left out."""
    pins = []
    for package in packages:
        try:
            version = metadata.version(package)
        except metadata.PackageNotFoundError:
            continue
        pins.append(f"{package}=={re.sub(r'[+].*$', '', version)}")
    return pins


def write_mlmodel(folder: str | Path, tokenizer, dtype) -> Path | None:
    """Make the HF folder saved by ``save_hf`` an MLflow model: ``components/tokenizer/``, ``MLmodel`` and
    the environment files. Returns the MLmodel path, or None where MLflow is not installed."""
    from kfrl.models.hf_io import save_tokenizer

    if not mlflow_available():
        return None
    from mlflow import pyfunc
    from mlflow.models import Model, ModelSignature
    from mlflow.types import ColSpec, ParamSchema, ParamSpec, Schema

    folder = Path(folder)
    config = json.loads((folder / "config.json").read_text())
    save_tokenizer(tokenizer, folder / TOKENIZER_COMPONENT)
    transformers_version = metadata.version("transformers")
    signature = ModelSignature(
        inputs=Schema([ColSpec("string")]), outputs=Schema([ColSpec("string")]),
        params=ParamSchema([ParamSpec("max_new_tokens", "long", GENERATION_DEFAULTS["max_new_tokens"]),
                            ParamSpec("do_sample", "boolean", False),
                            ParamSpec("temperature", "double", 1.0)]))
    model = Model(signature=signature)
    flavor = {
        "code": None,
        "components": ["tokenizer"],
        "instance_type": "TextGenerationPipeline",
        "model_binary": ".",  # the folder itself: the weights are not copied
        "pipeline_model_type": (config.get("architectures") or ["AutoModelForCausalLM"])[0],
        "source_model_name": "",
        "task": "text-generation",
        "tokenizer_type": type(tokenizer).__name__,
        "torch_dtype": str(dtype),
    }
    if int(transformers_version.split(".")[0]) < 5:
        flavor["framework"] = "pt"  # transformers 4 pipelines take it; 5 refuses it
    model.add_flavor("transformers", transformers_version=transformers_version, **flavor)
    pyfunc.add_to_model(model, loader_module="mlflow.transformers", conda_env="conda.yaml",
                        python_env="python_env.yaml", model_config=dict(GENERATION_DEFAULTS))
    model.model_size_bytes = sum(p.stat().st_size for p in folder.rglob("*") if p.is_file())
    path = folder / MLMODEL_FILE
    model.save(str(path))
    write_environment(folder)
    return path


def write_environment(folder: Path) -> None:
    """requirements.txt, python_env.yaml and conda.yaml as MLflow's flavours write them (its environment
    writers; mlflow pinned to the running version)."""
    import yaml
    from mlflow.utils.environment import _mlflow_conda_env, _process_pip_requirements, _PythonEnv

    conda_env, pip_requirements, _constraints = _process_pip_requirements(pinned_requirements())
    (folder / "requirements.txt").write_text("\n".join(pip_requirements) + "\n")
    (folder / "conda.yaml").write_text(yaml.safe_dump(conda_env or _mlflow_conda_env(), default_flow_style=False))
    _PythonEnv.current().to_yaml(str(folder / "python_env.yaml"))
