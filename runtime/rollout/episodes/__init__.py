"""Multi-turn episodes: tools, tool-call parsers, environments and the episode runner.

STAND-IN (helper A2, for the tool-use demo): the minimal HF-engine, one-process subset of the
episode contract (tools.py, parsers.py, env.py, runner.py), written because the full
machinery had not landed when the demo needed it. Replace it with the full version.
"""
