"""rldsl: a declarative language for RL-for-LLM training algorithms.

    import rldsl
    algo = rldsl.load("algorithms/dapo.rl")     # or rldsl.load("dapo"), rldsl.loads(text)
    fn = rldsl.compile(algo)                    # torch.compile'd loss; compile=False for eager
    adv = fn.advantages(rewards, group_size=G, mask=m)
    out = fn.loss(logprobs, old_logprobs, adv, mask)
    out.loss.backward(); out.metrics

See docs/api.md for the full contract.
"""
from . import components  # noqa: F401  (registers every component in the registry)
from .compiled import CompiledAlgorithm, Estimate, LossOutput, compile
from .errors import SpecError, SpecErrors
from .spec import Algorithm, library, load, loads
from .values import SlotValue

__all__ = ["Algorithm", "CompiledAlgorithm", "Estimate", "LossOutput", "SlotValue", "SpecError",
           "SpecErrors", "compile", "library", "load", "loads"]
__version__ = "0.1.0"
