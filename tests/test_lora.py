"""LoRA (model.lora_rank > 0, critic.lora_rank > 0): the training copy is the frozen base with peft's
adapters; an update is the low-rank step; rollout and log-prob copies hold base + (alpha/r) B A; the
reference is the base (the training copy with its adapters off, where a process holds it); commits
hold the adapter only; resume and kills are exact; exports and registered versions load."""
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file

from kfrl import stages
from kfrl.config import load_config
from kfrl.driver.controller import train
from kfrl.models.hf_io import load_causal_lm
from kfrl.models.lora import (ADAPTER_CONFIG, ADAPTER_WEIGHTS, MERGED_FOLDER, LoraSpec, add_adapters, adapter_state,
                              merge_into, merged_state)
from kfrl.models.tiny import materialize_builtin
from kfrl.run import Run
from kfrl.stages import STAGES, context
from run_tables import committed_tables, demo_config, forget_process_state

SMALL = ["data.train_batch_size=4", "actor.ppo_mini_batch_size=4", "rollout.n=4", "data.max_response_length=16",
         "actor.ppo_micro_batch_size_per_gpu=8", "trainer.log_generations=0", "trainer.val_before_train=false",
         "pipeline.runner=inline", "trainer.test_freq=-1", "data.builtin_val_size=8"]
LORA = ["model.lora_rank=4", "model.lora_alpha=8", "actor.lr=5e-3", "actor.use_kl_loss=true"]
TARGET = "model.layers.0.self_attn.q_proj.weight"


def config(root: Path, *extra):
    return demo_config(root, *SMALL + LORA, *extra)


def tiny(dtype=torch.float64):
    return load_causal_lm(materialize_builtin("builtin:tiny-qwen2-arith"), dtype=dtype)


def with_trained_adapter(spec=LoraSpec(rank=4, alpha=8.0), seed=3):
    """A LoRA copy of the tiny model (float64) whose B factors are non-zero, as after some training."""
    model = add_adapters(tiny(), spec, seed=seed)
    for param in model.parameters():
        if param.requires_grad:
            param.data = param.data.double()
    generator = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for name, param in model.named_parameters():
            if "lora_B" in name:
                param.copy_(torch.randn(param.shape, generator=generator, dtype=param.dtype) * 0.05)
    return model


def factors(model, weight_name: str):
    """(W, A, B) of one adapted weight of a PEFT model."""
    module = model.get_base_model().get_submodule(weight_name.removesuffix(".weight"))
    return module.base_layer.weight, module.lora_A["default"].weight, module.lora_B["default"].weight


def test_a_lora_step_is_the_hand_computed_low_rank_update():
    from kfrl.stages.update import make_optimizer

    model = with_trained_adapter()
    spec_scaling = 8.0 / 4
    ids = torch.randint(0, 100, (2, 12), generator=torch.Generator().manual_seed(0))
    weights = torch.randn(2, 12, model.config.vocab_size, generator=torch.Generator().manual_seed(1), dtype=torch.float64)
    # The gradient of the loss with respect to the merged weight, from a plain model holding it.
    plain = tiny()
    plain.load_state_dict(merged_state(model))
    (plain(input_ids=ids).logits * weights).sum().backward()
    grad_w = dict(plain.named_parameters())[TARGET].grad
    w0, a0, b0 = (t.detach().clone() for t in factors(model, TARGET))
    # d/dB = s G A^T and d/dA = s B^T G: the chain rule through W + s B A.
    (model(input_ids=ids).logits * weights).sum().backward()
    _, a, b = factors(model, TARGET)
    torch.testing.assert_close(b.grad, spec_scaling * grad_w @ a0.T, rtol=1e-9, atol=1e-12)
    torch.testing.assert_close(a.grad, spec_scaling * b0.T @ grad_w, rtol=1e-9, atol=1e-12)
    assert all(p.grad is None for p in model.parameters() if not p.requires_grad)  # the base is frozen

    cfg = load_config(None, ["actor.lr=1e-2", "actor.weight_decay=0.1"])
    optimizer = make_optimizer(model, cfg.actor)
    assert {id(p) for g in optimizer.param_groups for p in g["params"]} == \
        {id(p) for p in model.parameters() if p.requires_grad}
    optimizer.step()
    # AdamW's first step: x (1 - lr wd) - lr g / (|g| + eps) (bias corrections cancel).
    lr, wd, eps = 1e-2, 0.1, 1e-8
    b1 = b0 * (1 - lr * wd) - lr * b.grad / (b.grad.abs() + eps)
    a1 = a0 * (1 - lr * wd) - lr * a.grad / (a.grad.abs() + eps)
    torch.testing.assert_close(merged_state(model)[TARGET], w0 + spec_scaling * b1 @ a1, rtol=1e-9, atol=1e-12)
    assert torch.equal(factors(model, TARGET)[0], w0)  # the base weight itself never changes


