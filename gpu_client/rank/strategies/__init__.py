"""How a rank trains with the others: DDP and FSDP (``parallel``), TP, PIPELINE, mixed devices,
DILOCO and LoRA, each a ``parallel.Collective``."""
