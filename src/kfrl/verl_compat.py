"""veRL command lines on kfrl: Hydra-style ``key=value`` overrides of veRL v0.7.1's trainer config
(``actor_rollout_ref.*``, ``critic.*``, ``data.*``, ``algorithm.*``, ``trainer.*``,
``custom_reward_function.*``, ``reward_model.*``) mapped onto kfrl's config.

Every veRL key is either mapped (``VERL_KEYS``), or accepted and reported as meaning nothing here
(``IGNORED``: a notice says why; nothing vanishes silently), or an error naming the nearest valid
key. docs/config.md shows the same table; a test keeps the two in step.
"""
from __future__ import annotations

from typing import Any, Callable

AR = "actor_rollout_ref"

# veRL key -> kfrl key. Keys that are spelled the same in both (data.train_batch_size,
# algorithm.gamma, trainer.save_freq, ...) need no entry: they are kfrl keys already.
VERL_KEYS: dict[str, str] = {
    f"{AR}.model.path": "model.path",
    f"{AR}.actor.optim.lr": "actor.lr",
    f"{AR}.actor.optim.weight_decay": "actor.weight_decay",
    f"{AR}.actor.optim.betas": "actor.betas",
    f"{AR}.actor.optim.optimizer": "actor.optimizer",
    f"{AR}.model.lora_rank": "model.lora_rank",
    f"{AR}.model.lora_alpha": "model.lora_alpha",
    f"{AR}.model.target_modules": "model.target_modules",
    f"{AR}.model.exclude_modules": "model.exclude_modules",
    f"{AR}.actor.fsdp_config.model_dtype": "actor.master_dtype",
    f"{AR}.actor.fsdp_config.param_offload": "actor.param_offload",
    f"{AR}.model.enable_gradient_checkpointing": "actor.gradient_checkpointing",
    f"{AR}.actor.fsdp_config.optimizer_offload": "actor.optimizer_offload",
    f"{AR}.actor.grad_clip": "actor.grad_clip",
    f"{AR}.actor.ppo_mini_batch_size": "actor.ppo_mini_batch_size",
    f"{AR}.actor.ppo_micro_batch_size_per_gpu": "actor.ppo_micro_batch_size_per_gpu",
    # The deprecated global micro-batch equals the per-GPU one on a single worker.
    f"{AR}.actor.ppo_micro_batch_size": "actor.ppo_micro_batch_size_per_gpu",
    f"{AR}.actor.ppo_epochs": "actor.ppo_epochs",
    f"{AR}.actor.use_dynamic_bsz": "actor.use_dynamic_bsz",
    f"{AR}.actor.use_torch_compile": "actor.use_torch_compile",
    f"{AR}.model.use_liger": "actor.use_liger",
    f"{AR}.rollout.log_prob_use_dynamic_bsz": "rollout.log_prob_use_dynamic_bsz",
    f"{AR}.rollout.log_prob_max_token_len_per_gpu": "rollout.log_prob_max_token_len_per_gpu",
    f"{AR}.actor.ppo_max_token_len_per_gpu": "actor.ppo_max_token_len_per_gpu",
    # fsdp / fsdp2: torch FSDP2; deepspeed: ZeRO (actor.deepspeed_zero_stage); megatron is refused by the config.
    f"{AR}.actor.strategy": "actor.strategy",
    f"{AR}.actor.shuffle": "actor.shuffle",
    f"{AR}.actor.clip_ratio": "actor.clip_ratio",
    f"{AR}.actor.clip_ratio_low": "actor.clip_ratio_low",
    f"{AR}.actor.clip_ratio_high": "actor.clip_ratio_high",
    f"{AR}.actor.clip_ratio_c": "actor.clip_ratio_c",
    f"{AR}.actor.loss_agg_mode": "actor.loss_agg_mode",
    f"{AR}.actor.policy_loss.loss_mode": "actor.loss_mode",
    f"{AR}.actor.policy_loss.clip_cov_ratio": "actor.clip_cov_ratio",
    f"{AR}.actor.policy_loss.clip_cov_lb": "actor.clip_cov_lb",
    f"{AR}.actor.policy_loss.clip_cov_ub": "actor.clip_cov_ub",
    f"{AR}.actor.policy_loss.kl_cov_ratio": "actor.kl_cov_ratio",
    f"{AR}.actor.policy_loss.ppo_kl_coef": "actor.ppo_kl_coef",
    f"{AR}.actor.policy_loss.dro_beta": "actor.dro_beta",
    f"{AR}.actor.tau_pos": "actor.tau_pos",
    f"{AR}.actor.tau_neg": "actor.tau_neg",
    f"{AR}.actor.entropy_coeff": "actor.entropy_coeff",
    f"{AR}.actor.use_kl_loss": "actor.use_kl_loss",
    f"{AR}.actor.kl_loss_coef": "actor.kl_loss_coef",
    f"{AR}.actor.kl_loss_type": "actor.kl_loss_type",
    f"{AR}.rollout.name": "rollout.name",
    f"{AR}.rollout.n": "rollout.n",
    f"{AR}.rollout.temperature": "rollout.temperature",
    f"{AR}.rollout.top_p": "rollout.top_p",
    f"{AR}.rollout.top_k": "rollout.top_k",
    f"{AR}.rollout.log_prob_micro_batch_size_per_gpu": "rollout.log_prob_micro_batch_size_per_gpu",
    f"{AR}.rollout.enforce_eager": "rollout.enforce_eager",
    f"{AR}.rollout.gpu_memory_utilization": "rollout.gpu_memory_utilization",
    f"{AR}.rollout.log_prob_micro_batch_size": "rollout.log_prob_micro_batch_size_per_gpu",
    f"{AR}.rollout.val_kwargs.do_sample": "rollout.val_kwargs.do_sample",
    f"{AR}.rollout.val_kwargs.temperature": "rollout.val_kwargs.temperature",
    f"{AR}.rollout.val_kwargs.top_p": "rollout.val_kwargs.top_p",
    f"{AR}.rollout.val_kwargs.top_k": "rollout.val_kwargs.top_k",
    f"{AR}.rollout.val_kwargs.n": "rollout.val_kwargs.n",
    **{f"{AR}.rollout.multi_turn.{key}": f"rollout.multi_turn.{key}"
       for key in ("enable", "max_assistant_turns", "max_user_turns", "tool_config_path", "format",
                   "max_parallel_calls", "max_tool_response_length", "tool_response_truncate_side")},
    "critic.optim.lr": "critic.lr",
    "critic.optim.weight_decay": "critic.weight_decay",
    "critic.optim.betas": "critic.betas",
    "critic.model.path": "critic.model_path",
    "critic.model.lora_rank": "critic.lora_rank",
    "critic.model.lora_alpha": "critic.lora_alpha",
    "critic.model.target_modules": "critic.target_modules",
    "critic.model.exclude_modules": "critic.exclude_modules",
    "critic.model.fsdp_config.model_dtype": "critic.master_dtype",
    "critic.model.fsdp_config.param_offload": "critic.param_offload",
    "critic.model.enable_gradient_checkpointing": "critic.gradient_checkpointing",
    "critic.model.fsdp_config.optimizer_offload": "critic.optimizer_offload",
    "critic.optim.optimizer": "critic.optimizer",
    "critic.ppo_micro_batch_size": "critic.ppo_micro_batch_size_per_gpu",
    "critic.forward_micro_batch_size": "critic.forward_micro_batch_size_per_gpu",
    "trainer.total_training_steps": "trainer.total_iterations",
    "custom_reward_function.path": "reward.custom_function_path",
    "custom_reward_function.name": "reward.custom_function_name",
    "reward_model.enable": "reward.name",
    "reward_model.model.path": "reward.model_path",
    "reward_model.micro_batch_size_per_gpu": "reward.micro_batch_size",
    "reward_model.micro_batch_size": "reward.micro_batch_size",
    # DAPO recipe keys.
    "reward_model.overlong_buffer.enable": "reward.overlong_buffer.enable",
    "reward_model.overlong_buffer.len": "reward.overlong_buffer.len",
    "reward_model.overlong_buffer.penalty_factor": "reward.overlong_buffer.penalty_factor",
    "reward_model.overlong_buffer.log": "reward.overlong_buffer.log",
}

