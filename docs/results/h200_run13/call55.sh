# Next session, call C (#9), made while call B's machine is warm: FS-L's CPT from the 7,000-step FS, FS-B's tau,
# then copy recall of FS, FS-L and FS-B at 1x, 4x and 16x (the extrapolation claim, if FS copies at 1x). ~500 s.
[ -d runs/fs7k/checkpoints ] || { echo "runs/fs7k missing: the machine was not warm"; exit 3; }
python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target /tmp/site .whl/*.whl && export PYTHONPATH=/tmp/site:$PWD || exit
export PYTHONUNBUFFERED=1 XLA_PYTHON_CLIENT_PREALLOCATE=false
E=$OUT/c; mkdir -p $E
T0=$SECONDS
timeout 120 python3 train.py --config configs/repro/repro_fsl.yaml --workdir runs/fsl7k --set train.init_from=runs/fs7k > $E/train_fsl7k.txt 2>&1 & FSL=$!
timeout 120 python3 -m fsjax.calibrate --checkpoint runs/fs7k > $E/calibrate_fs7k.txt 2>&1
wait $FSL; echo "fsl rc=$? $((SECONDS-T0))s"; tail -2 $E/train_fsl7k.txt; tail -1 $E/calibrate_fs7k.txt
L=$(( 540 - SECONDS ))
timeout $L python3 -m fsjax.eval.copy_recall --checkpoint runs/fs7k runs/fsl7k --lengths 1024,4096,16384 --samples 50 --batch-size 10 --out $E/copy_fs_fsl_7k.csv > $E/copy_fs_fsl_7k.txt 2>&1 &
timeout $L python3 -m fsjax.eval.copy_recall --checkpoint runs/fs7k --lengths 1024,4096 --samples 50 --batch-size 5 --set attention.kind=fsb --out $E/copy_fsb_7k.csv > $E/copy_fsb_7k.txt 2>&1 &
timeout $L python3 -m fsjax.eval.copy_recall --checkpoint runs/fs7k --lengths 1024,4096,16384 --samples 50 --batch-size 10 --set attention.top_k=16 --out $E/copy_fs7k_k16.csv > $E/copy_fs7k_k16.txt 2>&1 &
timeout $L python3 -m fsjax.eval.ruler --checkpoint runs/fs7k --tasks niah_single_1,niah_single_2 --lengths 1024,4096 --num-samples 50 --batch-size 25 --out $E/ruler_fs7k > $E/ruler_fs7k.txt 2>&1 &
wait; grep -h "^|" $E/ruler_fs7k.txt $E/copy_fs_fsl_7k.txt $E/copy_fsb_7k.txt $E/copy_fs7k_k16.txt
cp runs/fsl7k/metrics.jsonl $E/metrics_fsl7k.jsonl 2>/dev/null
echo total $SECONDS
