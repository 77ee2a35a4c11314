#!/usr/bin/env bash
# The same-call measurements of issue 25 (LoRA, memory options, TRL + PEFT) on one GPU machine:
#   bash bench/issue25_device.sh <part> <out-dir>
# part 05: 0.5B shape (kfrl full / LoRA / bf16+AdamW8bit / offload, TRL full / LoRA) and the GPU tests;
# part lean / lean15: 0.5B / 1.5B, kfrl's leanest full fine-tune against TRL's bf16 run;
# part mem05 / mem15: 0.5B / 1.5B at TRL's precision, with and without actor.use_liger, against TRL's bf16 run;
# part liger05 / liger15: only the liger run of mem05 / mem15 and TRL's (when device time is short);
# part share05 / share15: the liger run with and without model.share_prompt_forward, and TRL's;
# part compile05 / compile15: the liger run against the compiled blocks (actor.use_torch_compile, liger off), and TRL's;
# part 15: 1.5B shape (kfrl full / bf16+AdamW8bit+checkpointing / offload, TRL full) and the GPU tests;
# part 7b: 7B shape, LoRA only (kfrl with and without actor.use_liger, TRL + PEFT); part lean7b: the same with
# gradient checkpointing on both sides.
# part micro15: the 0.5B rollout with the sampler's vocabulary slices of 5 blocks and of 1 (decode_step.py), and the
# 1.5B liger run with micro-batches of 32 and of 64 rows (gradient accumulation halved).
# part spread05: the 0.5B compiled run with and without the trainer-state buffers reserved ahead (the advantage
# stage's spread) and with one intra-op thread, then the torch rollout's CUDA tests.
# part iter: one call's worth (about 9 minutes) after changes to the GPU paths: their CUDA tests, then the
# 0.5B compiled run and the 1.5B liger run (TRL's precision), each beside TRL's run of the same shape.
# part lora05 / lora7b: LoRA (rank 64, all-linear) with kfrl's LoRA linear (kfrl.models.lora_linear, the default)
# and with PEFT's own forward (KFRL_LORA_LINEAR=peft), then TRL + PEFT; lora7b with liger-kernel, micro-batches of 8.
# Every run is the TRL workload (64 prompts x 4 samples, 133 + 256 tokens, one optimizer step).
# The wheels the device image lacks (trl, datasets, pydantic, liger-kernel...: see stack-facts.md) are
# carried in .whl/w (git-ignored; `carry: [".whl"]`) and installed into /tmp/site.
set -u
part=$1; out=$2
mkdir -p "$out"
python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target /tmp/site \
  .whl/w/*.whl 2>&1 | grep -v -i warn | tail -2
export PYTHONPATH=/tmp/site:$PWD/src:$PWD/bench PYTHONUNBUFFERED=1
cd bench
model=/tmp/kfrl-bench-model-$part
case $part in 05|lean|mem05|liger05|share05|compile05|iter|spread05|lora05) shape=0.5b ;;
  15|lean15|mem15|liger15|share15|compile15|micro15) shape=1.5b ;; *) shape=7b ;; esac
python -c "import sys; from pathlib import Path; from gpu_iteration import build_model_dir; build_model_dir(Path('$model'), '$shape')"
# The model's pages on disk before any run: written back during a run, they made its manifests' fsyncs wait
# for the journal (0.5-0.75 s stalls in the ninth session's 1.5B calls).
sync
lora="model.lora_rank=64 model.lora_alpha=128 actor.lr=1e-5"
kfrl() { name=$1; shift; timeout "${KFRL_LIMIT:-240}" python gpu_iteration.py --workload trl --prompt-tokens 133 --shape "$shape" \
    --model-dir "$model" --out "$out/kfrl_${part}_$name.json" "$@" > "$out/kfrl_${part}_$name.log" 2>&1; \
    grep -E "SUMMARY|Error" "$out/kfrl_${part}_$name.log" | tail -3 | sed "s/^/kfrl $name /"; }
trl() { name=$1; shift; timeout "${TRL_LIMIT:-240}" python trl_grpo.py --shape "$shape" --model-dir "$model" \
    --out "$out/trl_${part}_$name.json" "$@" 2>&1 | grep -E "SUMMARY|Error|error" | tail -3 | sed "s/^/trl $name /"; }
case $part in
  05)
    kfrl full --iterations 8
    kfrl lora --iterations 8 $lora
    kfrl bf16_8bit --iterations 8 actor.master_dtype=bfloat16 actor.optimizer=AdamW8bit
    kfrl offload --iterations 8 actor.param_offload=true actor.optimizer_offload=true
    trl full --steps 6
    trl lora --steps 6 --lora-rank 64 --lora-alpha 128
    cd .. && timeout 200 python -m pytest -q -p no:cacheprovider -m gpu tests/test_memory_options.py 2>&1 | tail -3 ;;
  15)
    kfrl full --iterations 6
    kfrl lean --iterations 6 actor.master_dtype=bfloat16 actor.optimizer=AdamW8bit actor.gradient_checkpointing=true
    kfrl offload --iterations 4 actor.param_offload=true actor.optimizer_offload=true
    trl full --steps 5
    cd .. && timeout 120 python -m pytest -q -p no:cacheprovider -m gpu tests/test_memory_options.py 2>&1 | tail -3 ;;
  lean|lean15)  # the leanest full fine-tune (bf16 weights, 8-bit AdamW, gradient checkpointing) and TRL's own
    # precision (bf16 weights and AdamW state, gradient checkpointing: TRL's default) against TRL's bf16 run
    kfrl lean --iterations 5 actor.master_dtype=bfloat16 actor.optimizer=AdamW8bit actor.gradient_checkpointing=true
    kfrl bf16 --iterations 5 actor.master_dtype=bfloat16 actor.gradient_checkpointing=true
    trl full --steps 5 ;;
  mem05|mem15)  # TRL's precision, with and without liger-kernel's fused kernels (actor.use_liger), against TRL's bf16 run
    kfrl bf16 --iterations 5 actor.master_dtype=bfloat16 actor.gradient_checkpointing=true
    kfrl bf16_liger --iterations 5 actor.master_dtype=bfloat16 actor.gradient_checkpointing=true actor.use_liger=true
    trl full --steps 5 ;;
  liger05|liger15)
    kfrl bf16_liger --iterations 5 actor.master_dtype=bfloat16 actor.gradient_checkpointing=true actor.use_liger=true
    trl full --steps 5 ;;
  share05|share15)
    kfrl bf16_liger --iterations 5 actor.master_dtype=bfloat16 actor.gradient_checkpointing=true actor.use_liger=true
    kfrl bf16_liger_share --iterations 5 actor.master_dtype=bfloat16 actor.gradient_checkpointing=true \
      actor.use_liger=true model.share_prompt_forward=true
    trl full --steps 5 ;;
  compile05|compile15)  # the update bound by the host's launches at 0.5B (docs/performance.md): compiled blocks
    kfrl bf16_liger --iterations 5 actor.master_dtype=bfloat16 actor.gradient_checkpointing=true actor.use_liger=true
    kfrl bf16_compile --iterations 5 actor.master_dtype=bfloat16 actor.gradient_checkpointing=true \
      actor.use_torch_compile=true
    trl full --steps 5 ;;
  iter)
    model15=/tmp/kfrl-bench-model-iter15
    (python -c "from pathlib import Path; from gpu_iteration import build_model_dir; build_model_dir(Path('$model15'), '1.5b')" \
      > "$out/build15.log" 2>&1 && sync && touch "$model15.built") &
    (cd .. && timeout 100 python -m pytest -q -p no:cacheprovider tests/test_kernels.py tests/test_state_snapshots.py \
      tests/test_rollout_torch.py -k "kernels_match or cuda or streams" --tb=line -rf 2>&1 | grep -E "^FAILED|^/|passed|failed" | tail -12)
    bf16="actor.master_dtype=bfloat16 actor.gradient_checkpointing=true"
    KFRL_LIMIT=70 kfrl bf16_compile --iterations 5 $bf16 actor.use_liger=false actor.use_torch_compile=true
    TRL_LIMIT=70 trl full --steps 4
    wait  # the 1.5B model's build
    [ -f "$model15.built" ] || { echo "the 1.5B build failed:"; tail -3 "$out/build15.log"; }
    model=$model15 shape=1.5b KFRL_LIMIT=90 kfrl bf16_liger_15 --iterations 5 $bf16 actor.use_liger=true
    model=$model15 shape=1.5b TRL_LIMIT=150 trl full_15 --steps 4
    rm -rf "$model15" ;;
  micro15)  # the sampler's slices (0.5B rollout, decode_step.py), then the 1.5B update's gradient accumulation:
    # micro-batches of 32 rows (8 per step) against 64 (4 per step)
    (cd .. && timeout 100 python -m pytest -q -p no:cacheprovider tests/test_kernels.py 2>&1 | tail -1)
    for programs in 2048 16384; do timeout 60 python decode_step.py --shape 0.5b --parts rollout \
      --kernel-setting SAMPLE_PROGRAMS=$programs --label "programs$programs" --out "$out/decode_programs$programs.json" \
      2>&1 | grep -E "SUMMARY|Error" | tail -2 | sed "s/^/sampler $programs /"; done
    bf16="actor.master_dtype=bfloat16 actor.gradient_checkpointing=true actor.use_liger=true"
    KFRL_LIMIT=90 kfrl bf16_liger_m32 --iterations 5 $bf16
    KFRL_LIMIT=90 kfrl bf16_liger_m64 --iterations 5 $bf16 actor.ppo_micro_batch_size_per_gpu=64 ;;
  spread05)  # the advantage stage's spread: the 0.5B compiled run with the trainer-state buffers reserved on a
    # thread ahead of the first snapshot (the default) and without; then the torch rollout's CUDA tests
    bf16="actor.master_dtype=bfloat16 actor.gradient_checkpointing=true actor.use_liger=false actor.use_torch_compile=true"
    KFRL_LIMIT=80 kfrl reserve --iterations 6 $bf16
    KFRL_LIMIT=80 kfrl no_reserve --iterations 6 $bf16 --no-state-reserve
    # torch's CPU ops on one intra-op thread: a parallel region over 16 threads waits for its slowest, and
    # the background writer and reservation threads keep cores busy
    OMP_NUM_THREADS=1 KFRL_LIMIT=80 kfrl omp1 --iterations 6 $bf16
    (cd .. && timeout 100 python -m pytest -q -p no:cacheprovider tests/test_rollout_torch.py -k cuda --tb=line -rf 2>&1 \
      | grep -E "^FAILED|^/|passed|failed" | tail -12) ;;
  7b)
    # micro-batches of 8 rows on both sides; TRL checkpoints gradients (its default), kfrl does not (with it,
    # measured 2026-12-06: 38% slower for 2 GiB less); kfrl once without, once with liger-kernel's kernels
    KFRL_LIMIT=${KFRL_LIMIT:-200} kfrl lora --iterations 4 $lora actor.ppo_micro_batch_size_per_gpu=8 --keep-weights 1
    KFRL_LIMIT=${KFRL_LIMIT:-200} kfrl lora_liger --iterations 4 $lora actor.ppo_micro_batch_size_per_gpu=8 \
      actor.use_liger=true --keep-weights 1
    TRL_LIMIT=${TRL_LIMIT:-270} trl lora --steps 3 --micro 8 --lora-rank 64 --lora-alpha 128 ;;
  lora05)
    KFRL_LIMIT=90 kfrl lora_fused --iterations 5 $lora
    KFRL_LORA_LINEAR=peft KFRL_LIMIT=90 kfrl lora_peft --iterations 5 $lora
    TRL_LIMIT=120 trl lora --steps 4 --lora-rank 64 --lora-alpha 128 ;;
  lora7b)
    micro8="actor.ppo_micro_batch_size_per_gpu=8 actor.use_liger=true --keep-weights 1"
    KFRL_LIMIT=${KFRL_LIMIT:-150} kfrl lora_liger_fused --iterations 3 $lora $micro8
    KFRL_LORA_LINEAR=peft KFRL_LIMIT=${KFRL_LIMIT:-150} kfrl lora_liger_peft --iterations 3 $lora $micro8
    TRL_LIMIT=${TRL_LIMIT:-220} trl lora --steps 3 --micro 8 --lora-rank 64 --lora-alpha 128 ;;
  lean7b)  # 7B LoRA with gradient checkpointing on both sides (TRL's default) and liger-kernel's kernels
    KFRL_LIMIT=${KFRL_LIMIT:-150} kfrl lora_ckpt_liger --iterations 3 $lora actor.ppo_micro_batch_size_per_gpu=8 \
      actor.gradient_checkpointing=true actor.use_liger=true --keep-weights 1
    TRL_LIMIT=${TRL_LIMIT:-200} trl lora --steps 3 --micro 8 --lora-rank 64 --lora-alpha 128 ;;
esac
rm -rf "$model"  # a 7B shape is 15 GB: parts run one after another on one machine's 64 GiB disk
nvidia-smi --query-gpu=name,memory.total --format=csv,noheader