# How a veRL value becomes kfrl's, where the two differ.
VALUE_MAPS: dict[str, Callable[[Any], Any]] = {
    f"{AR}.actor.fsdp_config.model_dtype": lambda v: _DTYPES.get(str(v), v),
    "critic.model.fsdp_config.model_dtype": lambda v: _DTYPES.get(str(v), v),
    # torchao's "_AdamW" is AdamW; bitsandbytes' "AdamW8bit" keeps its name.
    f"{AR}.actor.optim.optimizer": lambda v: "AdamW" if v == "_AdamW" else v,
    "critic.optim.optimizer": lambda v: "AdamW" if v == "_AdamW" else v,
    "reward_model.enable": lambda v: "model" if _truthy(v) else "rule",
    "trainer.total_training_steps": lambda v: None if v in (None, "null", -1) else v,
}

_DTYPES = {"fp32": "float32", "float32": "float32", "bf16": "bfloat16", "bfloat16": "bfloat16"}

# veRL keys (or key prefixes, ending in ".") accepted but without effect in kfrl, and why.
_PARALLEL = ("kfrl's multi-GPU update is data parallel only (actor.strategy over trainer.n_gpus_per_node x "
             "trainer.nnodes processes); this kind of parallelism is not built")
_VLLM = "a vLLM engine setting kfrl does not pass on"
_MEMORY = "a memory/throughput knob of veRL's FSDP workers; kfrl has no equivalent"
_UNUSED_MODEL = "a model-loading option of veRL's workers that kfrl does not use"
_FIXED_LR = "kfrl's optimizers are AdamW with a constant learning rate (no warm-up or schedule)"
_BY_COUNT = ("kfrl micro-batches this pass by count (the *_micro_batch_size_per_gpu keys); the actor update and "
             "the log-prob passes take a token budget (actor.use_dynamic_bsz, rollout.log_prob_use_dynamic_bsz)")
