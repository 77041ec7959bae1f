"""Conversational rows and chat templates: the ids fed to the engine are exactly
``apply_chat_template``'s; system prompt; GSM8K rows with the ``gsm8k`` reward; a 64-row
dataset starts with default settings. The tokenizers are built here (ChatML templates)."""
from __future__ import annotations

import json

import pytest
import torch
from tokenizers import Regex, Tokenizer, models, pre_tokenizers, decoders, processors
from transformers import LlamaForCausalLM, PreTrainedTokenizerFast

from rldsl.runtime import toy
from rldsl.runtime.data.sources import heldout_size, source_of
from rldsl.runtime.run.sources import prompts_of
from rldsl.runtime.config import load_config
from rldsl.runtime.data.datasets import Example, load_examples, render_prompt
from rldsl.runtime.rollout.engines.base import SamplingParams
from rldsl.runtime.rollout.engines.hf import HFEngine
from rldsl.runtime.errors import DataError, RunError
from rldsl.runtime.rewards.spec import resolve_reward
from rldsl.runtime.rewards.verify import gsm8k_reward

CHATML = (
    "{% for m in messages %}<|im_start|>{{ m['role'] }}\n{{ m['content'] }}<|im_end|>\n{% endfor %}"
    "{% if add_generation_prompt %}<|im_start|>assistant\n"
    "{% if enable_thinking is defined and not enable_thinking %}<think>\n\n</think>\n\n{% endif %}"
    "{% endif %}")
CHARS = list("abcdefghijklmnopqrstuvwxyz0123456789 .,?!:+-*=#<>/\n")


def chat_tokenizer(bos: bool = False) -> PreTrainedTokenizerFast:
    """One token per character plus ChatML specials; with ``bos`` a Llama-3-like tokenizer
    that adds <s> itself and whose template writes it too."""
    specials = ["<pad>", "<|im_start|>", "<|im_end|>", "<unk>"] + (["<s>"] if bos else [])
    vocab = {t: i for i, t in enumerate(specials + CHARS)}
    core = Tokenizer(models.WordLevel(vocab=vocab, unk_token="<unk>"))
    core.pre_tokenizer = pre_tokenizers.Split(Regex("<\\|im_(start|end)\\|>|<s>|."), behavior="isolated")
    core.decoder = decoders.Fuse()
    if bos:
        core.post_processor = processors.TemplateProcessing(single="<s> $A", pair="<s> $A $B",
                                                            special_tokens=[("<s>", vocab["<s>"])])
    core.add_special_tokens(specials)
    tok = PreTrainedTokenizerFast(tokenizer_object=core, eos_token="<|im_end|>", pad_token="<pad>",
                                  unk_token="<unk>", bos_token="<s>" if bos else None,
                                  padding_side="left")
    tok.chat_template = ("<s>" if bos else "") + CHATML
    return tok


def template_ids(tok, messages, **kw) -> list[int]:
    out = tok.apply_chat_template(messages, add_generation_prompt=True, tokenize=True, **kw)
    return list(out["input_ids"] if hasattr(out, "keys") else out)


def write_jsonl(path, rows):
    path.write_text("".join(json.dumps(r) + "\n" for r in rows))
    return path


CONVERSATIONS = [
    [{"role": "user", "content": "what is 2+3?"}],
    [{"role": "system", "content": "be brief."}, {"role": "user", "content": "what is 10*4?"}],
    "what is 7-1?",  # a plain string row: templated as one user message
]


@pytest.mark.parametrize("bos", [False, True])
def test_engine_is_fed_exactly_the_chat_template_ids(tmp_path, bos) -> None:
    tok = chat_tokenizer(bos)
    data = write_jsonl(tmp_path / "chat.jsonl", [{"prompt": p, "answer": str(i)} for i, p in enumerate(CONVERSATIONS)])
    cfg = load_config(None, [f"data.path={data}", "data.eval_size=0",
                             'data.chat_template_kwargs={"enable_thinking": false}'])
    source, held = prompts_of(cfg, source_of(cfg), tok)
    examples = sorted(source.examples, key=lambda e: e.id)
    assert held == [] and [e.source for e in examples] == [tuple(CONVERSATIONS[0]), tuple(CONVERSATIONS[1]), CONVERSATIONS[2]]
    assert examples[0].prompt.endswith("<|im_start|>assistant\n<think>\n\n</think>\n\n")
    torch.manual_seed(0)
    model = LlamaForCausalLM(toy.tiny_config(tok, hidden_size=16, num_hidden_layers=1,
                                             num_attention_heads=2, intermediate_size=32)).eval()
    batch = HFEngine(model, tok).generate([e.prompt for e in examples],
                                          SamplingParams(n=2, max_new_tokens=3, seed=0))
    for i, row in enumerate(CONVERSATIONS):
        messages = [{"role": "user", "content": row}] if isinstance(row, str) else row
        want = template_ids(tok, messages, enable_thinking=False)
        for r in (2 * i, 2 * i + 1):
            fed = batch.prompt_ids[r][batch.prompt_mask[r].bool()].tolist()
            assert fed == want
    assert sum(1 for t in want if t == tok.bos_token_id) == (1 if bos else 0)


