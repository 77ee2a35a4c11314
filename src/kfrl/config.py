"""The one typed run config: sections, defaults, YAML loading and dotted ``key=value`` overrides.

Names follow veRL where the concept is the same (``train_batch_size`` counts prompts,
``ppo_mini_batch_size`` counts prompts, ``ppo_micro_batch_size_per_gpu`` counts trajectories), so a
veRL user can read this file as a map. Every section forbids unknown keys: a typo is an error that
names the key and the nearest valid one.
"""
from __future__ import annotations

import difflib
import json
from collections.abc import Mapping
from pathlib import Path
from typing import Any, Literal, Optional, Union

import yaml
from pydantic import BaseModel, ConfigDict, Field, ValidationError, field_validator, model_validator


class ConfigError(ValueError):
    """A config problem a user can fix: names the key, the bad value and what would be valid."""


class Section(BaseModel):
    # inf and nan are never meaningful settings (rollout.temperature=inf samples garbage silently).
    model_config = ConfigDict(extra="forbid", validate_assignment=True, allow_inf_nan=False)


class DataConfig(Section):
    # Parquet file(s) in veRL's RL-dataset schema, "builtin:arith" (2-digit sums) or "builtin:arith_tools"
    # (3-digit sums with a calculator tool, for rollout.multi_turn).
    train_files: str = "builtin:arith"
    val_files: Optional[str] = None
    train_batch_size: int = Field(8, ge=1, description="prompts per iteration")
    # Prompts per generation batch with dynamic sampling (algorithm.filter_groups); null = train_batch_size.
    gen_batch_size: Optional[int] = Field(None, ge=1)
    max_prompt_length: int = Field(64, ge=1)
    max_response_length: int = Field(16, ge=1)
    # A prompt over max_prompt_length: "error" stops the run naming the row; "left"/"right" keep the
    # last/first max_prompt_length tokens (veRL's data.truncation).
    truncation: Literal["error", "left", "right"] = "error"
    # Drop prompts over max_prompt_length when the run is prepared (veRL's data.filter_overlong_prompts).
    filter_overlong_prompts: bool = False
    # Hand the prompt's chat messages to reward functions as extra_info["raw_prompt"] (veRL's return_raw_chat).
    return_raw_chat: bool = False
    prompt_key: str = "prompt"
    # The column that picks the reward function (veRL's data.reward_fn_key).
    reward_fn_key: str = "data_source"
    # Prompts per validation generation call; null = rollout.micro_batch_size (0 = all at once).
    val_batch_size: Optional[int] = Field(None, ge=1)
    shuffle: bool = True
    seed: int = 1
    # Size of the builtin synthetic dataset (ignored for real files).
    builtin_train_size: int = Field(2048, ge=1)
    builtin_val_size: int = Field(128, ge=1)


class ModelConfig(Section):
    # An HF directory (local or in the store) or "builtin:tiny-qwen2-arith" (built and cached on first use).
    path: str = "builtin:tiny-qwen2-arith"
    # "auto": bfloat16 on CUDA, float32 on CPU.
    dtype: Literal["auto", "float32", "bfloat16", "float16"] = "auto"
    # LoRA (veRL's actor_rollout_ref.model.lora_rank, lora_alpha, target_modules, exclude_modules):
    # lora_rank > 0 trains low-rank adapters (peft) on the frozen base instead of every weight. The
    # reference policy is the base with the adapters disabled; rollout uses the merged weights; each
    # iteration commits the adapter only (kfrl.models.lora).
    lora_rank: int = Field(0, ge=0)
    lora_alpha: float = Field(16, gt=0)
    target_modules: Union[str, list[str]] = "all-linear"
    exclude_modules: Optional[list[str]] = None
    # The rows of a micro-batch that share a prompt (rollout.n samples of it) run the prompt's tokens
    # through the model once, in the update and the old/ref log-prob passes: a packed sequence of the
    # prompt and its responses, each response attending to the prompt and to itself only
    # (kfrl.engines.shared_prompt). The same result up to summation order, with fewer tokens computed.
    # Applies to Qwen2/Qwen3/Llama/Mistral models on SDPA attention; others, and the update with
    # actor.use_torch_compile, run one sequence per row.
    share_prompt_forward: bool = False


class ValKwargsConfig(Section):
    # Validation sampling (veRL's rollout.val_kwargs): greedy, one response per prompt by default.
    do_sample: bool = False
    temperature: float = Field(0.0, ge=0)
    top_p: float = Field(1.0, gt=0, le=1)
    top_k: int = -1
    n: int = Field(1, ge=1)


class MultiTurnConfig(Section):
    # Multi-turn rollouts with tools (veRL's rollout.multi_turn; kfrl.agent): the model writes until its
    # turn ends; Hermes tool calls (<tool_call>{"name": ..., "arguments": ...}</tool_call>) in the turn
    # run, their answers are appended as `tool` messages through the chat template and generation goes
    # on, up to the turn limits or data.max_response_length, which counts every response token (the
    # model's and the inserted ones). Inserted tokens get response_mask 0: only the model's own tokens
    # are trained on.
    enable: bool = False
    max_assistant_turns: Optional[int] = Field(None, ge=1, description="null: until the length budget")
    max_user_turns: Optional[int] = Field(None, ge=1, description="tool-answer turns; null: no limit")
    # veRL's tool-config YAML: tools: [{class_name: ..., config: {...}, tool_schema: {type: function, ...}}].
    tool_config_path: Optional[str] = None
    # Plain Python functions with type hints and a docstring (TRL's way): "package.module:function" or
    # "path/to/file.py:function"; the schema comes from the signature.
    tools: list[str] = []
    format: Literal["hermes"] = "hermes"
    max_parallel_calls: int = Field(1, ge=1, description="tool calls of one turn that run; the rest are dropped")
    max_tool_response_length: int = Field(256, ge=1, description="characters of a tool's answer kept")
    tool_response_truncate_side: Literal["left", "right", "middle"] = "middle"
    # Tools run in worker processes, not in the trainer: one that raises, hangs past the timeout (its
    # worker is killed and replaced) or returns something unprintable answers the model with an error.
    tool_timeout_s: float = Field(30.0, gt=0)
    tool_workers: int = Field(4, ge=1)