_STORE = "checkpoints live in the run's store (store.uri); resume with kfrl train --run-id"
# Keys are exact veRL keys; a key ending in "." stands for a whole subtree of engine settings.
# Only subtrees are wildcards, so a misspelt veRL key is still an error with a suggestion.
IGNORED: dict[str, str] = {
    f"{AR}.model.use_remove_padding": "kfrl pads per micro-batch; there is no remove-padding path",
    f"{AR}.model.enable_activation_offload": _MEMORY,
    f"{AR}.model.use_fused_kernels": _MEMORY,
    f"{AR}.model.use_shm": _UNUSED_MODEL,
    f"{AR}.model.trust_remote_code": _UNUSED_MODEL,
    f"{AR}.model.external_lib": _UNUSED_MODEL,
    f"{AR}.model.lora_adapter_path": "kfrl's adapters start fresh (B = 0); a run continues its own adapters on resume",
    f"{AR}.model.lora.": "Megatron's LoRA settings; kfrl's LoRA is peft's, set with model.lora_rank/lora_alpha/target_modules",
    f"{AR}.actor.optim.optimizer_impl": "kfrl picks the implementation from actor.optimizer (AdamW: torch; AdamW8bit: kfrl's own)",
    f"{AR}.model.override_config.": _UNUSED_MODEL,
    f"{AR}.hybrid_engine": "kfrl's stages load weights per stage group; there is no hybrid engine",
    f"{AR}.nccl_timeout": "kfrl's update workers wait up to 60 minutes on a collective",
    f"{AR}.actor.optim.lr_warmup_steps": _FIXED_LR,
    f"{AR}.actor.optim.lr_warmup_steps_ratio": _FIXED_LR,
    f"{AR}.actor.optim.warmup_style": _FIXED_LR,
    f"{AR}.actor.optim.lr_scheduler_type": _FIXED_LR,
    f"{AR}.actor.optim.min_lr_ratio": _FIXED_LR,
    f"{AR}.actor.optim.num_cycles": _FIXED_LR,
    f"{AR}.actor.optim.total_training_steps": _FIXED_LR,
    f"{AR}.actor.optim.clip_grad": "use actor.grad_clip",
    f"{AR}.actor.fsdp_config.": _MEMORY,
    f"{AR}.actor.megatron.": _PARALLEL,
    f"{AR}.actor.ulysses_sequence_parallel_size": _PARALLEL,
    f"{AR}.actor.checkpoint.": "kfrl commits a full HF checkpoint (weights, tokenizer, optimizer) every iteration",
    f"{AR}.actor.calculate_entropy": "kfrl reports actor/entropy from the old-logprob pass or the update",
    f"{AR}.actor.loss_scale_factor": "seq-mean-token-sum-norm divides by the padded response length, veRL's default",
    f"{AR}.actor.policy_loss.rollout_correction.": "rollout correction (importance weights from rollout log-probs) is not implemented",
    f"{AR}.rollout.tensor_model_parallel_size": _VLLM,
    f"{AR}.rollout.free_cache_engine": _VLLM,
    f"{AR}.rollout.load_format": _VLLM,
    f"{AR}.rollout.dtype": _VLLM,
    f"{AR}.rollout.max_num_batched_tokens": _VLLM,
    f"{AR}.rollout.max_num_seqs": _VLLM,
    f"{AR}.rollout.max_model_len": _VLLM,
    f"{AR}.rollout.enable_chunked_prefill": _VLLM,
    f"{AR}.rollout.disable_log_stats": _VLLM,
    f"{AR}.rollout.layered_summon": _VLLM,
    f"{AR}.rollout.engine_kwargs.": _VLLM,
    f"{AR}.rollout.mode": "kfrl's rollout is a batch stage (veRL's sync mode); no async agent loop",
    f"{AR}.rollout.multi_turn.interaction_config_path": "simulated-user interactions are not implemented; tools are",
    f"{AR}.rollout.multi_turn.use_inference_chat_template": "tool answers are rendered with the model's own chat template",
    f"{AR}.rollout.multi_turn.tokenization_sanity_check_mode": "kfrl appends the chat template's tokens for tool "
                                                               "answers and keeps the model's tokens as sampled",
    f"{AR}.rollout.multi_turn.num_repeat_rollouts": "use rollout.n",
    f"{AR}.rollout.agent.": "agent-loop rollout is not implemented",
    f"{AR}.rollout.do_sample": "training rollouts always sample (validation: rollout.val_kwargs.do_sample)",
    f"{AR}.rollout.ignore_eos": "responses end at EOS",
    f"{AR}.rollout.calculate_log_probs": "kfrl always stores the rollout's log-probs",
    f"{AR}.rollout.prompt_length": "set by data.max_prompt_length",
    f"{AR}.rollout.response_length": "set by data.max_response_length",
    f"{AR}.ref.log_prob_micro_batch_size_per_gpu": "kfrl uses rollout.log_prob_micro_batch_size_per_gpu for the reference too",
    f"{AR}.ref.log_prob_micro_batch_size": "kfrl uses rollout.log_prob_micro_batch_size_per_gpu for the reference too",
    f"{AR}.ref.log_prob_use_dynamic_bsz": "the reference pass follows rollout.log_prob_use_dynamic_bsz",
    f"{AR}.ref.log_prob_max_token_len_per_gpu": "the reference pass follows rollout.log_prob_max_token_len_per_gpu",
    f"{AR}.ref.fsdp_config.": _MEMORY,
    f"{AR}.ref.ulysses_sequence_parallel_size": _PARALLEL,
    "critic.model.use_remove_padding": "kfrl pads per micro-batch; there is no remove-padding path",
    "critic.model.trust_remote_code": _UNUSED_MODEL,
    "critic.model.external_lib": _UNUSED_MODEL,
    "critic.model.tokenizer_path": "the critic uses the policy's tokenizer",
    "critic.model.fsdp_config.": _MEMORY,
    "critic.model.override_config.": _UNUSED_MODEL,
    "critic.optim.lr_warmup_steps": _FIXED_LR,
    "critic.optim.lr_warmup_steps_ratio": _FIXED_LR,
    "critic.optim.warmup_style": _FIXED_LR,
    "critic.optim.lr_scheduler_type": _FIXED_LR,
    "critic.optim.min_lr_ratio": _FIXED_LR,
    "critic.optim.total_training_steps": _FIXED_LR,
    "critic.optim.clip_grad": "use critic.grad_clip",
    "critic.optim.optimizer_impl": "kfrl picks the implementation from critic.optimizer (AdamW: torch; AdamW8bit: kfrl's own)",
    "critic.model.lora_adapter_path": "kfrl's adapters start fresh (B = 0); a run continues its own adapters on resume",
    "critic.strategy": "the critic's update is sharded as the actor's: it follows actor.strategy",
    "critic.ulysses_sequence_parallel_size": _PARALLEL,
    "critic.use_dynamic_bsz": _BY_COUNT,
    "critic.ppo_max_token_len_per_gpu": _BY_COUNT,
    "critic.forward_max_token_len_per_gpu": _BY_COUNT,
    "critic.checkpoint.": "kfrl commits a full critic checkpoint every iteration",
    "critic.rollout_n": "taken from rollout.n",
    "algorithm.use_pf_ppo": "PF-PPO resampling is not implemented",
    "algorithm.pf_ppo.": "PF-PPO resampling is not implemented",
    "algorithm.rollout_correction.": "rollout-correction importance sampling is not implemented",
    f"{AR}.actor.calculate_sum_pi_squared": ("kfrl's old_logprob stage computes sum_pi_squared exactly when "
                                             "algorithm.adv_estimator=optimal_token_baseline"),
    "data.tokenizer": "the tokenizer comes with the model (model.path)",
    "data.use_shm": "kfrl reads data from the run's store",
    "data.dataloader_num_workers": "kfrl reads data from the run's store",
    "data.filter_overlong_prompts_workers": "filtering runs once, when the run is prepared",
    "data.return_full_prompt": "the rollout group keeps the prompt's token ids and messages",
    "data.trust_remote_code": _UNUSED_MODEL,
    "data.image_key": "multi-modal data is not supported",
    "data.video_key": "multi-modal data is not supported",
    "data.return_multi_modal_inputs": "multi-modal data is not supported",
    "data.custom_cls.": "custom dataset classes are not supported; write veRL-schema Parquet",
    "data.sampler.": "kfrl's sampler is the seeded per-epoch shuffle (data.shuffle, data.seed)",
    "data.datagen.": "dynamic data generation is not supported",
    "data.apply_chat_template_kwargs.": "the chat template is applied with its defaults",
    "trainer.logger": "kfrl logs to MLflow (tracking.uri) and the console, always",
    "trainer.default_local_dir": _STORE,
    "trainer.default_hdfs_dir": _STORE,
    "trainer.resume_mode": _STORE,
    "trainer.resume_from_path": _STORE,
    "trainer.del_local_ckpt_after_load": _STORE,
    "trainer.remove_previous_ckpt_in_save": _STORE,
    "trainer.max_actor_ckpt_to_keep": _STORE,
    "trainer.max_critic_ckpt_to_keep": _STORE,
    "trainer.balance_batch": "kfrl splits rows between devices by prompt group, in order; it does not rebalance by length",
    "trainer.log_val_generations": "validation generations are stored per validation (iter-N/validate)",
    "trainer.rollout_data_dir": "rollouts are stored per iteration in the run's store",
    "trainer.validation_data_dir": "validation generations are stored in the run's store",
    "trainer.val_only": "not supported: run kfrl train with trainer.total_iterations=... from a checkpoint",
    "trainer.ray_wait_register_center_timeout": "kfrl does not use Ray",
    "trainer.use_legacy_worker_impl": "kfrl has one worker implementation",
    "trainer.esi_redundant_time": "kfrl does not use Ray",
    "trainer.profile_steps": "profiling is not wired to veRL's profiler",
    "reward_model.reward_manager": "kfrl's score stage is veRL's naive manager; DAPO's shaping is reward.overlong_buffer",
    "reward_model.strategy": "the reward model scores in one process (the score stage)",
    "reward_model.model.input_tokenizer": "the reward model uses its own tokenizer and chat template",
    "reward_model.model.use_remove_padding": "kfrl pads per micro-batch; there is no remove-padding path",
    "reward_model.model.trust_remote_code": _UNUSED_MODEL,
    "reward_model.model.external_lib": _UNUSED_MODEL,
    "reward_model.model.fsdp_config.": _MEMORY,
    "reward_model.use_dynamic_bsz": _BY_COUNT,
    "reward_model.forward_max_token_len_per_gpu": _BY_COUNT,
    "reward_model.launch_reward_fn_async": "scoring runs in the score stage",
    "reward_model.sandbox_fusion.": "sandbox execution is not supported",
    "custom_reward_function.reward_kwargs.": "not supported: bind the arguments in your function",
    "sandbox_fusion.": "sandbox execution is not supported",
    "global_profiler.": "profiling is not wired to veRL's profiler",
    "ray_kwargs.": "kfrl does not use Ray",
    "ray_init.": "kfrl does not use Ray",
    "transfer_queue.": "kfrl moves data through the store",
}

