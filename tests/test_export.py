"""`kfrl export`: a real tiny run (stages called directly) exported as a loadable HF directory."""
import json
import struct
from pathlib import Path

import pytest
import torch

from kfrl.config import load_config
from kfrl.export import PROVENANCE_FILE, ExportError, export_policy, find_run
from kfrl.stages import STAGES, run_stage
from kfrl.run import CRITIC_STAGE, POLICY_STAGE, Run, stage_prefix
from kfrl.stages.prepare import prepare_run
from kfrl.store import Store

SMALL = ["data.train_batch_size=4", "actor.ppo_mini_batch_size=2", "rollout.n=2", "data.max_response_length=8",
         "actor.ppo_micro_batch_size_per_gpu=8"]
TRAINING_STATE = ("optimizer.pt", "trainer_state.json")


def build_run(store_root: Path, experiment: str, run_id: str, iterations: int, extra=()) -> Store:
    cfg = load_config(None, SMALL + list(extra))
    store = Store(str(store_root / experiment / run_id))
    prepare_run(store, cfg)
    for iteration in range(1, iterations + 1):
        for stage in STAGES:
            run_stage(stage, store.uri, iteration)
        Run(store).set_latest(iteration)
    return store


@pytest.fixture(scope="module")
def grpo_run(tmp_path_factory) -> Store:
    """demo/r1: GRPO (no critic), one iteration; LATEST = 1."""
    return build_run(tmp_path_factory.mktemp("grpo") / "store", "demo", "r1", 1)


@pytest.fixture(scope="module")
def ppo_run(tmp_path_factory) -> Store:
    """ppo/r2: GAE with a critic warming up for one iteration (the actor's update of iteration 1 is skipped)."""
    return build_run(tmp_path_factory.mktemp("ppo") / "store", "ppo", "r2", 2,
                     ["algorithm.adv_estimator=gae", "trainer.critic_warmup=2",
                      "critic.ppo_micro_batch_size_per_gpu=8"])


def committed_bytes(store: Store, stage: str, iteration: int, name: str) -> bytes:
    manifest = store.manifest(stage_prefix(iteration, stage))
    return store.read_file(manifest, name)


def safetensors_dtypes(path: Path) -> set[str]:
    with open(path, "rb") as fh:
        (length,) = struct.unpack("<Q", fh.read(8))
        header = json.loads(fh.read(length))
    return {v["dtype"] for k, v in header.items() if k != "__metadata__"}


def load_state(path: Path) -> dict:
    from safetensors.torch import load_file

    return load_file(str(path))


def test_export_latest_is_a_loadable_hf_model_equal_to_the_checkpoint(grpo_run, tmp_path):
    from transformers import AutoModelForCausalLM, AutoTokenizer

    out = tmp_path / "export"
    result = export_policy(grpo_run.uri, out)

    assert result.path == out and result.iteration == 1 and result.checkpoint_iteration == 1
    assert result.model == "policy" and result.dtype is None and not result.notes
    assert result.source == grpo_run.url(stage_prefix(1, POLICY_STAGE))
    names = {p.name for p in out.iterdir()}
    assert {"config.json", "generation_config.json", "model.safetensors", "tokenizer_config.json",
            PROVENANCE_FILE} <= names
    assert not names & set(TRAINING_STATE)
    assert not [p for p in out.parent.iterdir() if p.name.startswith(".")], "temp folders left behind"
    # Byte for byte the committed weights.
    assert (out / "model.safetensors").read_bytes() == committed_bytes(grpo_run, POLICY_STAGE, 1, "model.safetensors")

    provenance = json.loads((out / PROVENANCE_FILE).read_text())
    manifest = grpo_run.manifest(stage_prefix(1, POLICY_STAGE))
    assert provenance["run_uri"] == grpo_run.uri and provenance["iteration"] == 1
    assert provenance["source_attempt"] == manifest.attempt == result.attempt
    assert provenance["created_at"]

    model = AutoModelForCausalLM.from_pretrained(out)
    tokenizer = AutoTokenizer.from_pretrained(out)
    expected = load_state(out / "model.safetensors")
    for name, tensor in model.state_dict().items():
        if name in expected:
            assert torch.equal(tensor, expected[name]), name
    prompt = tokenizer.apply_chat_template([{"role": "user", "content": "1+2="}], add_generation_prompt=True,
                                           tokenize=False)
    inputs = tokenizer(prompt, return_tensors="pt")
    generated = model.generate(**inputs, max_new_tokens=4, do_sample=False)
    assert generated.shape[1] > inputs["input_ids"].shape[1]