class RolloutConfig(Section):
    # Rollout backend (kfrl.engines.rollout). "auto": "torch" on a GPU when it supports the model
    # (Qwen2/2.5/3, Llama), else "hf". "torch": kfrl's graph-captured batched decoder. "hf":
    # transformers generate, the reference. "vllm": vllm.LLM (the GPU image; pip install kfrl[gpu]).
    name: Literal["auto", "hf", "torch", "vllm"] = "auto"
    n: int = Field(4, ge=1, description="responses per prompt")
    temperature: float = Field(1.0, gt=0)
    top_p: float = Field(1.0, gt=0, le=1)
    top_k: int = -1
    # Prompts per generation call; 0 = all at once. Bounds the KV cache of the torch backend.
    micro_batch_size: int = Field(0, ge=0)
    log_prob_micro_batch_size_per_gpu: int = Field(64, ge=1)
    # The old/ref log-prob passes by token budget, as actor.use_dynamic_bsz:
    # micro-batches of at most log_prob_max_token_len_per_gpu tokens, each cut to its longest sequence.
    # The log-probs are the same as by count: no row sees another.
    log_prob_use_dynamic_bsz: bool = False
    log_prob_max_token_len_per_gpu: int = Field(16384, ge=1)
    # HF backend KV cache: "static" pre-allocates it and lets transformers compile the decode
    # step (faster on GPU after a one-off compile; no gain on CPU).
    hf_cache: Literal["dynamic", "static"] = "dynamic"
    # torch and vllm backends: no CUDA graphs (slower; for debugging).
    enforce_eager: bool = False
    # vllm backend: share of GPU memory vLLM may take (weights + KV cache), as in veRL.
    gpu_memory_utilization: float = Field(0.5, gt=0, le=1)
    val_kwargs: ValKwargsConfig = ValKwargsConfig()
    multi_turn: MultiTurnConfig = MultiTurnConfig()


AdvEstimator = Literal["gae", "grpo", "rloo", "opo", "gpg", "grpo_passk", "reinforce_plus_plus",
                       "reinforce_plus_plus_baseline", "remax", "gdpo", "optimal_token_baseline"]


class KLControlConfig(Section):
    # "fixed": the coefficient stays kl_coef. "adaptive": Ziegler et al. (2019), steering the
    # measured KL towards target_kl over `horizon` trajectories.
    type: Literal["fixed", "adaptive"] = "fixed"
    kl_coef: float = Field(0.001, ge=0)
    horizon: int = Field(10000, gt=0)
    target_kl: float = Field(0.1, gt=0)


class FilterGroupsConfig(Section):
    # DAPO dynamic sampling: drop prompt groups whose `metric` has zero spread (all right or all
    # wrong), generate more batches until train_batch_size groups are kept, then trim.
    enable: bool = False
    metric: Literal["acc", "score", "seq_reward", "seq_final_reward"] = "acc"
    max_num_gen_batches: int = Field(0, ge=0, description="0 = no limit")


class AlgorithmConfig(Section):
    adv_estimator: AdvEstimator = "grpo"
    norm_adv_by_std_in_grpo: bool = True
    gamma: float = 1.0
    lam: float = 1.0
    # KL penalty subtracted from the token-level rewards (the reference policy's KL).
    use_kl_in_reward: bool = False
    kl_penalty: Literal["kl", "k1", "abs", "mse", "k2", "low_var_kl", "k3"] = "kl"
    kl_ctrl: KLControlConfig = KLControlConfig()
    filter_groups: FilterGroupsConfig = FilterGroupsConfig()
    # GDPO (veRL 0.9): the keys of the reward function's returned dict that are the reward dimensions,
    # each normalised within its prompt group, then summed with these weights (null: all 1).
    gdpo_reward_keys: Optional[list[str]] = None
    gdpo_reward_weights: Optional[list[float]] = None

    @property
    def needs_sum_pi_squared(self) -> bool:
        """Whether the old_logprob stage writes sum_pi_squared (veRL's actor.calculate_sum_pi_squared)."""
        return self.adv_estimator == "optimal_token_baseline"

    @model_validator(mode="after")
    def _check_gdpo(self) -> "AlgorithmConfig":
        keys, weights = self.gdpo_reward_keys, self.gdpo_reward_weights
        if self.adv_estimator == "gdpo":
            if not keys:
                raise ValueError(
                    "algorithm.adv_estimator=gdpo needs algorithm.gdpo_reward_keys: the keys of the dict your reward "
                    "function returns that are the reward dimensions to normalise one by one (e.g. "
                    "[format_reward, accuracy_reward]); a reward that returns a single float has one dimension, "
                    "which is grpo")
            if not self.norm_adv_by_std_in_grpo:
                raise ValueError(
                    "algorithm.adv_estimator=gdpo with algorithm.norm_adv_by_std_in_grpo=false: veRL 0.9.1 always "
                    "divides each reward dimension by its group std for gdpo (the flag is not passed to it); "
                    "remove the flag, or use grpo for Dr.GRPO")
        if weights is not None and len(weights) != len(keys or []):
            raise ValueError(f"algorithm.gdpo_reward_weights has {len(weights)} weight(s) for "
                             f"{len(keys or [])} algorithm.gdpo_reward_keys; give one weight per key (or null)")
        return self