# veRL's own defaults (ppo_trainer.yaml) where kfrl's differ. A command line written for veRL
# (any key under actor_rollout_ref., or another veRL-only key) starts from these, so it means
# what it meant in veRL: e.g. the quickstart sets no estimator and gets PPO with a critic (gae).
VERL_DEFAULTS: dict[str, Any] = {
    "data.train_files": "~/data/rlhf/gsm8k/train.parquet",
    "data.val_files": "~/data/rlhf/gsm8k/test.parquet",
    "data.train_batch_size": 1024,
    "data.max_prompt_length": 512,
    "data.max_response_length": 512,
    "model.path": "~/models/deepseek-llm-7b-chat",
    "rollout.n": 1,
    "algorithm.adv_estimator": "gae",
    "actor.ppo_mini_batch_size": 256,
    "trainer.total_epochs": 30,
    "trainer.project_name": "verl_examples",
    "trainer.experiment_name": "gsm8k",
}


def is_verl_command_line(keys: list[str], kfrl_keys: set[str]) -> bool:
    """True when a key exists only in veRL's config (so veRL's defaults should apply)."""
    return any(k not in kfrl_keys and (k in VERL_KEYS or ignored_reason(k) is not None) for k in keys)


def _truthy(value: Any) -> bool:
    return value is True or str(value).lower() in ("true", "1", "yes")