def test_adapters_off_are_the_base_and_every_merged_copy_is_base_plus_adapter():
    model = with_trained_adapter()
    base = tiny()
    ids = torch.randint(0, 100, (2, 12), generator=torch.Generator().manual_seed(0))
    with torch.no_grad():
        with model.disable_adapter():
            assert torch.equal(model(input_ids=ids).logits, base(input_ids=ids).logits)
        # By hand: W + (alpha / r) B A for every adapted weight; everything else is the base's.
        expected = dict(base.state_dict())
        adapted = [n for n, _ in model.get_base_model().named_modules() if hasattr(_, "lora_A")]
        assert len(adapted) == 7 * model.config.num_hidden_layers  # all-linear: q k v o gate up down
        for name in adapted:
            w, a, b = factors(model, f"{name}.weight")
            expected[f"{name}.weight"] = w + 2.0 * b @ a
        merged = merged_state(model)
        assert merged.keys() == expected.keys()
        for name, tensor in expected.items():
            torch.testing.assert_close(merged[name], tensor, rtol=1e-12, atol=1e-14)
        # The copies an update hands to inference (HF and the torch decoder) hold exactly those weights,
        # and so does the base with a saved adapter merged into it (another process's load).
        copy = context._inference_copy("policy", model, torch.float64)
        assert all(torch.equal(copy.state_dict()[n], merged[n]) for n in merged)
        torch.testing.assert_close(copy(input_ids=ids).logits, model(input_ids=ids).logits, rtol=1e-9, atol=1e-9)
        loaded = tiny()
        merge_into(loaded, adapter_state(model), 2.0)
        for name, tensor in loaded.state_dict().items():
            torch.testing.assert_close(tensor, merged[name], rtol=1e-12, atol=1e-14)


def storage(t: torch.Tensor) -> tuple:
    return t.device.type, t.untyped_storage().data_ptr()


def sampled(decoder, tokenizer, seed: int = 5):
    from kfrl.engines.rollout import SamplingParams
    from kfrl.engines.rollout_torch import TorchRollout

    prompts = [tokenizer.encode(text) for text in ("12+7=", "3*4=", "100-58=", "9+9+9=")]
    engine = TorchRollout(decoder, {tokenizer.eos_token_id}, tokenizer.pad_token_id)
    return engine.generate_responses(prompts, SamplingParams(n=2, max_new_tokens=12, temperature=1.3), seed=seed)


@pytest.mark.parametrize("targets", ["all-linear", ("q_proj", "v_proj", "up_proj")])
def test_the_rollout_decoder_of_a_lora_copy_shares_its_base_and_samples_base_plus_adapter(targets):
    """The torch decoder an update hands to the rollout adds no copy of the frozen base: it holds views
    of the base's own memory plus the low-rank factors, and samples what a decoder of the merged
    weights samples (float64: the same tokens, log-probs to 1e-9). A process that loads the saved
    adapter over the base builds the same decoder, tensor for tensor."""
    from kfrl.engines.decoder import Decoder, LowRank
    from kfrl.models.hf_io import load_tokenizer
    from kfrl.models.lora import decoder_over_base

    model = with_trained_adapter(LoraSpec(rank=4, alpha=8.0, target_modules=targets))
    ids = torch.randint(0, 100, (2, 12), generator=torch.Generator().manual_seed(0))
    with torch.no_grad():
        before = model(input_ids=ids).logits
        decoder = context._inference_copy("decoder", model, torch.float64)
        assert torch.equal(model(input_ids=ids).logits, before)  # the base moved in memory, not in value

    base_storages = {storage(p) for n, p in model.named_parameters() if not p.requires_grad}
    factors = {id(t) for b in decoder.blocks for f in ("qkv_lora", "o_lora", "gate_up_lora", "down_lora")
               if isinstance(getattr(b, f), LowRank) for t in (getattr(b, f).down, getattr(b, f).up)}
    own = [t for t in decoder.tensors() if id(t) not in factors and storage(t) not in base_storages]
    assert own == [], [tuple(t.shape) for t in own]
    assert sum(t.numel() for t in decoder.tensors() if id(t) in factors) < 0.2 * sum(
        p.numel() for p in model.parameters())
    block = decoder.blocks[0]
    assert block.qkv_weight.data_ptr() == factors_of(model, "model.layers.0.self_attn.q_proj.weight").data_ptr()

    tokenizer = load_tokenizer(materialize_builtin("builtin:tiny-qwen2-arith"))
    plain = tiny()
    plain.load_state_dict(merged_state(model))
    ours, merged = sampled(decoder, tokenizer), sampled(Decoder.from_hf_model(plain), tokenizer)
    assert [g.response_ids for g in ours] == [g.response_ids for g in merged]
    for a, b in zip(ours, merged):
        torch.testing.assert_close(torch.tensor(a.rollout_logprobs), torch.tensor(b.rollout_logprobs),
                                   rtol=0, atol=1e-9)
    assert sum(len(g.response_ids) for g in ours) > 8 * 4  # the adapters were exercised over many steps

    loaded = decoder_over_base(tiny(), adapter_state(model), 2.0, torch.float64)
    assert all(torch.equal(x, y) for x, y in zip(loaded.tensors(), decoder.tensors()))
    assert [g.response_ids for g in sampled(loaded, tokenizer)] == [g.response_ids for g in ours]


