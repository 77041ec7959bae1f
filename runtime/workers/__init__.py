"""Where engines and trainers run: the interface (base.py), in process (local.py), sharded
with FSDP2 (fsdp.py), on Ray actors (ray.py)."""