class TrainingCopyConfig(Section):
    """How a role's training copy is held in memory (actor and critic alike)."""
    # veRL's fsdp_config.model_dtype. float32: fp32 master weights (autocast computes in bf16 on CUDA) and
    # fp32 AdamW moments, 16 bytes per trained parameter. bfloat16: bf16 weights and moments, 8 bytes (what
    # TRL does with a bf16 model): an update smaller than bf16's resolution of a weight (2^-8 of it) is lost.
    master_dtype: Literal["float32", "bfloat16"] = "float32"
    # veRL's optim.optimizer. AdamW: torch's (fused on CUDA). AdamW8bit: the moments kept in 8 bits per
    # value, blockwise scaled (kfrl.engines.optim8bit; 2 bytes per parameter instead of 8 in fp32).
    optimizer: Literal["AdamW", "AdamW8bit"] = "AdamW"
    # veRL's fsdp_config.param_offload / optimizer_offload: between updates the training copy's weights /
    # optimizer moments wait in host memory, leaving the GPU to rollout and inference; every update moves
    # them in and back out (kfrl.engines.offload; counted in timing_s/offload).
    param_offload: bool = False
    optimizer_offload: bool = False
    # veRL's model.enable_gradient_checkpointing: the update keeps only each transformer block's input and
    # recomputes the block in the backward pass: activation memory falls by about the layer count, for
    # one more forward's compute (about a third more update time).
    gradient_checkpointing: bool = False


class ActorConfig(TrainingCopyConfig):
    lr: float = Field(1e-6, gt=0)
    weight_decay: float = 0.01
    betas: tuple[float, float] = (0.9, 0.999)
    grad_clip: float = Field(1.0, gt=0)
    ppo_mini_batch_size: int = Field(8, ge=1, description="prompts per optimizer step")
    ppo_micro_batch_size_per_gpu: int = Field(8, ge=1, description="trajectories per forward/backward")
    ppo_epochs: int = Field(1, ge=1)
    # veRL's dynamic batch size: micro-batches of at most ppo_max_token_len_per_gpu tokens (padded to
    # their longest, longest sequences first) instead of ppo_micro_batch_size_per_gpu rows, each cut to
    # its own longest sequence, so the forward computes almost no padding. Changes the micro-batch
    # composition, hence token-mean's weighting across micro-batches, as in veRL.
    use_dynamic_bsz: bool = False
    ppo_max_token_len_per_gpu: int = Field(16384, ge=1)
    # CUDA only: compile the training copy's transformer blocks with torch.compile (Inductor fuses their
    # elementwise work). The first update of a process pays the compilation (tens of seconds): worth it
    # in a resident engine, not for a task that runs one update.
    use_torch_compile: bool = False
    # veRL's model.use_liger. CUDA only: liger-kernel's fused RMSNorm, rotary and SwiGLU kernels, forward
    # and backward, in the training copy (pip install liger-kernel; in kfrl[gpu]). Its LM-head losses
    # stay off: kfrl's own fused LM head computes log-probs and entropies.
    use_liger: bool = False
    shuffle: bool = False
    clip_ratio: float = 0.2
    clip_ratio_low: Optional[float] = None
    clip_ratio_high: Optional[float] = None
    clip_ratio_c: float = Field(3.0, gt=1)
    # Policy loss (veRL's actor.policy_loss.loss_mode, kfrl.algos.losses): vanilla PPO-clip (with
    # dual-clip and DAPO's clip-higher via clip_ratio_low/high), dppo_tv, dppo_kl, gspo, sapo, gpg,
    # clip_cov, kl_cov, geo_mean, dro or cispo.
    loss_mode: Literal["vanilla", "dppo_tv", "dppo_kl", "gspo", "sapo", "gpg", "clip_cov", "kl_cov",
                       "geo_mean", "dro", "cispo"] = "vanilla"
    loss_agg_mode: Literal[
        "token-mean", "token-sum", "seq-mean-token-sum", "seq-mean-token-mean", "seq-mean-token-sum-norm"
    ] = "token-mean"
    # Knobs of the policy losses, veRL's names and defaults (veRL: actor.tau_pos / actor.tau_neg and
    # actor.policy_loss.<knob>). sapo: gate temperatures for A > 0 / A <= 0.
    tau_pos: float = Field(1.0, gt=0)
    tau_neg: float = Field(1.05, gt=0)
    # clip_cov: share of valid tokens to clip, among those with clip_cov_lb < cov < clip_cov_ub.
    clip_cov_ratio: float = Field(0.0002, gt=0)
    clip_cov_lb: float = 1.0
    clip_cov_ub: float = 5.0
    # kl_cov: share of valid tokens (largest covariance) given ppo_kl_coef * |log-ratio|.
    kl_cov_ratio: float = Field(0.0002, gt=0)
    ppo_kl_coef: float = 0.1
    # dro: the quadratic log-ratio penalty; required (> 0) when loss_mode is dro.
    dro_beta: Optional[float] = None
    entropy_coeff: float = 0.0
    use_kl_loss: bool = False
    kl_loss_coef: float = 0.001
    kl_loss_type: Literal["kl", "k1", "abs", "mse", "k2", "low_var_kl", "k3"] = "low_var_kl"
    # How the update is sharded over trainer.n_gpus_per_node x trainer.nnodes processes (veRL's key):
    # fsdp2 (torch's fully_shard; "fsdp" means the same) or deepspeed (ZeRO, stage deepspeed_zero_stage).
    strategy: Literal["fsdp2", "fsdp", "deepspeed"] = "fsdp2"
    deepspeed_zero_stage: Literal[2, 3] = 2

    @model_validator(mode="after")
    def _check_policy_loss(self) -> "ActorConfig":
        if self.loss_mode == "dro" and (self.dro_beta is None or not self.dro_beta > 0):
            raise ValueError(f"actor.loss_mode=dro needs a positive actor.dro_beta (veRL's "
                             f"actor_rollout_ref.actor.policy_loss.dro_beta), got {self.dro_beta}")
        return self