def factors_of(model, weight_name: str) -> torch.Tensor:
    return factors(model, weight_name)[0]


def test_a_registered_versions_merged_weights_leave_the_device_one_at_a_time(monkeypatch):
    """The merged model of an iteration that registers a version is built weight by weight into host
    memory: when a merged weight is computed, no earlier one is still held (a whole merged state on the
    accelerator is another base: an out-of-memory at exactly the iterations that register). Values and
    tied tensors are merged_state's."""
    import weakref

    from kfrl.models import lora
    from kfrl.models.lora import merged_state_on_host

    model = with_trained_adapter()
    computed, alive_at_each = [], []
    merge = lora.merged_weight

    def tracked(*args):
        alive_at_each.append(sum(ref() is not None for ref in computed))
        result = merge(*args)
        computed.append(weakref.ref(result))
        return result

    monkeypatch.setattr(lora, "merged_weight", tracked)
    on_host = merged_state_on_host(model, torch.float32)
    assert len(alive_at_each) == 7 * model.config.num_hidden_layers and max(alive_at_each) == 0
    monkeypatch.setattr(lora, "merged_weight", merge)
    expected = merged_state(model, torch.float32)
    assert on_host.keys() == expected.keys()
    assert all(torch.equal(on_host[k], expected[k]) for k in expected)
    if model.config.tie_word_embeddings:
        assert on_host["lm_head.weight"] is on_host["model.embed_tokens.weight"]
    # merged_state itself holds them all at once: what the check above would catch.
    alive_at_each.clear(), computed.clear()
    monkeypatch.setattr(lora, "merged_weight", tracked)
    merged_state(model)
    assert max(alive_at_each) > 1


def test_only_frozen_weights_are_laid_back_to_back_unless_the_caller_says_trained():
    from kfrl.engines.decoder import lay_back_to_back

    model = tiny()
    params = dict(model.named_parameters())
    with pytest.raises(ValueError, match="q_proj.weight is trained"):
        lay_back_to_back(params, model.config.num_hidden_layers)
    model.requires_grad_(False)
    layers = model.config.num_hidden_layers
    assert lay_back_to_back(params, layers) == 3 * layers  # q/k/v weights, q/k/v biases, gate/up
    assert lay_back_to_back(params, layers) == 0


def test_a_training_copy_laid_out_for_the_decoder_trains_as_before_and_the_decoder_views_its_weights():
    from kfrl.engines.decoder import Decoder
    from kfrl.stages.update import share_with_decoder

    torch.manual_seed(0)
    model, plain = tiny(), tiny()
    plain.load_state_dict(model.state_dict())
    before = {name: p for name, p in model.named_parameters()}
    assert share_with_decoder(model) == 3 * model.config.num_hidden_layers
    assert all(p is before[name] for name, p in model.named_parameters())  # same parameters, moved memory
    ids = torch.randint(0, model.config.vocab_size, (2, 7))
    for trained in (model, plain):
        optimizer = torch.optim.AdamW(trained.parameters(), lr=1e-2)
        trained(input_ids=ids, labels=ids).loss.backward()
        optimizer.step()
    assert all(torch.equal(a, b) for a, b in zip(model.state_dict().values(), plain.state_dict().values()))
    decoder = Decoder.from_hf_model(model)
    attn = model.model.layers[1].self_attn
    assert decoder.blocks[1].qkv_weight.data_ptr() == attn.q_proj.weight.data_ptr()
    assert decoder.blocks[1].gate_up_weight.data_ptr() == model.model.layers[1].mlp.gate_proj.weight.data_ptr()
    with torch.no_grad():
        attn.k_proj.weight.add_(1.0)  # what the next update's step does in place: the decoder sees it
    assert torch.equal(decoder.blocks[1].qkv_weight[attn.q_proj.weight.shape[0]:][:attn.k_proj.weight.shape[0]],
                       attn.k_proj.weight)


