"""Training checkpoints: written complete or not at all, checked before they are read.

    manager.py    CheckpointManager: save (atomic rename), keep_last, resume, the COMPLETE marker
    integrity.py  sha256 of every checkpoint file, computed while it is written
    safe_io.py    weights in and out without unpickling (sharded safetensors, weights-only .pt)
    fit.py        why a checkpoint does not fit this run's model, in one line
    offline.py    reading a checkpoint without training: resolve, verify, consolidate FSDP2 shards,
                  rebuild the model (what export and eval use)
"""