def test_system_prompt_and_modes(tmp_path) -> None:
    tok = chat_tokenizer()
    ex = Example(0, "hi", "1")
    on = render_prompt(ex, tok, system_prompt="you add.")
    assert on.prompt == "<|im_start|>system\nyou add.<|im_end|>\n<|im_start|>user\nhi<|im_end|>\n<|im_start|>assistant\n"
    assert on.source == "hi"
    # a row with its own system message keeps it
    own = render_prompt(Example(1, "", "1", source=tuple(CONVERSATIONS[1])), tok, system_prompt="x")
    assert own.prompt.count("system") == 1 and "be brief." in own.prompt
    off = render_prompt(ex, tok, mode="off", system_prompt="you add.")
    assert off.prompt == "you add.\n\nhi"
    assert render_prompt(ex, tok, mode="off") == ex  # plain text untouched
    plain = toy.build_tokenizer()  # no chat template: auto leaves the text alone, on is an error
    assert render_prompt(ex, plain) == ex
    with pytest.raises(DataError, match="no chat template"):
        render_prompt(ex, plain, mode="on")


def test_bad_conversational_rows_name_the_line(tmp_path) -> None:
    path = write_jsonl(tmp_path / "bad.jsonl", [{"prompt": "ok", "answer": 1},
                                                {"prompt": [{"role": "user"}], "answer": 2}])
    with pytest.raises(DataError, match=r"line 2: field 'prompt' must be a string or a non-empty list"):
        load_examples(path)


def test_gsm8k_rows_and_reward(tmp_path) -> None:
    rows = [{"question": "natalia sold 48 clips. how many?", "answer": "48/2 = 24\n#### 72"},
            {"question": "a costs 1,000. b?", "answer": "so\n#### 1,200"}]
    path = write_jsonl(tmp_path / "gsm8k.jsonl", rows)
    cfg = load_config(None, [f"data.path={path}", "data.prompt_key=question", "reward.name=gsm8k"])
    source, held = prompts_of(cfg, source_of(cfg), chat_tokenizer())
    assert held == [] and len(source) == 2
    assert resolve_reward("gsm8k") is gsm8k_reward
    assert gsm8k_reward("", "48/2 = 24, 24+48 = 72\n#### 72", rows[0]["answer"]) == 1.0
    assert gsm8k_reward("", "the total is \\boxed{72}", rows[0]["answer"]) == 1.0
    assert gsm8k_reward("", "The answer is 1200", rows[1]["answer"]) == 1.0  # 1,200 == 1200
    assert gsm8k_reward("", "it is 1200", rows[1]["answer"]) == 0.0  # a stray number is not an answer
    assert gsm8k_reward("", "#### 71", rows[0]["answer"]) == 0.0
    assert gsm8k_reward("", "no number", rows[0]["answer"]) == 0.0


def test_small_dataset_defaults(tmp_path) -> None:
    path = write_jsonl(tmp_path / "small.jsonl", [{"prompt": f"{i}+1=", "answer": i + 1} for i in range(64)])
    cfg = load_config(None, [f"data.path={path}"])
    notes: list[str] = []
    source, held = prompts_of(cfg, source_of(cfg), None, notes.append)
    assert len(held) == 6 and len(source) == 58
    assert notes == ["held out 6 of 64 rows for evaluation (data.eval_size to change)"]
    assert heldout_size(cfg, 9) == (0, "9 rows: no held-out split (set data.eval_path or data.eval_size to evaluate)")
    assert heldout_size(cfg, 5000)[0] == 200
    with pytest.raises(RunError, match="data.eval_size=64 holds out every one of the 64 rows"):
        cfg = load_config(None, [f"data.path={path}", "data.eval_size=64"])
        prompts_of(cfg, source_of(cfg))


@pytest.mark.slow
def test_64_row_dataset_runs_with_default_split(model_dir, tmp_path, capsys) -> None:
    from rldsl.runtime.run import loop
    from rldsl.runtime.records.metrics import read_metrics
    path = write_jsonl(tmp_path / "small.jsonl", [{"prompt": f"{i}+1=", "answer": i + 1} for i in range(64)])
    cfg = load_config(None, [f"model.path={model_dir}", f"data.path={path}", f"out={tmp_path / 'run'}",
                             "train.steps=1", "rollout.max_new_tokens=4", "log.progress=false"])
    run = loop.train("grpo", cfg)
    assert "held out 6 of 64 rows for evaluation" in capsys.readouterr().out
    recs = read_metrics(run / "metrics.jsonl")
    assert any("reward_mean" in r for r in recs) and any("eval/greedy_acc" in r for r in recs)


