# Call 48 (#9, #8): TF++ on the configs' recipe, ZHA distilled on it; then in parallel copy recall 1x/2x/4x,
# S-NIAH-1 at 1x, perplexity (ZHA keys attended) at 1x.
python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target /tmp/site .whl/*.whl && export PYTHONPATH=/tmp/site:$PWD || exit
export PYTHONUNBUFFERED=1 XLA_PYTHON_CLIENT_PREALLOCATE=false
E=runs/repro_eval; mkdir -p $E
left() { echo $((575 - SECONDS)); }
T0=$SECONDS; timeout 370 python3 train.py --config configs/repro/repro_tfpp.yaml > $E/train_tfpp.txt 2>&1; echo "tfpp rc=$? $((SECONDS-T0))s"; tail -2 $E/train_tfpp.txt
T0=$SECONDS; timeout 100 python3 train.py --config configs/repro/repro_zha.yaml > $E/train_zha.txt 2>&1; echo "zha rc=$? $((SECONDS-T0))s"; tail -2 $E/train_zha.txt
T0=$SECONDS; L=$(( $(left) - 15 ))
timeout $L python3 -m fsjax.eval.copy_recall --checkpoint runs/repro_tfpp runs/repro_zha --lengths 1024,2048,4096 --samples 50 --batch-size 10 --out $E/copy_tf_zha.csv > $E/copy_tf_zha.txt 2>&1 &
timeout $L python3 -m fsjax.eval.ruler --checkpoint runs/repro_tfpp runs/repro_zha --tasks niah_single_1 --lengths 1024 --num-samples 50 --batch-size 25 --out $E/ruler_1x > $E/ruler_1x.txt 2>&1 &
timeout $L python3 -m fsjax.eval.perplexity --checkpoint runs/repro_tfpp runs/repro_zha --length 1024 --buckets 4 --batches 4 --batch-size 8 > $E/ppl_1x.txt 2>&1 &
wait; echo "evals $((SECONDS-T0))s"; grep "^|" $E/copy_tf_zha.txt $E/ruler_1x.txt $E/ppl_1x.txt
cp runs/repro_tfpp/metrics.jsonl $E/metrics_tfpp.jsonl; cp runs/repro_zha/metrics.jsonl $E/metrics_zha.jsonl 2>/dev/null
tar -czf $OUT/call48.tar.gz $E; echo total $SECONDS