def test_compiled_blocks_over_a_laid_out_training_copy_give_the_eager_gradients_and_keep_it_shared():
    """actor.use_torch_compile with the decoder sharing the training copy (bf16 master weights on CUDA):
    the compiled blocks take q/k/v and gate/up weights that are views of one buffer."""
    from kfrl.stages.update import compile_layers, share_with_decoder

    torch.manual_seed(0)
    model, plain = tiny().double(), tiny().double()
    plain.load_state_dict(model.state_dict())
    share_with_decoder(model)
    assert compile_layers(model, backend="aot_eager") == model.config.num_hidden_layers
    for trained in (model, plain):
        trained.gradient_checkpointing_enable()
        ids = torch.randint(0, trained.config.vocab_size, (3, 11), generator=torch.Generator().manual_seed(1))
        trained(input_ids=ids, labels=ids).loss.backward()
    grads = {name: p.grad for name, p in plain.named_parameters()}
    for name, param in model.named_parameters():
        torch.testing.assert_close(param.grad, grads[name], rtol=1e-9, atol=1e-12, msg=name)
    torch.optim.AdamW(model.parameters(), lr=1e-2).step()
    attn = model.model.layers[0].self_attn
    assert attn.k_proj.weight.data_ptr() == attn.q_proj.weight.data_ptr() + attn.q_proj.weight.nbytes


def adapter(run: Run, stage: str, iteration: int) -> dict[str, torch.Tensor]:
    return load_file(run.store.committed_dir(run.manifest(stage, iteration)) / ADAPTER_WEIGHTS)


def test_a_lora_run_commits_adapters_and_in_memory_equals_loading_from_the_store(tmp_path, monkeypatch):
    """PPO with both roles on LoRA. The inline runner's process keeps the training copies (the reference
    is the actor's copy with adapters off, rollout and log-prob copies get merged weights handed over);
    a run whose every stage loads from the store (base + committed adapter) commits the same tables."""
    ppo = ["algorithm.adv_estimator=gae", "critic.lora_rank=2", "critic.lora_alpha=4", "critic.lr=1e-3"]
    forget_process_state()
    run = Run.at(train(config(tmp_path / "a", *ppo), run_id="a", iterations=3).run_uri)
    for stage in ("update_actor", "update_critic"):
        for iteration in (1, 2, 3):
            commit = run.manifest(stage, iteration)
            assert commit.info["adapter"] is True
            assert {ADAPTER_CONFIG, ADAPTER_WEIGHTS, "config.json", "tokenizer.json"} <= set(commit.names())
            # No base weights beside the adapter (the last iteration registers a version: merged/ holds it).
            assert "model.safetensors" not in commit.names()
            assert any(n.startswith(f"{MERGED_FOLDER}/") for n in commit.names()) == (stage == "update_actor"
                                                                                      and iteration == 3)
    assert any(k.endswith("score.weight") for k in adapter(run, "update_critic", 2))  # the value head, whole
    assert not any("score" in k for k in adapter(run, "update_actor", 2))
    state = run.manifest("actor_state", 3)
    assert {ADAPTER_WEIGHTS, "optimizer.pt"} <= set(state.names()) and "model.safetensors" not in state.names()
    assert [run.manifest("update_actor", i).info["trainer_from"] for i in (1, 2, 3)] == ["store", "memory", "memory"]
    # It learns: the adapter moves, and the KL to the reference (the base) grows from 0.
    assert not torch.equal(adapter(run, "update_actor", 1)[f"base_model.model.{TARGET[:-7]}.lora_B.weight"],
                           adapter(run, "update_actor", 3)[f"base_model.model.{TARGET[:-7]}.lora_B.weight"])
    assert run.manifest("update_actor", 3).metrics["actor/kl_loss"] > 0

    original = stages.run_stage

    def stage_in_a_fresh_process(*args):
        result = original(*args)
        forget_process_state()
        return result

    monkeypatch.setattr(stages, "run_stage", stage_in_a_fresh_process)
    loaded = Run.at(train(config(tmp_path / "b", *ppo, "trainer.trainer_state_freq=1"), run_id="b",
                          iterations=3).run_uri)
    assert loaded.manifest("update_actor", 3).info["trainer_from"] == "store"
    expected, found = committed_tables(loaded, (1, 2, 3)), committed_tables(run, (1, 2, 3))
    assert sorted(found) == sorted(expected)
    for key, table in expected.items():
        assert found[key].equals(table), key
    for stage in ("update_actor", "update_critic"):
        a, b = adapter(run, stage, 3), adapter(loaded, stage, 3)
        assert a.keys() == b.keys() and all(torch.equal(a[k], b[k]) for k in a)


