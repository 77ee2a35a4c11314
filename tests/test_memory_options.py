"""Memory options of a training copy (actor.* / critic.*): bf16 master weights (master_dtype), 8-bit AdamW
moments (optimizer=AdamW8bit), parameter and optimizer offload to host memory between updates; with
veRL's keys."""
import io
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file

from kfrl.config import load_config
from kfrl.driver.controller import train
from kfrl.engines.optim8bit import FP8_TINY, AdamW8bit, dequantize, quantize, quantize_nonzero
from kfrl.run import Run
from kfrl.stages import update
from run_tables import demo_config, forget_process_state

SMALL = ["data.train_batch_size=4", "actor.ppo_mini_batch_size=4", "rollout.n=4", "data.max_response_length=16",
         "actor.ppo_micro_batch_size_per_gpu=8", "trainer.log_generations=0", "trainer.val_before_train=false",
         "pipeline.runner=inline", "trainer.test_freq=-1", "data.builtin_val_size=8"]


def least_squares(seed=0):
    generator = torch.Generator().manual_seed(seed)
    x = torch.randn(256, 64, generator=generator)
    return x, x @ torch.randn(64, 32, generator=generator), torch.randn(64, 32, generator=generator)


def fit(optimizer_class, steps: int, w0: torch.Tensor, state=None, **kwargs):
    x, y, _ = least_squares()
    weight = torch.nn.Parameter(w0.clone())
    optimizer = optimizer_class([weight], lr=1e-2, weight_decay=0.01, **kwargs)
    if state is not None:
        optimizer.load_state_dict(state)
    for _ in range(steps):
        optimizer.zero_grad()
        ((x @ weight - y) ** 2).mean().backward()
        optimizer.step()
    return weight.detach(), optimizer


def test_8bit_adamw_follows_adamw_with_a_quarter_of_the_state():
    w0 = least_squares()[2]
    exact, _ = fit(torch.optim.AdamW, 200, w0)
    eight, optimizer = fit(AdamW8bit, 200, w0, min_8bit_size=1)
    # Moments rounded to 3 mantissa bits (6 %) move the path by a few per cent of the distance travelled.
    assert (eight - exact).norm() / (exact - w0).norm() < 0.1
    x, y, _ = least_squares()
    start = ((x @ w0 - y) ** 2).mean()
    assert ((x @ eight - y) ** 2).mean() < 0.2 * start
    per_value = optimizer.state_bytes() / w0.numel()
    assert 2.0 < per_value < 2.1  # two 1-byte moments, a 4-byte scale per 256 values, one step counter
    # A tensor under min_8bit_size keeps fp32 moments (biases, norms): exactly torch's AdamW then.
    small, _ = fit(AdamW8bit, 20, w0)
    assert torch.allclose(small, fit(torch.optim.AdamW, 20, w0)[0], rtol=1e-5, atol=1e-6)