def ignored_reason(key: str) -> str | None:
    """Why a veRL key has no effect in kfrl (longest matching entry), or None when it is not known."""
    if key in IGNORED:
        return IGNORED[key]
    prefixes = [p for p in IGNORED if p.endswith(".") and key.startswith(p)]
    return IGNORED[max(prefixes, key=len)] if prefixes else None


def all_verl_keys() -> list[str]:
    """Every veRL key kfrl names (for 'did you mean' hints)."""
    return sorted(set(VERL_KEYS) | {k for k in IGNORED if not k.endswith(".")})


def translate(key: str, value: Any, kfrl_keys: set[str]) -> tuple[str | None, Any, str | None]:
    """(kfrl key or None, value, notice or None) for one override. Unknown keys come back unchanged
    (kfrl_key = key) so the config's own check names them and the nearest valid key."""
    if key in kfrl_keys:
        return key, value, None
    if key in VERL_KEYS:
        target = VERL_KEYS[key]
        mapped = VALUE_MAPS.get(key, lambda v: v)(value)
        return target, mapped, None
    reason = ignored_reason(key)
    if reason is not None:
        return None, value, f"veRL key '{key}' has no effect in kfrl: {reason}"
    return key, value, None


DOC_START = "<!-- verl-keys:start (generated by `python -m kfrl.verl_compat docs/config.md`) -->"
DOC_END = "<!-- verl-keys:end -->"


