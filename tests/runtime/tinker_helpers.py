"""Names shared by the ``rldsl serve-tinker`` tests (tests/runtime/tinker/): the served model's
name, as the cookbook resolves it offline (its ``role_colon`` renderer), and the client's key."""

NAME = "Qwen/Qwen3-8B-Base"
KEY = "tml-test"
