"""Where engines and trainers run: the interface (base.py), the factory (start.py), in process
(local.py, local_trainers.py), sharded with FSDP2 (fsdp.py, fsdp_rank.py), on Ray actors (ray.py
and the modules it names)."""