def test_8bit_state_round_trips_exactly_and_never_loses_a_positive_second_moment():
    w0 = least_squares()[2]
    straight, _ = fit(AdamW8bit, 20, w0, min_8bit_size=1)
    half, optimizer = fit(AdamW8bit, 10, w0, min_8bit_size=1)
    buffer = io.BytesIO()
    torch.save(optimizer.state_dict(), buffer)
    buffer.seek(0)
    saved = torch.load(buffer, weights_only=True)
    assert saved["state"][0]["exp_avg_codes"].dtype == torch.float8_e4m3fn
    resumed, again = fit(AdamW8bit, 10, half, state=saved, min_8bit_size=1)
    assert torch.equal(resumed, straight)
    assert again.state[again.param_groups[0]["params"][0]]["exp_avg_codes"].dtype == torch.float8_e4m3fn

    values = torch.cat([torch.tensor([1.0]), torch.logspace(-12, -1, 255)])  # one block, 12 decades
    codes, scale = quantize_nonzero(values, 256)
    restored = dequantize(codes, scale, 256)
    assert (restored > 0).all() and restored.min() >= FP8_TINY * scale.min()
    plain_codes, plain_scale = quantize(values, 256)
    assert (dequantize(plain_codes, plain_scale, 256) == 0).any()  # what the guard is for
    big = values > 1e-3
    assert ((restored[big] - values[big]).abs() / values[big]).max() < 2 ** -4


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_8bit_adamw_steps_a_large_tensor_in_pieces_with_the_values_of_one_whole_step(dtype):
    generator = torch.Generator().manual_seed(0)
    w0 = torch.randn(63, 33, generator=generator).to(dtype)  # 2079 values: the last block is partial
    grads = [torch.randn(63, 33, generator=generator).to(dtype) for _ in range(5)]

    def run(chunk_size):
        weight = torch.nn.Parameter(w0.clone())
        optimizer = AdamW8bit([weight], lr=1e-2, min_8bit_size=1, chunk_size=chunk_size)
        for grad in grads:
            weight.grad = grad.clone()
            optimizer.step()
        return weight.detach(), optimizer.state[weight]

    whole, whole_state = run(1 << 24)
    pieces, pieces_state = run(3 * 256)  # three pieces of 768, 768 and 543 values
    assert not torch.equal(whole, w0) and torch.equal(whole, pieces)
    for key in ("exp_avg_codes", "exp_avg_sq_codes"):
        assert torch.equal(whole_state[key].view(torch.uint8), pieces_state[key].view(torch.uint8))
    for key in ("exp_avg_scale", "exp_avg_sq_scale"):
        assert torch.equal(whole_state[key], pieces_state[key])
    with pytest.raises(ValueError, match="chunk_size=1000 must be a multiple of block_size=256"):
        AdamW8bit([torch.nn.Parameter(w0.clone())], chunk_size=1000)


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")
def test_8bit_adamw_step_of_a_large_tensor_holds_a_bounded_working_set():
    weight = torch.nn.Parameter(torch.randn(64 << 20, device="cuda", dtype=torch.bfloat16))
    weight.grad = torch.randn_like(weight)
    optimizer = AdamW8bit([weight], lr=1e-3, chunk_size=1 << 22)
    optimizer.step()  # the state is allocated here
    torch.cuda.synchronize()
    held = torch.cuda.memory_allocated()
    torch.cuda.reset_peak_memory_stats()
    optimizer.step()
    torch.cuda.synchronize()
    # Stepped whole, six fp32 copies of 64 Mi values (1.5 GiB); in pieces of 4 Mi values, a few of those.
    assert torch.cuda.max_memory_allocated() - held < 8 * (1 << 22) * 4


def config(root: Path, *extra):
    return demo_config(root, *SMALL, *extra)


def test_bf16_master_weights_with_8bit_adamw_train_and_resume_exactly_from_the_store(tmp_path):
    options = ["actor.master_dtype=bfloat16", "actor.optimizer=AdamW8bit", "actor.lr=1e-3"]
    forget_process_state()
    straight = Run.at(train(config(tmp_path / "a", *options), run_id="a", iterations=3).run_uri)
    model, optimizer = update._RESIDENT_TRAINERS["actor"][1:3]
    assert {p.dtype for p in model.parameters()} == {torch.bfloat16}
    assert isinstance(optimizer, AdamW8bit)
    big = [s for s in optimizer.state.values() if "exp_avg_codes" in s]
    assert big and all(s["exp_avg_codes"].dtype == torch.float8_e4m3fn for s in big)
    forget_process_state()
    resumed = Run.at(train(config(tmp_path / "b", *options, "trainer.trainer_state_freq=1"), run_id="b",
                           iterations=2).run_uri)
    forget_process_state()  # a new process: iteration 3 starts from the committed bf16 weights and 8-bit state
    train(config(tmp_path / "b", *options, "trainer.trainer_state_freq=1"), run_id="b", iterations=3)
    assert resumed.manifest("update_actor", 3).info["trainer_from"] == "store"
    state = load_file(resumed.store.committed_dir(resumed.manifest("actor_state", 3)) / "model.safetensors")
    assert {t.dtype for t in state.values()} == {torch.bfloat16}
    a, b = (load_file(r.store.committed_dir(r.manifest("update_actor", 3)) / "model.safetensors")
            for r in (straight, resumed))
    assert a.keys() == b.keys() and all(torch.equal(a[k], b[k]) for k in a)
    assert any(straight.manifest("update_actor", i).metrics["actor/grad_norm"] > 0 for i in (1, 2, 3))


