"""entropy: a term added to the per-token loss from the policy's entropy.

Signature: ``(entropy [B, T]) -> term [B, T]``.
"""
from __future__ import annotations

from typing import TYPE_CHECKING, Any

from ..lazy_torch import torch
from ..registry import Float, register

if TYPE_CHECKING:
    from torch import Tensor


@register("entropy", off=True)
def none(entropy: Tensor) -> Tensor:
    """No entropy term (entropy is still measured when given).

    formula: 0
    source: -
    shapes: -> [B, T]
    """
    return torch.zeros_like(entropy)


@register("entropy", needs=("entropy",), roles={"scale": "coef"}, coef=Float(doc="bonus coefficient", ge=0))
def bonus(entropy: Tensor, coef: float) -> Tensor:
    """Entropy bonus: rewards a spread-out policy.

    formula: l_it -= {coef} H_it,  H = logsumexp(z) - sum softmax(z) z
    source: PPO (Schulman et al. 2017); verl actor.entropy_coeff; TRL entropy_coef
    shapes: [B, T] -> [B, T]
    """
    return -coef * entropy


ADAPTIVE_COEF, ADAPTIVE_LAST = "entropy_coef", "entropy_last"  # CompiledAlgorithm.state keys


@register("entropy", needs=("entropy", "entropy_coef"),
          init=Float(0.0, "coefficient at the first step (TRL entropy_coef)", ge=0, runtime=True),
          min=Float(0.0, "lower bound of the coefficient (TRL entropy_coef_min)", ge=0, runtime=True),
          max=Float(1.0, "upper bound of the coefficient (TRL entropy_coef_max)", ge=0, runtime=True),
          delta=Float(0.005, "step of the coefficient per optimizer step (TRL entropy_coef_delta)", gt=0,
                      runtime=True),
          target=Float(0.2, "mean per-token entropy (nats) at or below which the bonus acts (TRL entropy_target)",
                       runtime=True))
def adaptive(entropy: Tensor) -> Tensor:
    """Entropy bonus whose coefficient c_k follows the measured entropy (runtime state).

    formula: l_it -= c_k H_it,  c_k = coef_k if H_{k-1} <= {target} else 0;  after step k: coef_{k+1} = min(coef_k + {delta}, {max}) if H_k <= {target} else max(coef_k - {delta}, {min});  coef_0 = {init}, H_{-1} = +inf
    source: Skywork-OR1 (He et al. 2025, arXiv 2505.22312) adaptive entropy control; TRL
      GRPOTrainer use_adaptive_entropy (entropy_coef, entropy_coef_min/max/delta, entropy_target)
    shapes: [B, T] -> [B, T] (the term before c_k; loss() multiplies by its entropy_coef= input)
    edge cases: H_k is the mean entropy over the loss-mask tokens of optimizer step k (all
      micro-batches and ranks); the first step applies no bonus (H_{-1} = +inf, as TRL);
      coef and H_{k-1} are kept in CompiledAlgorithm.state, so checkpoints carry them.
    """
    return -entropy


def adaptive_coef(state: dict[str, Tensor], params: dict[str, Any]) -> Tensor:
    """c_k: the coefficient ``entropy adaptive`` applies at the coming optimizer step (0-dim)."""
    coef = state.get(ADAPTIVE_COEF)
    last = state.get(ADAPTIVE_LAST)
    c = float(params["init"]) if coef is None else float(coef)
    h = float("inf") if last is None else float(last)
    return torch.tensor(c if h <= params["target"] else 0.0, dtype=torch.float64)


def adaptive_update(state: dict[str, Tensor], params: dict[str, Any], measured: float) -> float:
    """After an optimizer step whose mean entropy was ``measured``: the next coefficient (and H_k) into ``state``."""
    coef = state.get(ADAPTIVE_COEF)
    c = float(params["init"]) if coef is None else float(coef)
    if measured <= params["target"]:
        c = min(c + params["delta"], params["max"])
    else:
        c = max(c - params["delta"], params["min"])
    state[ADAPTIVE_COEF] = torch.tensor(c, dtype=torch.float64)
    state[ADAPTIVE_LAST] = torch.tensor(float(measured), dtype=torch.float64)
    return c