def test_iteration_zero_is_the_initial_model(grpo_run, tmp_path):
    from kfrl.models.tiny import materialize_builtin

    result = export_policy(grpo_run.uri, tmp_path / "init", iteration=0)
    assert result.iteration == 0 and result.checkpoint_iteration == 0
    initial = Path(materialize_builtin("builtin:tiny-qwen2-arith"))
    for name in ("model.safetensors", "config.json", "tokenizer.json"):
        assert (tmp_path / "init" / name).read_bytes() == (initial / name).read_bytes(), name
    # It came from iteration 0's commit (one tiny GRPO iteration may leave the weights unchanged:
    # equal rewards in every group give zero advantages, so the bytes cannot tell the two apart).
    assert result.source == grpo_run.url(stage_prefix(0, POLICY_STAGE))
    assert result.attempt == grpo_run.manifest(stage_prefix(0, POLICY_STAGE)).attempt
    assert json.loads((tmp_path / "init" / PROVENANCE_FILE).read_text())["iteration"] == 0


def test_missing_iteration_names_the_iterations_there_are(grpo_run, tmp_path):
    with pytest.raises(ExportError, match=r"iteration 7 is not committed.*iterations 0\.\.1"):
        export_policy(grpo_run.uri, tmp_path / "x", iteration=7)
    with pytest.raises(ExportError, match="whole number"):
        export_policy(grpo_run.uri, tmp_path / "x", iteration=-1)
    assert not (tmp_path / "x").exists()


def test_no_completed_iteration(tmp_path):
    store = Store(str(tmp_path / "store" / "demo" / "fresh"))
    prepare_run(store, load_config(None, SMALL))
    with pytest.raises(ExportError, match="no completed iteration"):
        export_policy(store.uri, tmp_path / "x")
    assert export_policy(store.uri, tmp_path / "x", iteration=0).iteration == 0


def test_find_run(grpo_run, tmp_path):
    store_root = str(Path(grpo_run.uri).parents[1])
    assert find_run(store_root, "r1") == grpo_run.uri
    assert find_run(store_root, "r1", experiment="demo") == grpo_run.uri
    assert find_run(store_root, "demo/r1") == grpo_run.uri
    with pytest.raises(ExportError, match=r"no run 'nope'.*demo/r1"):
        find_run(store_root, "nope")
    with pytest.raises(ExportError, match=r"--experiment demo"):
        find_run(store_root, "r1", experiment="other")
    with pytest.raises(ExportError, match="no runs"):
        find_run(str(tmp_path / "empty"), "r1")


def test_find_run_with_the_same_id_in_two_experiments_asks_for_one(tmp_path):
    cfg = load_config(None, SMALL)
    for experiment in ("a", "b"):
        Store(str(tmp_path / experiment / "same")).write_text("config.yaml", cfg.to_yaml())
    with pytest.raises(ExportError, match=r"several experiments.*a/same, b/same.*--experiment"):
        find_run(str(tmp_path), "same")
    assert find_run(str(tmp_path), "same", "b") == str(tmp_path / "b" / "same")


def test_target_must_be_empty_unless_overwrite(grpo_run, tmp_path):
    target = tmp_path / "busy"
    target.mkdir()
    (target / "keep.txt").write_text("mine")
    with pytest.raises(ExportError, match="not empty"):
        export_policy(grpo_run.uri, target)
    assert [p.name for p in target.iterdir()] == ["keep.txt"]

    export_policy(grpo_run.uri, target, overwrite=True)
    assert not (target / "keep.txt").exists() and (target / "model.safetensors").is_file()
    assert [p.name for p in tmp_path.iterdir()] == ["busy"]

    empty = tmp_path / "empty"
    empty.mkdir()
    export_policy(grpo_run.uri, empty)
    assert (empty / "config.json").is_file()


def test_a_failed_export_leaves_nothing(grpo_run, tmp_path, monkeypatch):
    import kfrl.export as export

    def boom(*args, **kwargs):
        raise RuntimeError("disk on fire")

    monkeypatch.setattr(export, "_resave", boom)
    with pytest.raises(RuntimeError, match="disk on fire"):
        export_policy(grpo_run.uri, tmp_path / "out", dtype="bfloat16")
    assert list(tmp_path.iterdir()) == []


def test_dtype_bfloat16_resaves_in_bf16(grpo_run, tmp_path):
    from transformers import AutoModelForCausalLM, AutoTokenizer

    out = tmp_path / "bf16"
    result = export_policy(grpo_run.uri, out, dtype="bf16")
    assert result.dtype == "bfloat16"
    assert safetensors_dtypes(out / "model.safetensors") == {"BF16"}
    assert not {p.name for p in out.iterdir()} & set(TRAINING_STATE)
    assert json.loads((out / PROVENANCE_FILE).read_text())["dtype"] == "bfloat16"
    # The tokenizer files are the checkpoint's, untouched.
    assert (out / "tokenizer.json").read_bytes() == committed_bytes(grpo_run, POLICY_STAGE, 1, "tokenizer.json")

    exported = load_state(out / "model.safetensors")
    committed = tmp_path / "fp32"
    export_policy(grpo_run.uri, committed)
    for name, tensor in load_state(committed / "model.safetensors").items():
        assert torch.equal(exported[name], tensor.to(torch.bfloat16)), name

    model = AutoModelForCausalLM.from_pretrained(out, dtype="auto")
    assert model.dtype == torch.bfloat16
    AutoTokenizer.from_pretrained(out)

    with pytest.raises(ExportError, match="not supported"):
        export_policy(grpo_run.uri, tmp_path / "x", dtype="int8")