class CriticConfig(TrainingCopyConfig):
    # null: on exactly when algorithm.adv_estimator is "gae" (veRL's critic.enable: null).
    enable: Optional[bool] = None
    # An HF directory for the value model's body; "" = the actor's initial weights. The scalar
    # value head is new (seeded by trainer.seed) unless the directory already has one.
    model_path: str = ""
    # LoRA on the value model's body (veRL's critic.model.lora_rank, ...); the value head is trained whole.
    lora_rank: int = Field(0, ge=0)
    lora_alpha: float = Field(16, gt=0)
    target_modules: Union[str, list[str]] = "all-linear"
    exclude_modules: Optional[list[str]] = None
    lr: float = Field(1e-5, gt=0)
    weight_decay: float = 0.01
    betas: tuple[float, float] = (0.9, 0.999)
    grad_clip: float = Field(1.0, gt=0)
    # null: follow the actor's value (veRL's critic inherits these).
    ppo_mini_batch_size: Optional[int] = Field(None, ge=1, description="prompts per optimizer step")
    ppo_micro_batch_size_per_gpu: int = Field(8, ge=1, description="trajectories per forward/backward")
    forward_micro_batch_size_per_gpu: Optional[int] = Field(None, ge=1, description="values stage; null = ppo_micro_batch_size_per_gpu")
    ppo_epochs: Optional[int] = Field(None, ge=1)
    shuffle: Optional[bool] = None
    cliprange_value: float = Field(0.5, gt=0)
    loss_agg_mode: Optional[Literal[
        "token-mean", "seq-mean-token-sum", "seq-mean-token-mean", "seq-mean-token-sum-norm"]] = None


class OverlongBufferConfig(Section):
    # DAPO overlong reward shaping: a linear penalty from 0 to -penalty_factor over the last
    # `len` tokens before data.max_response_length.
    enable: bool = False
    len: int = Field(4, ge=1)
    penalty_factor: float = Field(1.0, ge=0)
    # Record overlong_reward / overlong per sample (reward_extra) and their means as metrics.
    log: bool = False


class RewardConfig(Section):
    # "rule": score with the registry keyed by each row's data_source (kfrl.rewards), or with
    # custom_function_path when set. "model": a sequence-classification reward model (model_path)
    # scores prompt + response; its logit is the score.
    name: Literal["rule", "model"] = "rule"
    # veRL's custom_reward_function.path / .name: a Python file (or module) and the function in it,
    # called as fn(data_source=..., solution_str=..., ground_truth=..., extra_info=...).
    custom_function_path: str = ""
    custom_function_name: str = "compute_score"
    model_path: str = ""
    micro_batch_size: int = Field(16, ge=1, description="reward model: sequences per forward pass")
    overlong_buffer: OverlongBufferConfig = OverlongBufferConfig()


class TrainerConfig(Section):
    project_name: str = "kfrl"
    experiment_name: str = "demo"
    # Iterations of the run. null: total_epochs passes over the training data, i.e.
    # total_epochs x (rows // data.train_batch_size) iterations (veRL's total_training_steps).
    total_iterations: Optional[int] = Field(None, ge=1)
    total_epochs: int = Field(1, ge=1)
    # Validation over data.val_files: every test_freq iterations and at the last (-1 = never),
    # and before the first iteration when val_before_train.
    test_freq: int = -1
    val_before_train: bool = True
    # The actor is updated from iteration critic_warmup on (veRL: critic_warmup <= global_steps),
    # so the critic trains alone for critic_warmup - 1 iterations.
    critic_warmup: int = Field(0, ge=0)
    save_freq: int = Field(-1, description="register a checkpoint every k iterations (and at the end); -1 = only at the end")
    # Trainer state (fp32 weights + optimizer, what an update resumes from; 12 bytes per parameter) is
    # kept for the last keep_trainer_states iterations and at every save_freq-th; older states are
    # deleted. 0 = keep every one. The policy weights of every iteration are always kept.
    keep_trainer_states: int = Field(2, ge=0)
    # Policy weights (iter-N/update_actor) kept for the newest k iterations up to LATEST, plus the initial
    # model, every save_freq-th, those beside a kept trainer state and every registered MLflow version;
    # older ones are deleted as the run goes (kfrl.retention; `kfrl gc` for runs already done). 0 keeps all.
    keep_policy_weights: int = Field(0, ge=0)
    # Where the process keeps its training copy (the resident engine, the inline runner), the trainer
    # state is written every trainer_state_freq iterations (and at the last one and every save_freq-th)
    # instead of every iteration: k times less to write (12 bytes per parameter). After a crash the
    # states in between are rebuilt by redoing at most k-1 updates from committed batches. A process
    # that does not keep the copy (a task without an engine) writes it every iteration.
    trainer_state_freq: int = Field(5, ge=1)
    seed: int = 1
    device: Literal["auto", "cpu", "cuda"] = "auto"
    # Processes per node for the GPU stages (veRL's key): the update is sharded over them (actor.strategy)
    # and rollout/log-prob stages split their rows over as many replicas. With device=cpu they are CPU
    # processes talking over gloo. nnodes > 1: the update runs as a Kubeflow Trainer job (cluster.multi_node).
    n_gpus_per_node: int = Field(1, ge=1)
    nnodes: int = Field(1, ge=1)
    # Generations logged to MLflow as a table, per iteration.
    log_generations: int = Field(8, ge=0)


