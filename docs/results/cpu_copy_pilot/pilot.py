"""Ad-hoc CPU pilot after run 12 (docs/results.md): can FS's long-range branch learn content-based copying?

Rows of random ids repeating one random sequence with a period of 40-60 tokens, longer than the local radius of
32, so FS must copy through its long-range branch (NoPE readout of K selected cells of 8). TF++ of the same
shape as the reference. The held-out text evaluation is meaningless here (ids beyond the 515-id vocabulary), so
the vocabulary check is bypassed.

    python docs/results/cpu_copy_pilot/pilot.py tfpp 4 5000 /tmp/pilot/tfpp    # and fs 4, fs 32

The runs of docs/results.md were stopped by hand once their loss had settled (the logs here end there).
"""
import sys

from fsjax.config import load_config
from fsjax.train import loop

loop.check_vocabulary = lambda config: None
kind, top_k, steps, workdir = sys.argv[1], int(sys.argv[2]), int(sys.argv[3]), sys.argv[4]
overrides = [
    "model.vocab_size=515", "model.num_layers=2", "model.d_model=64", "model.num_heads=4", "model.head_dim=16",
    f"model.attention.kind={kind}", "model.attention.window=32", "model.attention.cell=8",
    "model.attention.block=32", f"model.attention.top_k={top_k}",
    "data.source=random", "data.random_ids=[3,515]", "data.random_period=[40,60]", "data.seq_len=256",
    "train.batch_size=16", f"train.steps={steps}", "train.learning_rate=3e-3", "train.lr_floor=3e-4",
    "train.warmup_steps=100", "eval.niah_samples=0", "eval.batches=1", "eval.batch_size=8", "log.every=100",
    f"checkpoint.every={steps}", "checkpoint.async_save=false",
]
loop.train(load_config("configs/tiny_fs.yaml", overrides), workdir)
