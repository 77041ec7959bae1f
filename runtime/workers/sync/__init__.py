"""The weight sync: how the trainers' weights reach the rollout engines (base.py: the interface;
a module per kind). docs/architecture.md, "The weight sync"."""