class StoreConfig(Section):
    # Local folder, file:// or s3://bucket/prefix. S3 endpoint and credentials come from AWS_* variables.
    uri: str = "./kfrl-runs/store"
    # Transient errors (connection trouble, timeouts, 5xx, throttling) are retried up to `retries`
    # times, waiting backoff_s, 2 x backoff_s, ... (at most max_backoff_s) in between: the defaults
    # ride out about 70 s of an object store that is away (a restarting MinIO pod, an S3 throttling burst).
    retries: int = Field(8, ge=0)
    backoff_s: float = Field(0.5, ge=0)
    max_backoff_s: float = Field(20.0, ge=0)
    # S3: seconds a request may wait to connect, and for the next bytes of a response, before it
    # counts as a transient failure (a stalled read is retried, not waited on for minutes).
    connect_timeout_s: float = Field(5.0, gt=0)
    read_timeout_s: float = Field(20.0, gt=0)

    def options(self) -> dict:
        """Keyword arguments of ``kfrl.store.Store`` for this section."""
        return self.model_dump(exclude={"uri"})


class TrackingConfig(Section):
    # "" = $MLFLOW_TRACKING_URI when set, else the embedded default (SQLite under ./kfrl-runs); or an
    # MLflow server URL.
    uri: str = ""
    experiment_name: str = ""  # "" = $MLFLOW_EXPERIMENT_NAME when set, else trainer.project_name
    registered_model_name: str = ""  # "" = "<project>-<experiment>-policy"
    # MLflow system metrics (CPU, memory, disk, network, GPU) every 10 s: auto = when a GPU is present.
    system_metrics: Union[Literal["auto"], bool] = "auto"

    def from_environment(self) -> "TrackingConfig":
        """Empty ``uri`` / ``experiment_name`` filled from MLflow's own variables (a flag or a value in
        the config file wins over them)."""
        import os

        return self.model_copy(update={
            "uri": self.uri or os.environ.get("MLFLOW_TRACKING_URI", ""),
            "experiment_name": self.experiment_name or os.environ.get("MLFLOW_EXPERIMENT_NAME", "")})


class PipelineConfig(Section):
    # local: kfp.local SubprocessRunner; inline: call the stage functions in this process (no KFP);
    # kfp: submit to a KFP cluster with kfp.Client.
    runner: Literal["local", "inline", "kfp"] = "local"
    # How stages map to KFP tasks. "none": one task per stage (every stage visible and separately
    # scalable). "weights": two tasks, infer (rollout, gen_max, score, old/ref log-probs, values)
    # and train (advantage, critic and actor updates, validation). "all": one task per iteration. A task
    # costs a process on the local runner (~0.18 s with the engine, ~4.5 s of torch imports without)
    # and two pods on a cluster: docs/operations.md says which to use at which size.
    fuse: Literal["none", "weights", "all"] = "none"
    # "resident": `kfrl train` starts one engine process for the run (`kfrl engine serve`) that keeps
    # models loaded across stages and iterations; KFP tasks hand their stage to it and return when it
    # is committed. Local runner: a child process (a task that finds no engine runs the stage itself).
    # Cluster (runner=kfp, trainer.nnodes=1): a Pod + Service the driver creates, owns and deletes; the
    # GPU stages' tasks are then CPU-only clients. "per_task": every task loads what it needs. The
    # inline runner is resident by nature.
    engines: Literal["resident", "per_task"] = "resident"
    # The KFP API (runner=kfp, kfrl submit/schedule); "" = $KF_PIPELINES_ENDPOINT. namespace: the
    # Kubeflow profile namespace of multi-user KFP ("" = $KF_PIPELINES_NAMESPACE, else the client's
    # default). A token comes from $KF_PIPELINES_TOKEN or the service-account token file
    # ($KF_PIPELINES_SA_TOKEN_PATH, default /var/run/secrets/kubeflow/pipelines/token) when present.
    host: str = ""
    namespace: str = ""
    # The KFP UI as a person opens it, for the links in MLflow (kfrl.kfp_run_url); "" = host.
    ui_url: str = ""
    pipeline_root: str = "./kfrl-runs/kfp"
    run_timeout_s: int = 3600


