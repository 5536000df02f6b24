# Call 49 (#9, #8), made while call 48's machine is warm: RULER S-NIAH-1/2/3 for TF++ at 1x-4x and ZHA at 1x-2x,
# copy recall TF++ at 8x/16x, loss by position at 16x for TF++ and ZHA (keys attended). Budget-limited: LIMIT s.
[ -d runs/repro_tfpp/checkpoints ] || { echo "runs/repro_tfpp missing: the machine was not warm"; exit 3; }
python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target /tmp/site .whl/*.whl && export PYTHONPATH=/tmp/site:$PWD || exit
export PYTHONUNBUFFERED=1 XLA_PYTHON_CLIENT_PREALLOCATE=false
E=runs/repro_eval; mkdir -p $E; rm -f $E/*.txt.done
L=$(( ${LIMIT:-500} - 25 ))
timeout $L python3 -m fsjax.eval.ruler --checkpoint runs/repro_tfpp --tasks niah_single_1,niah_single_2,niah_single_3 --lengths 1024,2048,4096 --num-samples 50 --batch-size 25 --out $E/ruler_tfpp > $E/ruler_tfpp.txt 2>&1 &
timeout $L python3 -m fsjax.eval.ruler --checkpoint runs/repro_zha --tasks niah_single_1,niah_single_2,niah_single_3 --lengths 1024,2048 --num-samples 50 --batch-size 25 --out $E/ruler_zha > $E/ruler_zha.txt 2>&1 &
timeout $L python3 -m fsjax.eval.copy_recall --checkpoint runs/repro_tfpp --lengths 8192,16384 --samples 50 --batch-size 5 --out $E/copy_tf_long.csv > $E/copy_tf_long.txt 2>&1 &
timeout $L python3 -m fsjax.eval.perplexity --checkpoint runs/repro_tfpp --length 16384 --buckets 16 --batches 8 --batch-size 1 --out $E/ppl_tfpp.csv > $E/ppl_tfpp.txt 2>&1 &
wait; echo "evals $SECONDS s"; grep "^|" $E/ruler_tfpp.txt $E/ruler_zha.txt $E/copy_tf_long.txt $E/ppl_tfpp.txt; cat $E/ruler_tfpp/scores.csv $E/ruler_zha/scores.csv
tar -czf $OUT/call49.tar.gz $E; echo total $SECONDS
