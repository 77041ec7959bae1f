"""The episode runner: G episodes per row, each turn sampled token-in/token-out with
``engine.generate_ids``; only the environment's messages are tokenized, as the chat
template's delta after the model's own tokens."""
from __future__ import annotations

from dataclasses import replace
from typing import Any, Sequence

from rldsl.lazy_torch import torch  # imported at the first tensor operation: `rldsl run` checks first

from ...batch import Episode, RolloutBatch, TokenRow, first_records, sequence_routing
from ...config import RunConfig
from ...data.sources import system_prompt as source_system_prompt
from ..engines.base import SamplingParams
from ...errors import EnvironmentFailed
from ...models.kinds import ModelKind, text_kind
from .env import Environment, ToolEnv, env_reset, env_step, load_env
from .parsers import text_for_tools
from .tools import load_tools, tool_schema


def _render(tokenizer: Any, messages: list[dict], schemas: list[dict] | None, generation: bool,
            kwargs: dict) -> str:
    return tokenizer.apply_chat_template(messages, tools=schemas or None, tokenize=False,
                                         add_generation_prompt=generation, **kwargs)


#: A turn's text for reading the template's closing of it: no space to trim, no markup.
_STAND_IN = "x7q"


def _turn_seed(seed: int | None, turn: int) -> int | None:
    return None if seed is None else (seed * 1_000_003 + turn) % 2**63


def env_delta(tokenizer: Any, messages: list[dict], new: list[dict], schemas: list[dict] | None,
              stopped: bool, kwargs: dict) -> str:
    """The text the template puts after the model's last turn (``messages[-1]``, whose sampled
    tokens end with EOS when ``stopped``) and before the next generation: the end of that turn
    not sampled by the model, then ``new`` rendered, then the generation prompt."""
    before = _render(tokenizer, messages[:-1], schemas, True, kwargs)
    with_turn = _render(tokenizer, messages, schemas, False, kwargs)
    after = _render(tokenizer, messages + new, schemas, True, kwargs)
    # The turn's closing is read off a rendering of a stand-in turn: a template may rewrite the
    # model's text (Llama 3.1's trims it), and the model's tokens are kept as sampled anyway.
    stand_in = _render(tokenizer, messages[:-1] + [{**messages[-1], "content": _STAND_IN}], schemas, False, kwargs)
    if not stand_in.startswith(before + _STAND_IN) or not after.startswith(with_turn):
        raise ValueError("the chat template renders an earlier turn differently once later messages "
                         "follow: its delta cannot be appended token-in/token-out")
    tail = stand_in[len(before + _STAND_IN):]
    eos = tokenizer.eos_token or ""
    if stopped and eos and tail.startswith(eos):
        tail = tail[len(eos):]  # the model sampled its EOS already
    return tail + after[len(with_turn):]


