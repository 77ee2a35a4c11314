import pytest

from kfrl.config import Config, ConfigError, load_config, nearest_key, valid_keys
from kfrl.driver.controller import resolve_resume


def test_defaults_validate_and_flatten():
    cfg = load_config()
    flat = cfg.flat()
    assert flat["actor.clip_ratio"] == 0.2
    assert flat["rollout.n"] == 4
    assert set(valid_keys()) == set(flat)


def test_yaml_and_overrides(tmp_path):
    path = tmp_path / "c.yaml"
    path.write_text("actor:\n  lr: 1.0e-5\nrollout:\n  n: 2\n")
    cfg = load_config(path, ["rollout.n=8", "actor.clip_ratio_high=0.28", "data.val_files=null", "actor.betas=[0.9, 0.95]"])
    assert cfg.actor.lr == 1e-5
    assert cfg.rollout.n == 8
    assert cfg.actor.clip_ratio_high == 0.28
    assert cfg.actor.betas == (0.9, 0.95)


@pytest.mark.parametrize("override, named, hint", [
    ("actor.clip_ration=0.3", "actor.clip_ration", "actor.clip_ratio"),
    ("rolout.n=3", "rolout.n", "rollout.n"),
    ("trainer.ppo_epochs=2", "trainer.ppo_epochs", "actor.ppo_epochs"),
])
def test_unknown_key_names_key_and_nearest(override, named, hint):
    with pytest.raises(ConfigError) as err:
        load_config(None, [override])
    assert f"'{named}'" in str(err.value)
    assert f"'{hint}'" in str(err.value)


def test_bad_value_names_key_and_value():
    with pytest.raises(ConfigError) as err:
        load_config(None, ["rollout.n=zero"])
    assert "rollout.n" in str(err.value) and "zero" in str(err.value)
    with pytest.raises(ConfigError) as err:
        load_config(None, ["actor.loss_agg_mode=token-summ"])
    assert "actor.loss_agg_mode" in str(err.value)


def test_batch_sizes_must_divide():
    with pytest.raises(ConfigError, match="multiple of actor.ppo_mini_batch_size"):
        load_config(None, ["data.train_batch_size=10", "actor.ppo_mini_batch_size=4"])


def test_missing_config_file(tmp_path):
    with pytest.raises(ConfigError, match="not found"):
        load_config(tmp_path / "nope.yaml")


def test_on_policy_shortcut_and_ref_plan():
    cfg = load_config(None, ["data.train_batch_size=8", "actor.ppo_mini_batch_size=8"])
    assert not cfg.recompute_old_logprobs and not cfg.use_ref
    cfg = load_config(None, ["data.train_batch_size=8", "actor.ppo_mini_batch_size=4", "actor.use_kl_loss=true"])
    assert cfg.recompute_old_logprobs and cfg.use_ref
    cfg = load_config(None, ["actor.ppo_epochs=2"])
    assert cfg.recompute_old_logprobs


def test_nearest_key_by_leaf():
    assert nearest_key("lr") == "actor.lr"


def test_resume_keeps_stored_algorithm_takes_new_execution_settings():
    stored = load_config(None, ["actor.lr=1e-5", "store.uri=/a"])
    given = load_config(None, ["actor.lr=3e-5", "store.uri=/b", "trainer.total_iterations=9"])
    merged, ignored = resolve_resume(stored, given, None)
    assert merged.actor.lr == 1e-5
    assert merged.store.uri == "/b"
    assert merged.trainer.total_iterations == 9
    assert ignored == ["actor.lr"]
    assert isinstance(merged, Config)


def test_config_reference_documents_every_key():
    from pathlib import Path

    text = Path(__file__).resolve().parents[1].joinpath("docs", "config.md").read_text()
    missing = [key for key in valid_keys() if f"`{key}`" not in text]
    assert not missing, f"docs/config.md lacks {missing}"
