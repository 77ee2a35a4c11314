#!/usr/bin/env bash
# The decode-step measurements of issue 25 in one device call:
#   bash bench/decode_device.sh <out-dir> [shapes...]
# per shape: the rollout of the tree at .whl/old_head (the code before this change, when present), then
# this tree's rollout, step profile and attention sweep. PARTS=rollout,profile leaves the sweep out.
# EXTRA="label=path ..." runs more source trees' rollout and profile (EXTRA_PARTS) in the same call, e.g. a
# branch exported with `mkdir -p .whl/NAME && git archive BRANCH src | tar -x -C .whl/NAME` and
# EXTRA="NAME=.whl/NAME/src" (carry .whl/NAME). VARIANTS="label=NAME=VALUE[,NAME=VALUE] ..." runs this tree's
# rollout and profile (EXTRA_PARTS) with constants of kfrl.engines.kernels set, e.g. "split2=ATTENTION_SPLITS=2".
set -u
out=$1; shift
mkdir -p "$out"
cd bench
export PYTHONPATH=$PWD/../src:$PWD
nvidia-smi --query-gpu=name --format=csv,noheader
shapes=("$@")
[ ${#shapes[@]} -eq 0 ] && shapes=(0.5b 1.5b)
for s in "${shapes[@]}"; do
  if [ -d ../.whl/old_head/src ]; then
    PYTHONPATH=$PWD/../.whl/old_head/src:$PWD timeout 90 python decode_step.py --shape "$s" --parts rollout \
      --label before --out "$out/before_$s.json" 2>&1 | grep -E "SUMMARY|Error" | cut -c1-400
  fi
  timeout 220 python decode_step.py --shape "$s" --parts "${PARTS:-rollout,profile,attention}" --label after \
    --out "$out/after_$s.json" 2>&1 | grep -E "SUMMARY|Error" | cut -c1-2500
  for tree in ${EXTRA:-}; do
    label=${tree%%=*}
    PYTHONPATH=$PWD/../${tree#*=}:$PWD timeout 120 python decode_step.py --shape "$s" \
      --parts "${EXTRA_PARTS:-rollout,profile}" --label "$label" --out "$out/${label}_$s.json" 2>&1 \
      | grep -E "SUMMARY|Error" | cut -c1-1500
  done
  for variant in ${VARIANTS:-}; do
    label=${variant%%=*}
    settings=()
    IFS=, read -ra pairs <<< "${variant#*=}"
    for pair in "${pairs[@]}"; do settings+=(--kernel-setting "$pair"); done
    timeout 120 python decode_step.py --shape "$s" --parts "${EXTRA_PARTS:-rollout,profile}" --label "$label" \
      "${settings[@]}" --out "$out/${label}_$s.json" 2>&1 | grep -E "SUMMARY|Error" | cut -c1-1500
  done
done
