# call F (#9): FS read with K=16 (OOM in call C with four processes); FS-L's copy-sample routing probe at 1x and 4x.
python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target /tmp/site .whl/*.whl && export PYTHONPATH=/tmp/site:$PWD || exit
export PYTHONUNBUFFERED=1 XLA_PYTHON_CLIENT_PREALLOCATE=false
E=$OUT/f; mkdir -p $E
timeout 380 python3 -m fsjax.eval.copy_recall --checkpoint runs/fs7k --lengths 1024,4096,16384 --samples 50 --batch-size 10 --set attention.top_k=16 --out $E/copy_fs7k_k16.csv > $E/copy_fs7k_k16.txt 2>&1 &
timeout 380 python3 -m fsjax.eval.probe --checkpoint runs/fsl7k --length 4096 --copies 20 --out $E/probe_copies_fsl7k_4x > $E/probe_copies_fsl7k_4x.txt 2>&1 &
timeout 380 python3 -m fsjax.eval.probe --checkpoint runs/fsl7k --length 1024 --copies 20 --out $E/probe_copies_fsl7k_1x > $E/probe_copies_fsl7k_1x.txt 2>&1 &
wait; grep -h "^|" $E/copy_fs7k_k16.txt; tail -3 $E/copy_fs7k_k16.txt; grep -h "selected:" $E/probe_copies_fsl7k_*.txt
echo total $SECONDS