class StageResources(Section):
    """What one KFP task asks of the cluster ("" / 0 = nothing asked)."""
    cpu: str = ""            # request = limit, e.g. "8"
    memory: str = ""         # request = limit, e.g. "64G"
    gpus: int = Field(0, ge=0)
    # kfp's accelerator type: the resource name ("nvidia.com/gpu") or a GKE accelerator ("nvidia-h100-80gb").
    accelerator: str = "nvidia.com/gpu"

    @field_validator("cpu", "memory", mode="before")
    @classmethod
    def _quantity(cls, value):
        return "" if value is None else str(value)  # cpu=8 on a command line is a number; Kubernetes takes "8"


class Toleration(Section):
    key: str = ""
    operator: Literal["Equal", "Exists"] = "Exists"
    value: str = ""
    effect: Literal["", "NoSchedule", "PreferNoSchedule", "NoExecute"] = ""


class ClusterConfig(Section):
    """How `kfrl compile` shapes the pipelines' tasks for a Kubernetes cluster (the local runner
    ignores all of it)."""
    # Images (docker/): the GPU image runs GPU stages, the CPU image the driver, scoring and advantage.
    image: str = "ghcr.io/kfrl/kfrl-gpu:0.1.0"
    cpu_image: str = "ghcr.io/kfrl/kfrl-cpu:0.1.0"
    # Kubernetes secrets (type docker-registry) every task's pod pulls its image with: a private registry.
    image_pull_secrets: list[str] = []
    # Every task's and the engine's image pull policy. IfNotPresent: a node pulls a tagged image once, not
    # for each of an iteration's pods (use Always with a moving tag such as :latest).
    image_pull_policy: Literal["IfNotPresent", "Always", "Never"] = "IfNotPresent"
    # A Kubernetes secret whose keys become environment variables of every task (S3 and MLflow
    # credentials); "" = none. Keys missing from the secret are skipped.
    secret: str = ""
    secret_keys: list[str] = ["AWS_ACCESS_KEY_ID", "AWS_SECRET_ACCESS_KEY", "AWS_ENDPOINT_URL", "AWS_DEFAULT_REGION",
                              "MLFLOW_TRACKING_URI", "MLFLOW_TRACKING_USERNAME", "MLFLOW_TRACKING_PASSWORD"]
    gpu_stages: StageResources = StageResources()
    cpu_stages: StageResources = StageResources()
    # A memory-backed /dev/shm of this size for GPU tasks (PyTorch data loading and NCCL need more than
    # the container default of 64 MB); "" = none.
    shm_size: str = ""
    # Where GPU tasks may run.
    node_selector: dict[str, str] = {}
    tolerations: list[Toleration] = []
    # trainer.nnodes > 1: the update runs as this kind of job, one pod per node, trainer.n_gpus_per_node
    # processes each: a Kubeflow Trainer TrainJob (runtime multi_node_runtime) or a training-operator PyTorchJob.
    multi_node: Literal["trainjob", "pytorchjob"] = "trainjob"
    multi_node_runtime: str = "torch-distributed"


class Config(Section):
    data: DataConfig = DataConfig()
    model: ModelConfig = ModelConfig()
    rollout: RolloutConfig = RolloutConfig()
    algorithm: AlgorithmConfig = AlgorithmConfig()
    actor: ActorConfig = ActorConfig()
    critic: CriticConfig = CriticConfig()
    reward: RewardConfig = RewardConfig()
    trainer: TrainerConfig = TrainerConfig()
    store: StoreConfig = StoreConfig()
    tracking: TrackingConfig = TrackingConfig()
    pipeline: PipelineConfig = PipelineConfig()
    cluster: ClusterConfig = ClusterConfig()

    @model_validator(mode="after")
    def _check_consistency(self) -> "Config":
        for section, mini in (("actor", self.actor.ppo_mini_batch_size), ("critic", self.critic_mini_batch_size)):
            if self.data.train_batch_size % mini != 0:
                raise ValueError(
                    f"data.train_batch_size ({self.data.train_batch_size}) must be a multiple of "
                    f"{section}.ppo_mini_batch_size ({mini})"
                )
        algo = self.algorithm
        if algo.adv_estimator == "gae" and self.critic.enable is False:
            raise ValueError("algorithm.adv_estimator=gae needs a critic; set critic.enable=true (or null)")
        if algo.adv_estimator == "grpo_passk" and self.rollout.n < 2:
            raise ValueError("algorithm.adv_estimator=grpo_passk needs rollout.n >= 2 (it compares a group's best two)")
        if algo.filter_groups.enable and algo.filter_groups.metric == "seq_final_reward" and algo.use_kl_in_reward:
            raise ValueError("algorithm.filter_groups.metric=seq_final_reward with algorithm.use_kl_in_reward=true: "
                             "groups are filtered at rollout, before the reference KL exists; use seq_reward")
        if self.reward.name == "model" and not self.reward.model_path:
            raise ValueError("reward.name=model needs reward.model_path (a sequence-classification model directory)")
        lora_roles = [name for name, rank in (("model", self.model.lora_rank), ("critic", self.critic.lora_rank)) if rank]
        if lora_roles and self.trainer.n_gpus_per_node * self.trainer.nnodes > 1 and self.actor.strategy == "deepspeed":
            raise ValueError(f"{lora_roles[0]}.lora_rank with actor.strategy=deepspeed: a LoRA update over several "
                             "processes keeps the adapters replicated and sums their gradients (DDP), not ZeRO; use "
                             "actor.strategy=fsdp2 (the full-weight update is then FSDP2, the LoRA update DDP)")
        if self.reward.overlong_buffer.enable and self.reward.overlong_buffer.len > self.data.max_response_length:
            raise ValueError(f"reward.overlong_buffer.len ({self.reward.overlong_buffer.len}) exceeds "
                             f"data.max_response_length ({self.data.max_response_length})")
        return self

    # --- derived quantities (one place, so stages agree) -------------------------------------
    @property
    def mini_batch_trajectories(self) -> int:
        return self.actor.ppo_mini_batch_size * self.rollout.n

    @property
    def n_mini_batches(self) -> int:
        return self.data.train_batch_size // self.actor.ppo_mini_batch_size

    @property
    def use_ref(self) -> bool:
        return self.actor.use_kl_loss or self.algorithm.use_kl_in_reward

    @property
    def use_critic(self) -> bool:
        return self.critic.enable if self.critic.enable is not None else self.algorithm.adv_estimator == "gae"

    @property
    def recompute_old_logprobs(self) -> bool:
        # veRL's on-policy shortcut: one mini-batch and one epoch make old == new, so the
        # update uses log_prob.detach() and the separate old-logprob pass is not needed, unless
        # the KL in the reward needs the old log-probs before the update.
        on_policy = self.n_mini_batches == 1 and self.actor.ppo_epochs == 1
        return not on_policy or self.algorithm.use_kl_in_reward

    @property
    def gen_batch_size(self) -> int:
        return self.data.gen_batch_size or self.data.train_batch_size

    @property
    def critic_mini_batch_size(self) -> int:
        return self.critic.ppo_mini_batch_size or self.actor.ppo_mini_batch_size

    @property
    def critic_ppo_epochs(self) -> int:
        return self.critic.ppo_epochs or self.actor.ppo_epochs

    @property
    def critic_shuffle(self) -> bool:
        return self.actor.shuffle if self.critic.shuffle is None else self.critic.shuffle

    @property
    def critic_loss_agg_mode(self) -> str:
        return self.critic.loss_agg_mode or self.actor.loss_agg_mode

    @property
    def registered_model_name(self) -> str:
        return self.tracking.registered_model_name or f"{self.trainer.project_name}-{self.trainer.experiment_name}-policy"

    @property
    def tracking_experiment(self) -> str:
        return self.tracking.experiment_name or self.trainer.project_name

    def to_yaml(self) -> str:
        """The config as YAML for people and for the store: credentials redacted (``kfrl.redaction``).
        Secrets reach a run through the environment (MLflow's and AWS's variables, the cluster's
        secret), never through a stored or printed config."""
        return yaml.safe_dump(self.redacted_tree(), sort_keys=False)

    def flat(self) -> dict[str, Any]:
        """``{"section.key": value}`` (what MLflow params log), credentials redacted."""
        return flatten(self.redacted_tree())

    def redacted_tree(self) -> dict[str, Any]:
        from kfrl.redaction import redact_tree

        return redact_tree(self.model_dump(mode="json"))