def run_episodes(engine: Any, tokenizer: Any, rows: Sequence[dict], envs: Sequence[Environment],
                 params: SamplingParams, *, max_turns: int, context: int | None = None,
                 chat_template_kwargs: dict | None = None, kind: ModelKind | None = None) -> RolloutBatch:
    """``params.n`` episodes per row (groups contiguous; ``envs`` has one per episode). A row is
    what ``reset`` receives: ``prompt`` (the data row's own, untemplated: a string or messages),
    ``answer``, and ``system`` when set; the chat template is applied here, once, with the tools.

    ``prompt_ids`` = the rendered first prompt; ``response_ids`` = every later token (model +
    environment); ``response_mask`` = 1 on the model's tokens only; ``response_attention`` = 1
    on every real token; ``logprobs`` = the engine's, 0 off the model's tokens;
    ``finish_reason``: "stop" when the environment ended the episode, "length" when a turn hit
    max_new_tokens, the context is full or max_turns ran out; ``completions`` = the last turn
    as the engine decoded it (no special tokens: what rewards read); ``episodes`` = each
    episode's messages, its ``step_rewards`` (``[position, reward]`` of each step that returned
    a reward, the position the last response token of the model's turn it answered) and
    ``env_reward``, their sum (None when no step returned one).
    With tools, an assistant message is its turn's text with the special tokens kept but the stop
    token (parsers.text_for_tools: the tool parser's markers may be special tokens).
    ``routed_experts`` (a mixture-of-experts policy on an engine that records its routing): each
    token's experts as first recorded -- the first prompt's in the first prefill, the model's
    tokens as they were sampled, the environment's (and each turn's last sampled token, which
    its own turn never feeds) in the next turn's prefill (``batch.first_records``); -1 on tokens
    no turn fed (padding, the last token, an observation after which the context was full); None
    when a turn came back without routing.
    ``kind``: the policy's (models/kinds/; None: a text model's). A vision-language policy's
    reads image parts in any message (the first user turn's, an environment's later ones) as their
    expanded image tokens, and each row's prompt is a ``VisionPrompt`` carrying every image its
    tokens hold, in order (the engine's next turns and the trainer's forwards read their pixels)."""
    kwargs = dict(chat_template_kwargs or {})
    kind = kind if kind is not None else text_kind(tokenizer)
    G = params.n
    B = len(rows) * G
    if len(envs) != B:
        raise ValueError(f"need one environment per episode: {B}, got {len(envs)}")
    convs: list[list[dict]] = []
    schemas: list[list[dict] | None] = []
    for i, env in enumerate(envs):
        convs.append(list(env_reset(env, dict(rows[i // G]))))
        tools = getattr(env, "tools", None)
        schemas.append([tool_schema(t) for t in tools] if tools else None)
    prompt_text: list[str] = [_render(tokenizer, convs[p * G], schemas[p * G], True, kwargs) for p in range(len(rows))]
    # each episode's images so far, in token order (a vision-language policy's: docs/vlm.md)
    images: list[list[str]] = [kind.message_images(convs[i]) for i in range(B)]
    prompt_text = [kind.prompt(t, images[p * G]) for p, t in enumerate(prompt_text)]
    prompt_ids = [kind.prompt_ids(str(t), images[p * G]) for p, t in enumerate(prompt_text)]
    resp: list[list[int]] = [[] for _ in range(B)]
    mask: list[list[int]] = [[] for _ in range(B)]
    lps: list[list[float]] = [[] for _ in range(B)]
    finish = ["length"] * B
    finals = [""] * B  # each episode's last turn as the engine decoded it (its completion)
    steps: list[list[list[float]]] = [[] for _ in range(B)]  # [position, reward] of each rewarded turn
    live = list(range(B))
    one = replace(params, n=1)
    routes: list[torch.Tensor | None] = [None] * B  # each episode's recorded experts [fed tokens, Y, K]
    recorded = True
    for turn in range(max_turns):
        if not live:
            break
        if turn == 0:
            out = engine.generate_ids(prompt_ids, replace(params, seed=_turn_seed(params.seed, 0)),
                                      prompts=prompt_text)
            rows_of = list(range(B))
        else:
            out = engine.generate_ids([prompt_ids[i // G] + resp[i] for i in live],
                                      replace(one, seed=_turn_seed(params.seed, turn)),
                                      prompts=kind.image_prompts([prompt_text[i // G] for i in live],
                                                                 [images[i] for i in live]))
            rows_of = live
        still = []
        recorded = recorded and out.routed_experts is not None
        for r, i in enumerate(rows_of):
            m = out.response_mask[r].bool()
            toks = out.response_ids[r][m].tolist()
            if recorded:
                now = sequence_routing(out, r, len(prompt_ids[i // G]) + len(resp[i]), len(toks))
                assert now is not None
                routes[i] = first_records(routes[i], now)
            resp[i] += toks
            mask[i] += [1] * len(toks)
            lps[i] += out.logprobs[r][m].tolist()
            # with tools, the turn's text keeps its special tokens but the stop (the parser's markers
            # may be special tokens); the completion rewards read stays the engine's, without them
            stopped = out.finish_reason[r] == "stop"
            message = {"role": "assistant", "content": text_for_tools(tokenizer, toks, stopped)
                       if schemas[i] else out.completions[r]}
            finals[i] = out.completions[r]
            convs[i].append(message)
            if not stopped:
                finish[i] = "length"
                continue
            result = env_step(envs[i], message)
            if result.reward is not None:  # on the turn's last model token (the EOS it sampled)
                steps[i].append([len(resp[i]) - 1, result.reward])
            if result.done:
                finish[i] = "stop"
                continue
            convs[i] += result.messages
            if turn == max_turns - 1:
                finish[i] = "length"  # out of turns with the environment still waiting
                continue
            text = env_delta(tokenizer, convs[i][:len(convs[i]) - len(result.messages)],
                             result.messages, schemas[i], True, kwargs)
            new = kind.message_images(result.messages)  # the environment's images, expanded, join the episode's
            delta = kind.prompt_ids(text, new)
            images[i] += new
            resp[i] += delta
            mask[i] += [0] * len(delta)
            lps[i] += [0.0] * len(delta)
            if context is not None and len(prompt_ids[i // G]) + len(resp[i]) >= context:
                finish[i] = "length"  # no room for the next turn
                continue
            still.append(i)
        live = still
    # each episode's row (with a vision-language policy, its prompt carries every image its tokens hold)
    return RolloutBatch.from_rows(
        [TokenRow(prompt_ids[i // G], resp[i], lps[i], finish[i],
                  kind.prompt(prompt_text[i // G], images[i]),
                  finals[i], mask=mask[i], routed_experts=routes[i] if recorded else None,
                  episode=Episode(convs[i], sum(r for _, r in steps[i]) if steps[i] else None, steps[i]),
                  images=images[i])
         for i in range(B)], G, tokenizer.pad_token_id)


class EpisodeRunner:
    """What ``LocalRollouts`` needs to turn prompts into episodes: the tools (a ``ToolEnv`` per
    episode) and the bounds; built from the config (rollout.tools, max_turns, ...)."""

    @classmethod
    def from_config(cls, cfg: RunConfig, context: int | None) -> "EpisodeRunner":
        """The episodes of ``rollout.tools`` (loaded) or ``rollout.env``; ``context``: the model's positions."""
        r = cfg.rollout
        return cls(load_tools(r.tools) if r.tools else [], parser=r.tool_parser, max_turns=r.max_turns,
                   max_tool_calls=r.max_tool_calls, timeout_s=r.tool_timeout_s,
                   max_output_chars=r.tool_max_output_chars, context=context,
                   env_class=load_env(r.env) if r.env else None,
                   system_prompt=source_system_prompt(cfg),
                   chat_template_kwargs=cfg.data.chat_template_kwargs)

    def __init__(self, tools: list, *, parser: str = "hermes", max_turns: int = 4, max_tool_calls: int = 4,
                 timeout_s: float = 10.0, max_output_chars: int = 1000, context: int | None = None,
                 env_class: type | None = None, system_prompt: str | None = None,
                 chat_template_kwargs: dict | None = None):
        self.tools = tools
        self.env_class = env_class  # rollout.env: one instance per episode, instead of a ToolEnv
        self.parser = parser
        self.max_turns = max_turns
        self.max_tool_calls = max_tool_calls
        self.timeout_s = timeout_s
        self.max_output_chars = max_output_chars
        self.context = context
        self.system_prompt = system_prompt  # each row's "system" (data/sources.py system_prompt)
        self.chat_template_kwargs = dict(chat_template_kwargs or {})  # data.chat_template_kwargs

    def new_env(self) -> Environment:
        """One episode's environment: ``rollout.env``'s class, else a ToolEnv of ``rollout.tools``."""
        if self.env_class is not None:
            try:
                return self.env_class()
            except Exception as e:
                raise EnvironmentFailed(f"environment {self.env_class.__name__}() raised "
                                        f"{type(e).__name__}: {e}") from e
        return ToolEnv(self.tools, self.parser, self.max_tool_calls, self.timeout_s, self.max_output_chars)

    def run(self, engine: Any, prompts: Sequence[str | Sequence[dict]], answers: list[str],
            params: SamplingParams) -> RolloutBatch:
        """``params.n`` episodes per prompt; ``prompts``: the rows' own prompts, untemplated (a
        string or messages, ``data.rollout_prompts``)."""
        envs = [self.new_env() for _ in range(len(prompts) * params.n)]
        rows = [{"prompt": p if isinstance(p, str) else [dict(m) for m in p], "answer": a,
                 **({"system": self.system_prompt} if self.system_prompt else {})}
                for p, a in zip(prompts, answers)]
        return run_episodes(engine, engine.tokenizer, rows, envs, params, max_turns=self.max_turns,
                            context=self.context, chat_template_kwargs=self.chat_template_kwargs,
                            kind=getattr(engine, "kind", None))
