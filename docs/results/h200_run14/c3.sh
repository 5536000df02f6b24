# Session call 3 (warm): FS finishes its 7,000 steps; then FS-L's CPT and FS-B's tau; RULER for FS (1x-64x), FS-L
# (1x-16x), FS-B (1x, 4x); the needle form of the copy probe for FS and FS-L (1x-16x) and FS-L's needle retention;
# FS's loss by position at 16x; SWA's evaluations if call 2 did not finish them. DEADLINE: seconds this call has.
[ -d runs/repro_fs/checkpoints ] || { echo "runs/repro_fs missing: the machine was not warm"; exit 3; }
. .dev/s15/prefix.sh; D=$(( ${DEADLINE:-560} - 20 )); . .dev/s15/lib.sh
N="--needle-ids 3,32000 --samples 50"
{ train fs 3; trained fs 7000 || exit 1
  { train fsl 1; trained fsl 200 || exit 1
    step needles_fsl python3 -m fsjax.eval.copy_recall --checkpoint runs/repro_fsl --lengths 1024,4096,16384 $N --batch-size 10 --out $V/needles_fsl.csv
    step probe_needles_fsl python3 -m fsjax.eval.probe --checkpoint runs/repro_fsl --length 4096 --copies 20 --needle-ids 3,32000 --out $V/probe_needles_fsl_4x
    ruler fsl runs/repro_fsl 8192,16384; } &
  { step calibrate_fs python3 -m fsjax.calibrate --checkpoint runs/repro_fs &&
    step ruler_fsb python3 -m fsjax.eval.ruler --checkpoint runs/repro_fs --lengths 1024,4096 --num-samples 50 --batch-size 10 --set attention.kind=fsb --out $V/ruler_fsb; } &
  ruler fs runs/repro_fs 8192,16384,32768,65536 &
  { step needles_fs python3 -m fsjax.eval.copy_recall --checkpoint runs/repro_fs --lengths 1024,4096,16384 $N --batch-size 10 --out $V/needles_fs.csv
    step ppl_fs python3 -m fsjax.eval.perplexity --checkpoint runs/repro_fs --length 16384 --buckets 16 --batches 8 --batch-size 1 --out $V/ppl_fs.csv; } &
  wait; } &
wait
grep -h "^|" $V/logs/*.log | head -60
pack c3; echo total $SECONDS