def flatten(d: Mapping, prefix: str = "", sep: str = ".") -> dict[str, Any]:
    """Nested mapping -> flat ``{"a.b.c": value}``; lists and tuples become JSON strings."""
    flat: dict[str, Any] = {}
    for key, value in d.items():
        name = f"{prefix}{sep}{key}" if prefix else str(key)
        if isinstance(value, Mapping) and value:
            flat.update(flatten(value, name, sep))
        elif isinstance(value, (list, tuple)):
            flat[name] = json.dumps(value, default=str)
        else:
            flat[name] = value
    return flat


def valid_keys(model: type[BaseModel] = Config, prefix: str = "") -> list[str]:
    keys = []
    for name, field in model.model_fields.items():
        ann = field.annotation
        if isinstance(ann, type) and issubclass(ann, BaseModel):
            keys.extend(valid_keys(ann, f"{prefix}{name}."))
        else:
            keys.append(f"{prefix}{name}")
    return keys


def nearest_key(key: str, candidates: list[str] | None = None) -> str | None:
    candidates = candidates if candidates is not None else valid_keys()
    leaf = key.rsplit(".", 1)[-1]
    by_leaf: dict[str, str] = {}
    for candidate in candidates:  # the first section that has the leaf wins (actor.lr before critic.lr)
        by_leaf.setdefault(candidate.rsplit(".", 1)[-1], candidate)
    # A typo in the full dotted key (critik.lr), then a right name in a wrong section
    # (trainer.ppo_epochs), then looser matches of the full key and of the last part alone.
    match = difflib.get_close_matches(key, candidates, n=1, cutoff=0.86)
    if match:
        return match[0]
    if "." in key and leaf in by_leaf:
        return by_leaf[leaf]
    match = difflib.get_close_matches(key, candidates, n=1, cutoff=0.5)
    if match:
        return match[0]
    match = difflib.get_close_matches(leaf, list(by_leaf), n=1, cutoff=0.6)
    return by_leaf[match[0]] if match else None


def _unknown_key_error(key: str, candidates: list[str] | None = None) -> ConfigError:
    hint = nearest_key(key, candidates)
    msg = f"unknown config key '{key}'"
    if hint:
        msg += f"; did you mean '{hint}'?"
    return ConfigError(msg + " (`kfrl train --dry-run` prints every key with its value)")


def parse_value(text: str) -> Any:
    """A command-line value: YAML scalars and flow collections (``3``, ``1e-6``, ``true``, ``[a, b]``, ``null``)."""
    try:
        return yaml.safe_load(text)
    except yaml.YAMLError:
        return text


def set_dotted(tree: dict, key: str, value: Any) -> None:
    parts = key.split(".")
    node = tree
    for part in parts[:-1]:
        child = node.get(part)
        if child is None:
            child = node[part] = {}
        if not isinstance(child, dict):
            raise _unknown_key_error(key)
        node = child
    node[parts[-1]] = value


