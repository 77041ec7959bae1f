"""Agents that are programs of their own: the policy behind an OpenAI-compatible endpoint
(server.py), every call recorded token by token (calls.py), episodes turned into training
rows from those records, and ``rollout.agent`` programs run once per sample (runner.py)."""