def markdown_table() -> str:
    """The veRL key table of docs/config.md (mapped keys, then keys without effect)."""
    lines = ["| veRL key | kfrl key |", "|---|---|"]
    lines += [f"| `{verl}` | `{kfrl}` |" for verl, kfrl in VERL_KEYS.items()]
    lines += ["", "Keys spelled the same in veRL and kfrl (`data.train_batch_size`, `algorithm.kl_ctrl.kl_coef`, "
              "`trainer.save_freq`, ...) need no mapping.", "",
              "| veRL key (a trailing `.*` means the whole subtree) | why it has no effect in kfrl |", "|---|---|"]
    lines += [f"| `{key.rstrip('.') + ('.*' if key.endswith('.') else '')}` | {why} |" for key, why in IGNORED.items()]
    lines += ["", "When a command line uses a veRL-only key, veRL's own defaults apply where the line sets nothing:", "",
              "| kfrl key | veRL default |", "|---|---|"]
    lines += [f"| `{key}` | `{value}` |" for key, value in VERL_DEFAULTS.items()]
    return "\n".join(lines)


def update_doc(path: str) -> bool:
    """Rewrite the generated table between the markers of ``path``; True when it changed."""
    from pathlib import Path

    doc = Path(path)
    text = doc.read_text()
    if DOC_START not in text or DOC_END not in text:
        raise ValueError(f"{path} has no {DOC_START} ... {DOC_END} markers")
    head, _, rest = text.partition(DOC_START)
    _, _, tail = rest.partition(DOC_END)
    new = f"{head}{DOC_START}\n{markdown_table()}\n{DOC_END}{tail}"
    if new != text:
        doc.write_text(new)
    return new != text


if __name__ == "__main__":
    import sys

    changed = update_doc(sys.argv[1] if len(sys.argv) > 1 else "docs/config.md")
    print("updated" if changed else "up to date")