def _check_keys(tree: dict, model: type[BaseModel], prefix: str = "") -> None:
    for key, value in tree.items():
        full = f"{prefix}{key}"
        field = model.model_fields.get(key)
        if field is None:
            # Name the whole dotted key the user wrote (``rolout.n``), not just its first part.
            leaf = next(iter(flatten(value)), None) if isinstance(value, dict) else None
            raise _unknown_key_error(f"{full}.{leaf}" if leaf else full)
        ann = field.annotation
        if isinstance(ann, type) and issubclass(ann, BaseModel):
            if not isinstance(value, dict):
                raise ConfigError(f"'{full}' is a section; give its keys, e.g. '{full}.{next(iter(ann.model_fields))}=...'")
            _check_keys(value, ann, full + ".")


def _validation_error(err: ValidationError) -> ConfigError:
    lines = []
    for e in err.errors():
        key = ".".join(str(p) for p in e["loc"]) or "(config)"
        given = e.get("input")
        given_txt = "" if isinstance(given, dict) else f" (got {json.dumps(given, default=str)})"
        lines.append(f"{key}: {e['msg']}{given_txt}")
    return ConfigError("invalid config:\n  " + "\n  ".join(lines))


class _StrictLoader(yaml.SafeLoader):
    """YAML without silent surprises: a key given twice in one mapping is an error, not "last wins"."""


def _construct_mapping(loader: _StrictLoader, node: yaml.MappingNode, deep: bool = False) -> dict:
    seen: dict = {}
    for key_node, _ in node.value:
        key = loader.construct_object(key_node, deep=deep)
        if key in seen:
            raise yaml.constructor.ConstructorError(
                None, None, f"key {key!r} appears twice in one mapping (first on line {seen[key] + 1})",
                key_node.start_mark)
        seen[key] = key_node.start_mark.line
    return yaml.SafeLoader.construct_mapping(loader, node, deep=deep)


_StrictLoader.add_constructor(yaml.resolver.BaseResolver.DEFAULT_MAPPING_TAG, _construct_mapping)


def load_yaml(text: str, source: str) -> Any:
    """Parse YAML strictly; a syntax error or a duplicate key becomes a ConfigError naming ``source``
    and the line."""
    try:
        return yaml.load(text, Loader=_StrictLoader)
    except yaml.YAMLError as err:
        mark = getattr(err, "problem_mark", None)
        where = f"{source}, line {mark.line + 1} column {mark.column + 1}" if mark is not None else source
        problem = getattr(err, "problem", None) or str(err)
        raise ConfigError(f"{where}: {problem}") from None


def build_config(tree: dict) -> Config:
    _check_keys(tree, Config)
    try:
        return Config.model_validate(tree)
    except ValidationError as err:
        raise _validation_error(err) from None


def load_config(path: str | Path | None = None, overrides: list[str] | None = None,
                notices: list[str] | None = None) -> Config:
    """YAML file (optional) + ``section.key=value`` overrides → validated Config.

    Overrides may use veRL's keys (``actor_rollout_ref.actor.optim.lr=1e-6``): they are mapped
    onto kfrl's (kfrl.verl_compat); veRL keys that mean nothing here are appended to ``notices``."""
    from kfrl.verl_compat import VERL_DEFAULTS, all_verl_keys, is_verl_command_line, translate

    kfrl_keys = set(valid_keys())
    tree: dict = {}
    if path is not None:
        p = Path(path)
        if not p.is_file():
            raise ConfigError(f"config file not found: {p}")
        loaded = load_yaml(p.read_text(), str(p)) or {}
        if not isinstance(loaded, dict):
            raise ConfigError(f"{p}: expected a mapping of sections at the top level")
        tree = loaded
    for item in overrides or []:
        if "=" not in item:
            raise ConfigError(f"override '{item}' is not key=value (e.g. actor.lr=1e-5)")
    keys = [item.partition("=")[0].strip().lstrip("+") for item in overrides or []]
    if is_verl_command_line(keys, kfrl_keys):
        # veRL's defaults underneath the YAML file and the overrides.
        base: dict = {}
        for key, value in VERL_DEFAULTS.items():
            set_dotted(base, key, value)
        tree = _merge(base, tree)
        if notices is not None:
            notices.append("veRL command line: veRL's defaults apply where it sets nothing ("
                           + ", ".join(f"{k}={v}" for k, v in VERL_DEFAULTS.items()) + ")")
    for item in overrides or []:
        key, _, raw = item.partition("=")
        key = key.strip().lstrip("+")
        target, value, notice = translate(key, parse_value(raw), kfrl_keys)
        if notice is not None and notices is not None:
            notices.append(notice)
        if target is None:
            continue
        if target not in kfrl_keys:
            raise _unknown_key_error(key, sorted(kfrl_keys) + all_verl_keys())
        set_dotted(tree, target, value)
    return build_config(tree)


def _merge(base: dict, top: dict) -> dict:
    out = dict(base)
    for key, value in top.items():
        out[key] = _merge(out[key], value) if isinstance(value, dict) and isinstance(out.get(key), dict) else value
    return out


def config_from_yaml_text(text: str, source: str = "config.yaml") -> Config:
    tree = load_yaml(text, source) or {}
    if not isinstance(tree, dict):
        raise ConfigError(f"{source}: expected a mapping of sections at the top level")
    return build_config(tree)