def test_verl_memory_and_lora_keys_map_onto_kfrl():
    notices = []
    cfg = load_config(None, [
        "actor_rollout_ref.model.lora_rank=32", "actor_rollout_ref.model.lora_alpha=64",
        "actor_rollout_ref.model.target_modules=[q_proj,v_proj]",
        "actor_rollout_ref.actor.fsdp_config.param_offload=true",
        "actor_rollout_ref.actor.fsdp_config.optimizer_offload=true",
        "actor_rollout_ref.actor.fsdp_config.model_dtype=bf16",
        "actor_rollout_ref.actor.optim.optimizer=AdamW8bit",
        "actor_rollout_ref.actor.optim.optimizer_impl=bitsandbytes.optim",
        "critic.model.lora_rank=8", "critic.model.fsdp_config.model_dtype=fp32", "critic.optim.optimizer=_AdamW",
        "actor_rollout_ref.model.use_liger=true",
    ], notices=notices)
    assert cfg.actor.use_liger and not load_config(None, []).actor.use_liger
    assert (cfg.model.lora_rank, cfg.model.lora_alpha, cfg.model.target_modules) == (32, 64, ["q_proj", "v_proj"])
    assert (cfg.actor.param_offload, cfg.actor.optimizer_offload) == (True, True)
    assert (cfg.actor.master_dtype, cfg.actor.optimizer) == ("bfloat16", "AdamW8bit")
    assert (cfg.critic.lora_rank, cfg.critic.master_dtype, cfg.critic.optimizer) == (8, "float32", "AdamW")
    assert any("optimizer_impl" in n for n in notices)
    assert load_config(None, ["model.lora_rank=8", "trainer.n_gpus_per_node=2"]).model.lora_rank == 8
    with pytest.raises(ValueError, match="actor.strategy=deepspeed"):
        load_config(None, ["model.lora_rank=8", "trainer.n_gpus_per_node=2", "actor.strategy=deepspeed"])
    with pytest.raises(ValueError, match="actor.optimizer"):
        load_config(None, ["actor.optimizer=Lion"])


def test_liger_kernels_are_refused_off_cuda_with_the_key_to_change():
    from kfrl.models.hf_io import load_causal_lm
    from kfrl.models.tiny import materialize_builtin

    model = load_causal_lm(materialize_builtin("builtin:tiny-qwen2-arith"))
    with pytest.raises(ValueError, match=r"actor.use_liger needs a CUDA device.*set actor.use_liger=false"):
        update.apply_liger_kernels(model, "cpu")


def run_stages(root: Path, iterations: int, *extra) -> Run:
    """The run's stages called in turn in this process (as the resident engine calls them), without the
    controller (no MLflow: the GPU machine has none)."""
    from kfrl.stages import STAGES, run_stage
    from kfrl.stages.prepare import prepare_run
    from kfrl.store import Store

    cfg = config(root, *extra, f"trainer.total_iterations={iterations}")
    store = Store(str(root / "store" / "run"))
    prepare_run(store, cfg)
    update.write_states_in_background(True)
    try:
        for iteration in range(1, iterations + 1):
            for stage in STAGES:
                run_stage(stage, store.uri, iteration)
    finally:
        update.drain()
        update.write_states_in_background(False)
    return Run.at(store.uri)


@pytest.mark.parametrize("lora", [[], ["model.lora_rank=4", "critic.lora_rank=4"]], ids=["full", "lora"])
def test_gradient_checkpointing_recomputes_blocks_and_trains_as_without(tmp_path, lora):
    """Actor and critic (GAE) with veRL's enable_gradient_checkpointing, full or LoRA: the same committed
    weights (or adapters) as without, and each block's forward runs again in the backward pass."""
    options = ["algorithm.adv_estimator=gae", "actor.lr=1e-3", "critic.lr=1e-3", *lora]
    weights = "adapter_model.safetensors" if lora else "model.safetensors"
    forget_process_state()
    plain = run_stages(tmp_path / "a", 2, *options)
    forget_process_state()
    checkpointed = run_stages(tmp_path / "b", 2, *options,
                              "actor_rollout_ref.model.enable_gradient_checkpointing=true",
                              "critic.model.enable_gradient_checkpointing=true")
    for stage in ("update_actor", "update_critic"):
        a, b = (load_file(r.store.committed_dir(r.manifest(stage, 2)) / weights)
                for r in (plain, checkpointed))
        assert a.keys() == b.keys()
        assert not all(torch.equal(a[k], load_file(plain.store.committed_dir(plain.manifest(stage, 1))
                                                   / weights)[k]) for k in a)  # it trained
        assert all(torch.allclose(a[k], b[k], rtol=1e-5, atol=1e-7) for k in a), stage
    for role in ("actor", "critic"):
        model = update._RESIDENT_TRAINERS[role][1]
        hf_model = model.get_base_model() if lora else model
        block = hf_model.base_model.layers[0]
        calls = []
        mlp_forward = type(block.mlp).forward
        # Counted in forward itself: module hooks do not fire when checkpointing recomputes a block.
        block.mlp.forward = lambda *args, **kwargs: (calls.append(1), mlp_forward(block.mlp, *args, **kwargs))[1]
        try:
            model.train()
            out = model(input_ids=torch.tensor([[1, 2, 3, 4]]))
            (out.logits.float().sum()).backward()
        finally:
            del block.mlp.forward
            model.zero_grad(set_to_none=True)
        assert len(calls) == 2, role  # once forward, once recomputed for the backward


