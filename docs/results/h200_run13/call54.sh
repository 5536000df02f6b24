# Next session, call B (#9), made while call A's machine is warm: FS resumes to 7,000 steps; probes again.
[ -d runs/fs7k/checkpoints ] || { echo "runs/fs7k missing: the machine was not warm"; exit 3; }
python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target /tmp/site .whl/*.whl && export PYTHONPATH=/tmp/site:$PWD || exit
export PYTHONUNBUFFERED=1 XLA_PYTHON_CLIENT_PREALLOCATE=false
E=runs/repro_eval; mkdir -p $E
T0=$SECONDS; timeout 470 python3 train.py --config configs/repro/repro_fs.yaml --workdir runs/fs7k --set train.steps=7000 --set checkpoint.keep=20 > $E/train_fs7k_b.txt 2>&1; echo "fs7k rc=$? $((SECONDS-T0))s"; tail -3 $E/train_fs7k_b.txt
L=$(( 560 - SECONDS ))
timeout $L python3 -m fsjax.eval.copy_recall --checkpoint $(ls -d runs/fs7k/checkpoints/* | sort -V | tail -7) --lengths 1024 --samples 50 --batch-size 10 --out $E/copy_fs7k_b.csv > $E/copy_fs7k_b.txt 2>&1 &
timeout $L python3 -m fsjax.eval.probe --checkpoint runs/fs7k --length 1024 --copies 20 --out $E/probe_copies_fs7k_b > $E/probe_copies_fs7k_b.txt 2>&1 &
wait; grep -h "^|" $E/copy_fs7k_b.txt; tail -14 $E/probe_copies_fs7k_b.txt
cp runs/fs7k/metrics.jsonl $E/metrics_fs7k.jsonl
tar -czf $OUT/next_b.tar.gz $E; echo total $SECONDS
