#!/usr/bin/env bash
# docs/results.md: trains and evaluates the small-scale length-extrapolation models on one GPU.
#
#   python scripts/build_corpus.py --train-chars 1000000000 --max-chars 100000000 --out data/repro
#   scripts/repro.sh tf    # TF++ and SWA in parallel, then ZHA distilled on TF++, then their evaluations
#   scripts/repro.sh fs    # FS, then FS-L (CPT) and FS-B's τ calibration in parallel, then their evaluations
#   scripts/repro.sh decode  # FS-L state bytes and decode tokens/s against TF++ (random weights), alone on a GPU
#
# The two chains are independent; with two GPUs run them at once, one per GPU (CUDA_VISIBLE_DEVICES). Each
# chain's models share the GPU as concurrent processes: a 43M model leaves most of an H200 idle. Every step is
# one documented CLI call (the commands are printed), so any of them can be rerun alone. Outputs:
#   runs/repro_<model>/            checkpoints, metrics.jsonl, eval.json (held-out loss at 1x)
#   runs/repro_eval/copy_<model>.csv long-range copy recall by distance (fsjax.eval.copy_recall)
#   runs/repro_eval/needles_<model>.csv the same with random-id needles as the copied span (--needle-ids)
#   runs/repro_eval/ruler_<model>/ RULER S-NIAH-1/2/3 scores.csv and every prediction (ruler_long_<model>/
#                                  for lengths beyond 8k)
#   runs/repro_eval/ppl_<model>.csv held-out loss (and ZHA keys attended) by position at 16x
#   runs/repro_eval/decode.txt     FS-L state bytes and decode tokens/s vs TF++ per length
#   runs/repro_eval/steps_<chain>.tsv wall seconds and exit status per step
# `fsjax.eval.ruler` rewrites scores.csv after every task and length, so a run cut short keeps what it scored.
# Smoke runs shrink everything through the environment: REPRO_SET (extra train.py overrides, space separated),
# REPRO_LENGTHS (RULER), REPRO_PROBE_LENGTHS (copy probe), REPRO_DECODE_LENGTHS (both default to
# REPRO_LENGTHS), REPRO_SAMPLES, REPRO_PPL_LENGTH.
set -uo pipefail
chain=${1:?usage: scripts/repro.sh tf|fs|decode}
lengths=${REPRO_LENGTHS:-1024,2048,4096,8192,16384,32768,65536}
probe_lengths=${REPRO_PROBE_LENGTHS:-$lengths}
samples=${REPRO_SAMPLES:-50}
ppl_length=${REPRO_PPL_LENGTH:-16384}
overrides=()
for assignment in ${REPRO_SET:-}; do overrides+=(--set "$assignment"); done
export XLA_PYTHON_CLIENT_PREALLOCATE=false PYTHONUNBUFFERED=1  # several processes share one GPU
eval_dir=runs/repro_eval
mkdir -p "$eval_dir/logs"

# step NAME COMMAND...: runs the command with its output in $eval_dir/logs/NAME.log and records its time.
step() {
  local name=$1 start=$SECONDS
  shift
  echo "[$(date +%T)] $name: $*"
  "$@" >"$eval_dir/logs/$name.log" 2>&1
  local status=$?
  printf '%s\t%s\t%s\n' "$name" "$((SECONDS - start))" "$status" >>"$eval_dir/steps_$chain.tsv"
  echo "[$(date +%T)] $name: exit $status after $((SECONDS - start)) s"
  return $status
}

train() { step "train_$1" python train.py --config "configs/repro/repro_$1.yaml" "${overrides[@]}"; }

# lengths_between LIST LOW HIGH: the comma-separated lengths of LIST in [LOW, HIGH].
lengths_between() { tr , '\n' <<<"$1" | awk -v low="$2" -v high="$3" '$1 >= low && $1 <= high' | paste -sd,; }

# evaluate MODEL CHECKPOINT BATCH MAX_PROBE_LENGTH [--set ...]: the copy-recall probe at every probe length up
# to MAX_PROBE_LENGTH, in its text and its needle form (the copied span is random ids of the 32k vocabulary, past
# its 3 special tokens), held-out loss by position, then S-NIAH-1/2/3 at every length: up to 8k at BATCH prompts
# per call, beyond at 5 (at 25, three evaluations sharing a GPU ran out of memory from 4k to 32k).
evaluate() {
  local model=$1 checkpoint=$2 batch=$3 max_probe=$4
  shift 4
  local probe=$(lengths_between "$probe_lengths" 0 "$max_probe")
  step "copy_$model" python -m fsjax.eval.copy_recall --checkpoint "$checkpoint" --lengths "$probe" \
      --samples "$samples" --batch-size 1 --out "$eval_dir/copy_$model.csv" "$@"
  step "needles_$model" python -m fsjax.eval.copy_recall --checkpoint "$checkpoint" --lengths "$probe" \
      --samples "$samples" --batch-size 1 --needle-ids 3,32000 --out "$eval_dir/needles_$model.csv" "$@"
  step "ppl_$model" python -m fsjax.eval.perplexity --checkpoint "$checkpoint" --length "$ppl_length" \
      --buckets 16 --batches 8 --batch-size 1 --out "$eval_dir/ppl_$model.csv" "$@"
  local short=$(lengths_between "$lengths" 0 8192) long=$(lengths_between "$lengths" 8193 1000000000)
  [ -z "$short" ] || step "ruler_$model" python -m fsjax.eval.ruler --checkpoint "$checkpoint" --lengths "$short" \
      --num-samples "$samples" --batch-size "$batch" --out "$eval_dir/ruler_$model" "$@"
  [ -z "$long" ] || step "ruler_long_$model" python -m fsjax.eval.ruler --checkpoint "$checkpoint" \
      --lengths "$long" --num-samples "$samples" --batch-size 5 --out "$eval_dir/ruler_long_$model" "$@"
}

case $chain in
  tf)
    train tfpp & train swa & wait
    train zha & distilled=$!
    evaluate tfpp runs/repro_tfpp 25 65536 &
    evaluate swa runs/repro_swa 25 65536 &
    wait $distilled && evaluate zha runs/repro_zha 25 16384  # the ZHA reference forward outgrows memory past 16k
    wait
    ;;
  fs)
    train fs
    train fsl & continued=$!
    { step calibrate_fs python -m fsjax.calibrate --checkpoint runs/repro_fs &&
      evaluate fsb runs/repro_fs 10 16384 --set attention.kind=fsb; } &  # compile time grows with the forest
    evaluate fs runs/repro_fs 25 65536 &
    wait $continued && evaluate fsl runs/repro_fsl 25 65536
    wait
    ;;
  decode)  # run it alone on a GPU, so the timings are not shared
    step decode python benchmarks/decode.py --preset repro_43m --kinds fsl,tfpp \
        --lengths "${REPRO_DECODE_LENGTHS:-$lengths}" --decode-tokens 64 --case-timeout 120
    cp "$eval_dir/logs/decode.log" "$eval_dir/decode.txt"
    ;;
  *)
    echo "unknown chain $chain (tf, fs or decode)" >&2
    exit 2
    ;;
esac
cat "$eval_dir/steps_$chain.tsv"
