# Next session, call A (#9, fresh machine): FS with train.steps=7000, first part (cut by time after ~4,000 steps; checkpoints
# every 500), then the copy probe by checkpoint at 1x and at 176/256 tokens, and the copy-sample routing probe.
python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target /tmp/site .whl/*.whl && export PYTHONPATH=/tmp/site:$PWD || exit
export PYTHONUNBUFFERED=1 XLA_PYTHON_CLIENT_PREALLOCATE=false
E=runs/repro_eval; mkdir -p $E
T0=$SECONDS; timeout 470 python3 train.py --config configs/repro/repro_fs.yaml --workdir runs/fs7k --set train.steps=7000 --set checkpoint.keep=20 > $E/train_fs7k_a.txt 2>&1; echo "fs7k rc=$? $((SECONDS-T0))s"; tail -2 $E/train_fs7k_a.txt; ls runs/fs7k/checkpoints
L=$(( 560 - SECONDS ))
timeout $L python3 -m fsjax.eval.copy_recall --checkpoint $(ls -d runs/fs7k/checkpoints/* | sort -V) --lengths 1024 --samples 50 --batch-size 10 --out $E/copy_fs7k_a.csv > $E/copy_fs7k_a.txt 2>&1 &
timeout $L python3 -m fsjax.eval.copy_recall --checkpoint runs/fs7k --lengths 176,256 --samples 50 --batch-size 10 --out $E/copy_fs7k_short.csv > $E/copy_fs7k_short.txt 2>&1 &
timeout $L python3 -m fsjax.eval.probe --checkpoint runs/fs7k --length 1024 --copies 20 --out $E/probe_copies_fs7k_a > $E/probe_copies_fs7k_a.txt 2>&1 &
wait; grep -h "^|" $E/copy_fs7k_a.txt $E/copy_fs7k_short.txt; tail -14 $E/probe_copies_fs7k_a.txt
cp runs/fs7k/metrics.jsonl $E/metrics_fs7k_a.jsonl
tar -czf $OUT/next_a.tar.gz $E; echo total $SECONDS
