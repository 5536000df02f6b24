# call E (#9): K=16 / RULER outputs of call C; FS copy at 32x/64x; FS-L with a longer CPT (800 steps) and its copy recall.
python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target /tmp/site .whl/*.whl && export PYTHONPATH=/tmp/site:$PWD || exit
export PYTHONUNBUFFERED=1 XLA_PYTHON_CLIENT_PREALLOCATE=false
E=$OUT/e; mkdir -p $E
tail -5 runs/fsl7k/metrics.jsonl | cut -c1-200
timeout 200 python3 train.py --config configs/repro/repro_fsl.yaml --workdir runs/fsl7k800 --set train.init_from=runs/fs7k --set train.steps=800 > $E/train_fsl7k800.txt 2>&1 & FSL=$!
timeout 480 python3 -m fsjax.eval.copy_recall --checkpoint runs/fs7k --lengths 32768,65536 --samples 50 --batch-size 5 --out $E/copy_fs7k_long.csv > $E/copy_fs7k_long.txt 2>&1 &
wait $FSL; echo "fsl800 $SECONDS s"; tail -3 $E/train_fsl7k800.txt
timeout $(( 500 - SECONDS )) python3 -m fsjax.eval.copy_recall --checkpoint runs/fsl7k800 --lengths 1024,4096,16384 --samples 50 --batch-size 10 --out $E/copy_fsl800.csv > $E/copy_fsl800.txt 2>&1 &
wait; grep -h "^|" $E/copy_fs7k_long.txt $E/copy_fsl800.txt; tail -3 $E/copy_fs7k_long.txt
cp runs/fsl7k800/metrics.jsonl $E/metrics_fsl7k800.jsonl
echo total $SECONDS