SEEN: list[tuple[str, str]] = []


def recording_reward(prompt: str, completion: str, answer: str) -> float:
    """Records the prompt it receives (the run runs in this process)."""
    SEEN.append((prompt, answer))
    return float(len(completion) % 2)


def test_rewards_receive_the_original_prompt_while_the_engine_sees_the_template(tmp_path) -> None:
    """Training and evaluation: the engine is fed ``apply_chat_template``'s ids, the reward gets
    the row's own prompt (a messages list as its contents joined by blank lines), never the
    template nor ``data.system_prompt``."""
    from rldsl.runtime.run import step_batch as run_rollouts
    from rldsl.runtime.run.eval_step import evaluate
    from rldsl.runtime.run.build import build_run
    tok = chat_tokenizer()
    torch.manual_seed(0)
    model_dir = tmp_path / "chat-model"
    LlamaForCausalLM(toy.tiny_config(tok, hidden_size=16, num_hidden_layers=1, num_attention_heads=2,
                                     intermediate_size=32)).save_pretrained(model_dir)
    tok.save_pretrained(model_dir)
    rows = [{"prompt": p, "answer": str(i)} for i, p in enumerate(CONVERSATIONS)]
    data = write_jsonl(tmp_path / "chat.jsonl", rows)
    held = write_jsonl(tmp_path / "held.jsonl", rows[1:2])
    original = {"0": "what is 2+3?", "1": "be brief.\n\nwhat is 10*4?", "2": "what is 7-1?"}
    cfg = load_config(None, [f"model.path={model_dir}", f"data.path={data}", f"data.eval_path={held}",
                             f"out={tmp_path / 'run'}", "rollout.prompts_per_step=3", "rollout.n=2",
                             "rollout.max_new_tokens=3", "data.system_prompt=you add.", "log.progress=false",
                             f"reward.name={__name__}:recording_reward", "eval.samples=0",
                             "reward.timeout_s=0"])  # the reward in this process: SEEN is its record
    (tmp_path / "run").mkdir()
    s = build_run("grpo", cfg, tmp_path / "run")
    SEEN.clear()
    made = run_rollouts.rollout_step(s, 0)
    batch, ids = made.batch, made.prompt_ids
    assert len(SEEN) == 6 and sorted({a for _, a in SEEN}) == ["0", "1", "2"]
    for prompt, answer in SEEN:
        assert prompt == original[answer]
    by_answer = {e.answer: e for e in s.prompts.examples}
    for r, answer in enumerate(batch.answers):  # the engine: the templated text, system prompt in
        row = CONVERSATIONS[int(answer)]
        messages = [{"role": "user", "content": row}] if isinstance(row, str) else row
        if messages[0]["role"] != "system":
            messages = [{"role": "system", "content": "you add."}] + messages
        assert batch.prompt_ids[r][batch.prompt_mask[r].bool()].tolist() == template_ids(tok, messages)
        assert batch.prompts[r] == by_answer[answer].prompt != original[answer]
    SEEN.clear()
    evaluate(s, 0)  # held-out rows: the same
    assert SEEN == [(original["1"], "1")]


def test_ray_rollouts_hand_each_worker_its_chunk_of_reward_prompts() -> None:
    """RayRollouts splits the reward prompts with the prompts (stand-ins for the actors)."""
    from types import SimpleNamespace
    from rldsl.runtime.batch import RolloutBatch
    from rldsl.runtime.rewards.functions import RewardResult
    from rldsl.runtime.workers.base import Generation
    from rldsl.runtime.workers.ray_rollouts import RayRollouts

    calls = []

    class Actor:
        def __init__(self):
            self.generate = SimpleNamespace(remote=self.run)

        def run(self, version, prompts, answers, params, reward_prompts, score=True):
            calls.append((prompts, reward_prompts))
            n = len(prompts)
            batch = RolloutBatch(torch.ones(n, 1, dtype=torch.long), torch.ones(n, 1, dtype=torch.long),
                                 torch.ones(n, 1, dtype=torch.long), torch.ones(n, 1, dtype=torch.long),
                                 torch.zeros(n, 1), ["stop"] * n, prompts, ["x"] * n, 1, list(answers))
            return Generation(batch, RewardResult(torch.zeros(n), {}, 0), 0.0, 0.0)

    r = object.__new__(RayRollouts)
    r.cluster = SimpleNamespace(wait=lambda calls, timeout, what: [ref for _, ref in calls])
    r.cfg, r.pad_id, r.version = load_config(None, []), 0, 0
    r.actors, r.names = [Actor(), Actor()], ["rollout worker 0", "rollout worker 1"]
    r.generate(["<t>a", "<t>b", "<t>c"], ["1", "2", "3"], SamplingParams(n=1), ["a", "b", "c"])
    assert calls == [(["<t>a", "<t>b"], ["a", "b"]), (["<t>c"], ["c"])]