def test_checkpointed_blocks_recompute_under_the_forwards_attention_kernels():
    """The backward runs outside the update's attention_kernels(); a recomputed block must still use the
    forward's SDPA kernels (cuDNN attention saves other shapes: torch's CheckpointError on CUDA). Only the
    global kernel flags are exercised, so this runs on CPU."""
    from transformers import Qwen2Config, Qwen2ForCausalLM

    from kfrl.engines.inference import attention_kernels

    torch.manual_seed(0)
    model = Qwen2ForCausalLM(Qwen2Config(vocab_size=32, hidden_size=16, intermediate_size=32, num_hidden_layers=2,
                                         num_attention_heads=2, num_key_value_heads=1))
    update.enable_gradient_checkpointing(model, "cuda")
    block = model.model.layers[0]
    cudnn_allowed = []
    mlp_forward = type(block.mlp).forward
    block.mlp.forward = lambda *args, **kwargs: (cudnn_allowed.append(torch.backends.cuda.cudnn_sdp_enabled()),
                                                 mlp_forward(block.mlp, *args, **kwargs))[1]
    model.train()
    assert torch.backends.cuda.cudnn_sdp_enabled()
    with attention_kernels("cuda"):
        loss = model(input_ids=torch.tensor([[1, 2, 3, 4]])).logits.float().sum()
    loss.backward()
    assert cudnn_allowed == [False, False]  # forward, recompute
    assert torch.backends.cuda.cudnn_sdp_enabled()  # restored after the recompute


@pytest.mark.gpu
def test_offloaded_training_copies_wait_in_host_memory_and_train_as_without(tmp_path):
    if not torch.cuda.is_available():
        pytest.skip("needs a GPU")
    gpu = ["trainer.device=cuda", "rollout.name=hf", "actor.use_kl_loss=true"]
    forget_process_state()
    plain = run_stages(tmp_path / "a", 3, *gpu)
    forget_process_state()
    offloaded = run_stages(tmp_path / "b", 3, *gpu, "actor.param_offload=true", "actor.optimizer_offload=true")
    model, optimizer = update._RESIDENT_TRAINERS["actor"][1:3]
    assert all(p.device.type == "cpu" for p in model.parameters())
    from kfrl.models.host_memory import SMALL_TENSOR, is_page_locked

    # The weights wait in the host buffers kept for the next offload; large ones are page-locked.
    kept = {t.data_ptr() for t in model._kfrl_offload_buffers}
    assert all(p.data_ptr() in kept for p in model.parameters())
    assert all(is_page_locked(p.data) for p in model.parameters() if p.numel() * p.element_size() >= SMALL_TENSOR)
    assert all(t.device.type == "cpu" for s in optimizer.state.values() for t in s.values() if torch.is_tensor(t))
    metrics = offloaded.manifest("update_actor", 3).metrics
    assert metrics["timing_s/offload"] > 0 and metrics["timing_s/onload"] > 0
    a, b = (load_file(r.store.committed_dir(r.manifest("update_actor", 3)) / "model.safetensors")
            for r in (plain, offloaded))
    assert all(torch.equal(a[k], b[k]) for k in a)


@pytest.mark.gpu
def test_a_lora_run_on_the_gpu_hands_merged_weights_to_the_torch_decoder(tmp_path):
    """The torch decoder (CUDA graphs) takes the merged weights in place; the reference is the training
    copy with adapters off; a fresh process that loads base + adapter commits the same rollout."""
    if not torch.cuda.is_available():
        pytest.skip("needs a GPU")
    lora = ["trainer.device=cuda", "rollout.name=torch", "actor.use_kl_loss=true", "model.lora_rank=8",
            "actor.lr=5e-3"]
    forget_process_state()
    run = run_stages(tmp_path / "a", 3, *lora)
    assert run.manifest("update_actor", 3).info["adapter"] is True
    assert run.manifest("rollout", 3).info.get("rollout_backend") == "torch"
    assert run.manifest("update_actor", 3).metrics["actor/kl_loss"] > 0
