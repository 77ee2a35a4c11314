"""Passes over whole sequences (log-probs, the update, values, reward-model scores) build no KV cache.

transformers builds one whenever ``config.use_cache`` is on and gradient checkpointing is not: each
layer's keys and values copied into it and, without gradients, all layers' held until the pass returns.
Each test watches what every decoder layer is handed and fails if a cache reaches any of them.
"""
from __future__ import annotations

import pytest
import torch
from transformers import (AutoTokenizer, Qwen2Config, Qwen2ForCausalLM, Qwen2ForSequenceClassification,
                          Qwen2ForTokenClassification)

from kfrl.config import load_config
from kfrl.engines.actor import update_actor
from kfrl.engines.critic import compute_values, update_critic
from kfrl.engines.inference import compute_token_stats
from kfrl.stages.update import make_optimizer
from kfrl.trajectory import Trajectories

CONFIG = dict(hidden_size=32, intermediate_size=64, num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2,
              vocab_size=64, max_position_embeddings=64, use_cache=True)


class CacheWatch:
    """Records, per decoder-layer call, whether a KV cache came with it."""

    def __init__(self, model):
        self.calls: list[bool] = []
        for layer in model.get_decoder().layers:
            layer.register_forward_pre_hook(self._seen, with_kwargs=True)

    def _seen(self, _module, args, kwargs):
        cache = kwargs.get("cache", kwargs.get("past_key_values"))
        self.calls.append(cache is not None)

    def assert_none(self):
        assert self.calls, "no decoder layer ran: the watch is not on the model the pass used"
        assert not any(self.calls), f"{sum(self.calls)} of {len(self.calls)} layer calls were handed a KV cache"


def batch(rows: int = 4, fields: dict | None = None) -> Trajectories:
    g = torch.Generator().manual_seed(0)
    prompts = torch.randint(3, 64, (rows, 5), generator=g).tolist()
    responses = torch.randint(3, 64, (rows, 6), generator=g).tolist()
    return Trajectories.from_lists(prompts, responses, pad_id=0, fields=fields or {})


def test_log_prob_pass_builds_no_cache():
    torch.manual_seed(0)
    model = Qwen2ForCausalLM(Qwen2Config(**CONFIG)).eval()
    watch = CacheWatch(model)
    compute_token_stats(model, batch(), temperature=1.0, micro_batch_size=2, with_entropy=True)
    watch.assert_none()


@pytest.mark.parametrize("lora", [False, True], ids=["full", "lora"])
def test_update_without_checkpointing_builds_no_cache(lora):
    torch.manual_seed(0)
    model = Qwen2ForCausalLM(Qwen2Config(**CONFIG))
    overrides = ["actor.lr=1e-3", "actor.ppo_micro_batch_size_per_gpu=2"]
    if lora:
        from kfrl.models.lora import add_adapters, lora_spec

        cfg = load_config(None, overrides + ["model.lora_rank=4"])
        model = add_adapters(model, lora_spec(cfg.model), seed=0)
    else:
        cfg = load_config(None, overrides)
    watch = CacheWatch(model)
    before = [p.detach().clone() for p in model.parameters() if p.requires_grad]
    update_actor(model, make_optimizer(model, cfg.actor), batch(fields={"advantages": [[1.0] * 6, [-1.0] * 6] * 2}),
                 cfg.actor, mini_batch_size=4, temperature=1.0)
    watch.assert_none()
    after = [p for p in model.parameters() if p.requires_grad]
    assert any(not torch.equal(a, b) for a, b in zip(after, before)), "the update changed nothing"


def test_value_passes_build_no_cache():
    torch.manual_seed(0)
    critic = Qwen2ForTokenClassification(Qwen2Config(num_labels=1, **CONFIG))
    watch = CacheWatch(critic.model)
    trajectories = batch(fields={"returns": [[0.5] * 6] * 4})
    values = compute_values(critic.eval(), trajectories, micro_batch_size=2)
    assert values.shape == (4, 6)
    cfg = load_config(None, [])
    trajectories = batch(fields={"returns": [[0.5] * 6] * 4, "values": values.tolist()})
    update_critic(critic.train(), make_optimizer(critic, cfg.critic), trajectories, mini_batch_size=4,
                  micro_batch_size=2, epochs=1, shuffle=False, grad_clip=1.0, cliprange_value=0.5,
                  loss_agg_mode="token-mean")
    watch.assert_none()


def test_reward_model_scores_build_no_cache(tiny_tokenizer_dir):
    from kfrl.engines.reward_model import reward_model_scores

    torch.manual_seed(0)
    tokenizer = AutoTokenizer.from_pretrained(tiny_tokenizer_dir)
    rm = Qwen2ForSequenceClassification(Qwen2Config(num_labels=1, **{**CONFIG, "vocab_size": len(tokenizer)})).eval()
    watch = CacheWatch(rm.model)
    conversations = [[{"role": "user", "content": "1+1"}, {"role": "assistant", "content": str(k)}] for k in range(3)]
    assert len(reward_model_scores(rm, tokenizer, conversations, micro_batch_size=2)) == 3
    watch.assert_none()


@pytest.fixture(scope="module")
def tiny_tokenizer_dir():
    from kfrl.models.tiny import materialize_builtin

    return materialize_builtin("builtin:tiny-qwen2-arith")
