"""Rewards: the verifier and the built-in rewards (verify), the reward-spec language (spec), the weighted
sum (functions), reward models (model), reward servers and judges over HTTP (remote), `rldsl serve-reward`
(server) and `rldsl reward` (cli). The names below are the weighted-sum API every other folder uses."""

from .verify import (
    exact_reward, addition_reward, Extraction, last_boxed, find_final_answer, extract_final_answer,
    equivalent, Verdict, gsm8k_gold, judge_math, judge_gsm8k, math_reward, gsm8k_reward,
    BUILTIN_REWARDS, VERDICTS,
)
from .spec import split_reward_name, resolve_reward, batch_reward, parse_reward_spec, EnvironmentReward
from .functions import RewardResult, unscored, CORRECT_ABOVE, correct, RewardTerm, RewardFn
