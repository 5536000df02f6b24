# Session call 2 (warm, within 30 s of call 1): FS and SWA resume; once SWA has its 3,500 steps, its evaluations.
[ -d runs/repro_fs/checkpoints ] || { echo "runs/repro_fs missing: the machine was not warm"; exit 3; }
. .dev/s15/prefix.sh; D=570; . .dev/s15/lib.sh
train fs 2 &
{ train swa 2; swa_evals; } &
wait
grep -h "^|" $V/logs/*.log | head -40
pack c2; echo total $SECONDS
