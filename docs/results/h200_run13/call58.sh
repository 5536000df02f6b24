# call G (#9): FS-L's pool size (retain_top 64/128 cells) at 1x/4x; FS-B at 16x; FS read with K=16 at 64x.
python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target /tmp/site .whl/*.whl && export PYTHONPATH=/tmp/site:$PWD || exit
export PYTHONUNBUFFERED=1 XLA_PYTHON_CLIENT_PREALLOCATE=false
E=$OUT/g; mkdir -p $E
timeout 330 python3 -m fsjax.eval.copy_recall --checkpoint runs/fsl7k --lengths 1024,4096 --samples 50 --batch-size 10 --set attention.retain_top=64 --out $E/copy_fsl_p64.csv > $E/copy_fsl_p64.txt 2>&1 &
timeout 330 python3 -m fsjax.eval.copy_recall --checkpoint runs/fsl7k --lengths 4096 --samples 50 --batch-size 10 --set attention.retain_top=128 --out $E/copy_fsl_p128.csv > $E/copy_fsl_p128.txt 2>&1 &
timeout 330 python3 -m fsjax.eval.copy_recall --checkpoint runs/fs7k --lengths 16384 --samples 50 --batch-size 5 --set attention.kind=fsb --out $E/copy_fsb_16x.csv > $E/copy_fsb_16x.txt 2>&1 &
wait; grep -h "^|" $E/*.txt; tail -n2 $E/*.txt | grep -i error
echo total $SECONDS
