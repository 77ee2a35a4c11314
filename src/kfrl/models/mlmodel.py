"""An MLflow ``MLmodel`` file for a policy checkpoint folder, written without importing MLflow (the
engine image may not have it), so the folder the store commits is itself an MLflow model:
``mlflow.transformers.load_model("models:/<name>/<version>")`` and ``mlflow.pyfunc.load_model`` read it,
and ``AutoModelForCausalLM.from_pretrained`` reads the same folder as a plain HF directory.

MLflow's transformers flavour expects the weights under ``model_binary`` (here ``.``, the folder itself:
no second copy of the weights) and each component under ``components/<name>/`` (the tokenizer files are
copied there; they are small).
"""
from __future__ import annotations

import json
import platform
import uuid
from datetime import datetime, timezone
from importlib import metadata
from pathlib import Path

MLMODEL_FILE = "MLmodel"
TOKENIZER_COMPONENT = "components/tokenizer"


def _version(package: str) -> str | None:
    try:
        return metadata.version(package)
    except metadata.PackageNotFoundError:
        return None


def write_mlmodel(folder: str | Path, tokenizer, dtype) -> Path:
    """Add ``MLmodel`` and ``components/tokenizer/`` to an HF model folder saved by ``save_hf``."""
    import yaml

    from kfrl.models.hf_io import save_tokenizer

    folder = Path(folder)
    config = json.loads((folder / "config.json").read_text())
    save_tokenizer(tokenizer, folder / TOKENIZER_COMPONENT)
    transformers_version = _version("transformers") or ""
    flavor = {
        "code": None,
        "components": ["tokenizer"],
        "instance_type": "TextGenerationPipeline",
        "model_binary": ".",
        "pipeline_model_type": (config.get("architectures") or ["AutoModelForCausalLM"])[0],
        "source_model_name": "",
        "task": "text-generation",
        "tokenizer_type": type(tokenizer).__name__,
        "torch_dtype": str(dtype),
        "transformers_version": transformers_version,
    }
    if transformers_version and int(transformers_version.split(".")[0]) < 5:
        flavor["framework"] = "pt"  # transformers 4 pipelines take it; 5 refuses it
    mlmodel = {
        "flavors": {
            "python_function": {"loader_module": "mlflow.transformers", "python_version": platform.python_version()},
            "transformers": flavor,
        },
        "model_uuid": uuid.uuid4().hex,
        "utc_time_created": datetime.now(timezone.utc).strftime("%Y-%m-%d %H:%M:%S.%f"),
        "signature": {"inputs": '[{"type": "string", "required": true}]',
                      "outputs": '[{"type": "string", "required": true}]', "params": None},
    }
    mlflow_version = _version("mlflow")
    if mlflow_version:
        mlmodel["mlflow_version"] = mlflow_version
    path = folder / MLMODEL_FILE
    path.write_text(yaml.safe_dump(mlmodel, sort_keys=True))
    return path
