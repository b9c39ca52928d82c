"""Writes where training scripts write: a checkpoint in out/, its own folder, and a summary
where its first argument says."""
import os
import sys

os.makedirs("out", exist_ok=True)
with open(os.path.join("out", "ckpt.pt"), "wb") as fh:
    fh.write(b"weights")
with open(sys.argv[1], "w") as fh:
    fh.write("loss 0.1\n")
print(f"wrote {sys.argv[1]}")
