# Session call 1 (fresh machine). #8: the ZHA decode table and one profile, alone on the GPU. Then #9: FS (7,000
# steps) and SWA (3,500) train side by side from scratch, with ZHA's compiled kernel tests beside them.
. .dev/s15/prefix.sh
E=$OUT/c1; mkdir -p $E runs/logs
nvidia-smi --query-gpu=name,driver_version,memory.total --format=csv > $E/gpu.txt 2>&1
T=$SECONDS
(cd benchmarks && timeout 170 python3 zha_decode.py > $E/zha_table.txt 2>&1; echo "rc=$?" >> $E/zha_table.txt)
echo "table $((SECONDS-T)) s"; grep -E "^\||rc=" $E/zha_table.txt | cut -c1-160
T=$SECONDS
(cd benchmarks && timeout 80 python3 zha_decode.py --lengths 65536,262144 --geometries R1-C8-L2,R16-C16-L3 --top-p 0.9 --profile > $E/zha_profile.txt 2>&1; echo "rc=$?" >> $E/zha_profile.txt)
echo "profile $((SECONDS-T)) s"; grep -E "^\||launch|rc=" $E/zha_profile.txt | cut -c1-160 | head -30
export XLA_PYTHON_CLIENT_PREALLOCATE=false
D=585; L=$(( D - SECONDS ))
timeout $L python3 train.py --config configs/repro/repro_fs.yaml --set checkpoint.every=100 > runs/logs/train_fs_1.txt 2>&1 &
timeout $L python3 train.py --config configs/repro/repro_swa.yaml --set checkpoint.every=100 > runs/logs/train_swa_1.txt 2>&1 &
( timeout $L python3 -m pytest -q -p no:cacheprovider tests/test_kernel_tree_routing.py -k "score or leaf or stack or capped or shared or children or keep_top"; echo "rc=$?";
  timeout $(( D - SECONDS )) python3 -m pytest -q -p no:cacheprovider tests/test_zha_model.py; echo "rc=$?" ) > $E/tests_gpu.txt 2>&1 &
wait
for f in runs/logs/train_*_1.txt; do echo "== $f"; grep step $f | tail -n 2; done
tail -n 4 $E/tests_gpu.txt; grep -E "rc=|passed|failed" $E/tests_gpu.txt
cp runs/logs/train_*_1.txt $E/
echo total $SECONDS
