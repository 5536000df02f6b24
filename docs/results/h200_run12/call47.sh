# Call 47 (#9): FS on the configs' recipe (3,500 steps, checkpoints every 500), then in parallel: copy recall per
# checkpoint at 1x, FS-L's CPT, FS-B's tau calibration; then copy recall FS/FS-L at 4k/16k if time is left.
python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target /tmp/site .whl/*.whl && export PYTHONPATH=/tmp/site:$PWD || exit
export PYTHONUNBUFFERED=1 XLA_PYTHON_CLIENT_PREALLOCATE=false
E=runs/repro_eval; mkdir -p $E
left() { echo $((580 - SECONDS)); }
T0=$SECONDS; timeout 470 python3 train.py --config configs/repro/repro_fs.yaml --set checkpoint.keep=8 > $E/train_fs.txt 2>&1; echo "fs rc=$? $((SECONDS-T0))s"; tail -3 $E/train_fs.txt; ls runs/repro_fs/checkpoints
T0=$SECONDS
timeout $(( $(left) - 20 )) python3 -m fsjax.eval.copy_recall --checkpoint $(ls -d runs/repro_fs/checkpoints/* | sort -V) --lengths 1024 --samples 50 --batch-size 10 --out $E/copy_fs_steps.csv > $E/copy_fs_steps.txt 2>&1 &
timeout $(( $(left) - 20 )) python3 train.py --config configs/repro/repro_fsl.yaml > $E/train_fsl.txt 2>&1 & FSL=$!
timeout $(( $(left) - 20 )) python3 -m fsjax.calibrate --checkpoint runs/repro_fs > $E/calibrate_fs.txt 2>&1 &
wait $FSL; echo "fsl rc=$? $((SECONDS-T0))s"; tail -2 $E/train_fsl.txt
wait; echo "parallel done $((SECONDS-T0))s"; grep "^|" $E/copy_fs_steps.txt; tail -3 $E/calibrate_fs.txt
if [ $(left) -gt 50 ]; then T0=$SECONDS; timeout $(( $(left) - 10 )) python3 -m fsjax.eval.copy_recall --checkpoint runs/repro_fs runs/repro_fsl --lengths 4096,16384 --samples 50 --batch-size 10 --out $E/copy_fs_fsl.csv > $E/copy_fs_fsl.txt 2>&1; echo "copy rc=$? $((SECONDS-T0))s"; grep "^|" $E/copy_fs_fsl.txt; fi
cp runs/repro_fs/metrics.jsonl $E/metrics_fs.jsonl; cp runs/repro_fsl/metrics.jsonl $E/metrics_fsl.jsonl 2>/dev/null; cp runs/repro_fs/calibration.json runs/repro_fs/eval.json $E/ 2>/dev/null
tar -czf $OUT/call47.tar.gz $E; echo total $SECONDS
