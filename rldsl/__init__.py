"""rldsl: a declarative language for RL-for-LLM training algorithms.

    import rldsl
    algo = rldsl.load("algorithms/dapo.rl")     # or rldsl.load("dapo"), rldsl.loads(text)
    fn = rldsl.compile(algo)                    # torch.compile'd loss; compile=False for eager
    adv = fn.advantages(rewards, group_size=G, mask=m)
    out = fn.loss(logprobs, old_logprobs, adv, mask)
    out.loss.backward(); out.metrics

See docs/api.md for the full contract.
"""
import importlib
from typing import Any

from .errors import SpecError, SpecErrors

#: the public names and their modules, imported on first use; torch is imported at the first
#: tensor operation (rldsl/lazy_torch.py): loading a spec does not, ``rldsl.compile`` does
_LAZY = {"Algorithm": "spec", "library": "spec", "load": "spec", "loads": "spec",
         "CompiledAlgorithm": "compiled", "Estimate": "compiled", "LossOutput": "compiled",
         "compile": "compiled", "SlotValue": "values"}


def __getattr__(name: str) -> Any:
    if name not in _LAZY:
        raise AttributeError(f"module 'rldsl' has no attribute {name!r}")
    importlib.import_module(".components", __name__)  # registers every component in the registry
    value = getattr(importlib.import_module(f".{_LAZY[name]}", __name__), name)
    globals()[name] = value
    return value


__all__ = ["Algorithm", "CompiledAlgorithm", "Estimate", "LossOutput", "SlotValue", "SpecError",
           "SpecErrors", "compile", "library", "load", "loads"]
__version__ = "0.1.0"