def test_a_lost_lora_trainer_state_is_rebuilt_exactly(tmp_path):
    forget_process_state()
    reference = Run.at(train(config(tmp_path / "a"), run_id="a", iterations=3).run_uri)
    forget_process_state()
    run = Run.at(train(config(tmp_path / "b"), run_id="b", iterations=2).run_uri)
    run.store.remove_commit("iter-000002/actor_state")  # the process died while writing it
    before = {stage: run.manifest(stage, 2).attempt for stage in STAGES}
    forget_process_state()
    train(config(tmp_path / "b"), run_id="b", iterations=3)
    assert run.manifest("update_actor", 3).info["trainer_from"] == "rebuilt"
    assert {stage: run.manifest(stage, 2).attempt for stage in STAGES} == before
    for stage in ("update_actor", "actor_state"):
        a, b = adapter(reference, stage, 3), adapter(run, stage, 3)
        assert a.keys() == b.keys() and all(torch.equal(a[k], b[k]) for k in a)


def test_exports_and_the_registered_version_of_a_lora_run_load(tmp_path):
    import mlflow
    from peft import PeftModel
    from transformers import AutoModelForCausalLM

    from kfrl.export import ExportError, export_policy

    forget_process_state()
    cfg = config(tmp_path, "trainer.save_freq=2")
    summary = train(cfg, run_id="r", iterations=3)
    run = Run.at(summary.run_uri)
    # Iterations that register a version (2 and the last) carry the merged model as an MLflow model.
    assert f"{MERGED_FOLDER}/MLmodel" in run.manifest("update_actor", 2).names()
    assert not any(n.startswith(MERGED_FOLDER) for n in run.manifest("update_actor", 1).names())
    mlflow.set_tracking_uri(cfg.tracking.uri)
    version = summary.registered_versions[2]
    served = mlflow.artifacts.download_artifacts(f"models:/{cfg.registered_model_name}/{version}",
                                                 dst_path=str(tmp_path / "dl"))
    registered = AutoModelForCausalLM.from_pretrained(served, dtype=torch.float32)

    merged = export_policy(run.uri, tmp_path / "merged", iteration=2)  # the registered folder, as committed
    built = export_policy(run.uri, tmp_path / "built", iteration=3)  # merged here from base + adapter
    peft_dir = export_policy(run.uri, tmp_path / "adapter", iteration=3, adapter=True)
    assert merged.source.endswith(MERGED_FOLDER) and sorted(peft_dir.files) == sorted(
        [ADAPTER_CONFIG, ADAPTER_WEIGHTS, "kfrl_export.json", "tokenizer.json", "tokenizer_config.json"])
    with pytest.raises(ExportError, match="no LoRA adapter"):
        export_policy(run.uri, tmp_path / "base", iteration=0, adapter=True)

    ids = torch.randint(0, 100, (2, 10), generator=torch.Generator().manual_seed(0))
    base = AutoModelForCausalLM.from_pretrained(materialize_builtin("builtin:tiny-qwen2-arith"), dtype=torch.float32)
    with torch.no_grad():
        from_registry = registered(input_ids=ids).logits
        torch.testing.assert_close(
            AutoModelForCausalLM.from_pretrained(merged.path, dtype=torch.float32)(input_ids=ids).logits, from_registry,
            rtol=0, atol=0)
        with_adapter = PeftModel.from_pretrained(base, peft_dir.path)(input_ids=ids).logits
        from_export = AutoModelForCausalLM.from_pretrained(built.path, dtype=torch.float32)(input_ids=ids).logits
    torch.testing.assert_close(from_export, with_adapter, rtol=1e-4, atol=1e-5)
    assert not torch.allclose(from_export, from_registry)  # iteration 3 is not iteration 2