def test_critic_export_needs_a_critic(grpo_run, tmp_path):
    with pytest.raises(ExportError, match="no critic"):
        export_policy(grpo_run.uri, tmp_path / "critic", critic=True)
    assert not (tmp_path / "critic").exists()


def test_skipped_update_exports_the_checkpoint_in_force(ppo_run, tmp_path):
    result = export_policy(ppo_run.uri, tmp_path / "it1", iteration=1)
    assert result.iteration == 1 and result.checkpoint_iteration == 0
    assert any("skipped" in note and "warm-up" in note for note in result.notes)
    assert result.source == ppo_run.url(stage_prefix(0, POLICY_STAGE))
    assert (tmp_path / "it1" / "model.safetensors").read_bytes() == committed_bytes(
        ppo_run, POLICY_STAGE, 0, "model.safetensors")
    assert json.loads((tmp_path / "it1" / PROVENANCE_FILE).read_text())["checkpoint_iteration"] == 0

    latest = export_policy(ppo_run.uri, tmp_path / "latest")
    assert latest.iteration == latest.checkpoint_iteration == 2 and not latest.notes


def test_critic_export_is_a_token_classification_value_model(ppo_run, tmp_path):
    from transformers import AutoModelForTokenClassification, AutoTokenizer

    from kfrl.models.hf_io import load_value_model
    from kfrl.stages.context import StageContext

    result = export_policy(ppo_run.uri, tmp_path / "critic", critic=True)
    assert result.model == "critic" and result.iteration == 2
    assert result.source == ppo_run.url(stage_prefix(2, CRITIC_STAGE))
    out = tmp_path / "critic"
    assert not {p.name for p in out.iterdir()} & set(TRAINING_STATE)
    assert (out / "model.safetensors").read_bytes() == committed_bytes(ppo_run, CRITIC_STAGE, 2, "model.safetensors")
    model = AutoModelForTokenClassification.from_pretrained(out)
    assert model.config.num_labels == 1
    AutoTokenizer.from_pretrained(out)

    # Iteration 0: the critic starts from the initial policy with a value head seeded by trainer.seed,
    # which the export materialises exactly as the stages build it.
    init = export_policy(ppo_run.uri, tmp_path / "critic0", critic=True, iteration=0)
    assert init.checkpoint_iteration == 0 and any("value head" in note for note in init.notes)
    exported = AutoModelForTokenClassification.from_pretrained(tmp_path / "critic0")
    ctx = StageContext.open(ppo_run.uri, 1)
    reference = load_value_model(ctx.checkpoint_dir(ctx.policy_manifest(0)), head_seed=ctx.config.trainer.seed)
    exported_state = exported.state_dict()
    for name, tensor in reference.state_dict().items():
        assert torch.equal(exported_state[name], tensor), name


def test_export_from_s3(grpo_run, s3_bucket, s3_server, tmp_path):
    """The same run, copied into an S3 bucket (moto), found and exported from there; plus a run whose
    initial model is referenced in place on S3 rather than copied into the run."""
    import boto3

    s3 = boto3.client("s3", endpoint_url=s3_server)
    local_root = Path(grpo_run.uri).parents[1]
    for path in local_root.rglob("*"):
        if path.is_file():
            s3.upload_file(str(path), s3_bucket, f"store/{path.relative_to(local_root).as_posix()}")
    store_uri = f"s3://{s3_bucket}/store"

    run_uri = find_run(store_uri, "r1")
    assert run_uri == f"{store_uri}/demo/r1"
    result = export_policy(run_uri, tmp_path / "from-s3")
    assert result.iteration == 1 and result.source == f"{run_uri}/iter-000001/update_actor"
    assert (tmp_path / "from-s3" / "model.safetensors").read_bytes() == committed_bytes(
        grpo_run, POLICY_STAGE, 1, "model.safetensors")
    assert not {p.name for p in (tmp_path / "from-s3").iterdir()} & set(TRAINING_STATE)
    with pytest.raises(ExportError, match=r"iteration 3 is not committed.*0\.\.1"):
        export_policy(run_uri, tmp_path / "x", iteration=3)

    # An initial model referenced in place: model.path names an HF directory in the bucket.
    from kfrl.models.tiny import materialize_builtin

    initial = Path(materialize_builtin("builtin:tiny-qwen2-arith"))
    for path in initial.iterdir():
        s3.upload_file(str(path), s3_bucket, f"models/tiny/{path.name}")
    in_place = Store(f"{store_uri}/demo/r3")
    prepare_run(in_place, load_config(None, SMALL + [f"model.path=s3://{s3_bucket}/models/tiny"]))
    assert not in_place.manifest(stage_prefix(0, POLICY_STAGE)).files
    result = export_policy(find_run(store_uri, "r3"), tmp_path / "in-place", iteration=0)
    assert result.source == f"s3://{s3_bucket}/models/tiny"
    for path in initial.iterdir():
        assert (tmp_path / "in-place" / path.name).read_bytes() == path.read_bytes(), path.name
