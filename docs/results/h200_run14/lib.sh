# Shared by c2/c3: steps that skip what an earlier warm call finished. D = this call's deadline in $SECONDS.
export XLA_PYTHON_CLIENT_PREALLOCATE=false
V=runs/eval; mkdir -p $V/logs runs/logs
step() {  # step NAME COMMAND...: skipped if done before; output in $V/logs/NAME.log; marks success
  local name=$1; shift
  [ -e $V/logs/$name.done ] && return 0
  local left=$(( D - SECONDS )); [ $left -gt 20 ] || { echo "$name: no time left"; return 1; }
  local t=$SECONDS; timeout $left "$@" > $V/logs/$name.log 2>&1; local rc=$?
  echo "[$SECONDS s] $name rc=$rc in $((SECONDS - t)) s"
  [ $rc -eq 0 ] && touch $V/logs/$name.done; return $rc
}
trained() { grep -q '"step": '$2'[,}]' runs/repro_$1/metrics.jsonl 2>/dev/null && [ -e runs/repro_$1/eval.json ]; }
train() {  # train MODEL PART [--set ...]: resumes; a finished run is not rerun
  local model=$1 part=$2; shift 2
  trained $model $(steps_of $model) && return 0
  timeout $(( D - SECONDS )) python3 train.py --config configs/repro/repro_$model.yaml --set checkpoint.every=100 "$@" > runs/logs/train_${model}_$part.txt 2>&1
  echo "[$SECONDS s] train $model rc=$? $(grep step runs/logs/train_${model}_$part.txt | tail -n 1)"
}
steps_of() { case $1 in fs) echo 7000;; fsl) echo 200;; *) echo 3500;; esac; }
ruler() {  # ruler MODEL CHECKPOINT LONG [--set ...]: S-NIAH-1/2/3, 1x-4x at 25 prompts per call, LONG lengths at 5
  local model=$1 ckpt=$2 long=$3; shift 3
  step ruler_$model python3 -m fsjax.eval.ruler --checkpoint $ckpt --lengths 1024,2048,4096 --num-samples 50 --batch-size 25 --out $V/ruler_$model "$@"
  step ruler_long_$model python3 -m fsjax.eval.ruler --checkpoint $ckpt --lengths $long --num-samples 50 --batch-size 5 --out $V/ruler_long_$model "$@"
}
swa_evals() {  # after SWA's training: copy probe 1x/4x, loss by position at 16x, RULER 1x-64x
  trained swa 3500 || return 1
  step copy_swa python3 -m fsjax.eval.copy_recall --checkpoint runs/repro_swa --lengths 1024,4096 --samples 50 --batch-size 10 --out $V/copy_swa.csv
  step ppl_swa python3 -m fsjax.eval.perplexity --checkpoint runs/repro_swa --length 16384 --buckets 16 --batches 8 --batch-size 1 --out $V/ppl_swa.csv
  ruler swa runs/repro_swa 8192,16384,32768,65536
}
pack() {  # pack NAME: one archive of this call's outputs (a call returns at most 8 files), prompts dropped
  rm -rf /tmp/pack; python3 .dev/s15/slim.py /tmp/pack/eval; cp -r runs/logs /tmp/pack/
  for r in runs/repro_*; do mkdir -p /tmp/pack/$r; cp $r/metrics.jsonl $r/eval.json $r/calibration.json /tmp/pack/$r/ 2>/dev/null; done
  tar -czf $OUT/$1.tar.gz -C /tmp/pack .; ls -la $OUT
}
