"""The trainer: its logprob path, the critic, the optimizer; no process or Ray knowledge."""
