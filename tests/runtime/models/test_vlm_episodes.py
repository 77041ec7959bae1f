"""Images in multi-turn episodes and agents, on the tiny random Qwen2-VL (tests/fixtures/vlm_model.py)
and the HF engine: an environment episode whose first user turn has an image (and whose
environment answers with another), and an agent sending ``image_url`` parts (data: URLs) through
the real OpenAI-compatible endpoint. Each training row carries every image its tokens saw; the
trainer's forward over the row (pixel values, grids, token types, M-RoPE positions) recomputes
the engine's logprobs, padded and packed."""
from __future__ import annotations

import base64
import io

import pytest
import torch

import vlm_model as fixture
from rldsl.runtime.batch import model_inputs
from rldsl.runtime.data.images import images_of
from rldsl.runtime.models.loading import load_policy
from rldsl.runtime.rollout.engines.base import SamplingParams
from rldsl.runtime.rollout.engines.hf import HFEngine
from rldsl.runtime.train.logprobs import Forward, LogprobOptions, token_logprobs
from rldsl.runtime.models.kinds import model_kind


@pytest.fixture(scope="module")
def engine(vlm_model):
    """The HF engine on the tiny Qwen2-VL whose LM head (untied, with a bias) favours its EOS token
    (exp(6.5) ~ the rest of the vocabulary together): turns end by the model's own stop, so episodes
    reach their second turn (the random model alone almost never stops)."""
    from rldsl.runtime.models.loading import load_tokenizer
    tok = load_tokenizer(vlm_model)
    torch.manual_seed(0)
    model = load_policy(vlm_model, "float32").eval()
    head = torch.nn.Linear(model.lm_head.in_features, model.lm_head.out_features, bias=True)
    with torch.no_grad():
        head.weight.copy_(model.lm_head.weight)
        head.bias.zero_()
        head.bias[tok.eos_token_id] = 6.5
    model.lm_head = head
    return HFEngine(model, tok)


def data_url(i: int, size=(56, 56)) -> str:
    buf = io.BytesIO()
    fixture.image(i, size).save(buf, format="PNG")
    return "data:image/png;base64," + base64.b64encode(buf.getvalue()).decode()


def recomputed(model, batch, packing: bool = False) -> torch.Tensor:
    """The trainer's logprobs of the batch's rows [B, Tr] (train/passes.py's inputs)."""
    ids, attn, _ = model_inputs(batch)
    vision = model_kind(model).image_inputs(model, model_kind(model).processed(batch.images), ids, attn)
    assert vision is not None
    with torch.no_grad():
        lp = token_logprobs(model, Forward(ids, attn, batch.response_ids.shape[1], inputs=vision),
                            LogprobOptions(packing=packing)).logprobs
    return lp


def assert_exact(model, batch, image_tokens: list[int]) -> None:
    from rldsl.runtime.models.kinds import model_kind
    ids, attn, _ = model_inputs(batch)
    image_id = model.config.image_token_id
    assert ((ids == image_id) * attn).sum(1).tolist() == image_tokens  # the images' expanded tokens
    m = batch.response_mask.bool()
    padded, packed = recomputed(model, batch), recomputed(model, batch, packing=True)
    assert (padded[m] - batch.logprobs[m]).abs().max() < 1e-6, (padded[m] - batch.logprobs[m]).abs().max()
    assert (packed[m] - padded[m]).abs().max() < 1e-6


class PictureEnv:
    """An environment whose first user turn has the row's image and whose answer to the model's
    first turn shows it another picture (a data: URL); the episode ends after the second turn."""

    def __init__(self) -> None:
        self.turns = 0

    def reset(self, row: dict) -> list[dict]:
        return list(row["prompt"])

    def step(self, message: dict):
        self.turns += 1
        if self.turns == 2:
            return [], 1.0, True
        return [{"role": "user", "content": [{"type": "image", "image": data_url(5, (84, 56))},
                                             {"type": "text", "text": "And this one?"}]}], None, False


def test_env_episode_with_an_image_in_its_first_user_turn(engine, tmp_path):
    from rldsl.runtime.rollout.episodes.runner import EpisodeRunner
    path = fixture.images(tmp_path, 1)[0]
    prompt = ({"role": "user", "content": ({"type": "image", "image": str(path)},
                                           {"type": "text", "text": "Colour?"})},)
    runner = EpisodeRunner([], max_turns=2, env_class=PictureEnv)
    batch = runner.run(engine, [prompt], ["red"], SamplingParams(n=2, max_new_tokens=4, seed=1))
    two_turns = [i for i in range(2) if batch.finish_reason[i] == "stop"]
    assert two_turns  # (seeded: the environment's picture is in some row)
    for i in range(2):
        want = (str(path), data_url(5, (84, 56))) if i in two_turns else (str(path),)
        assert images_of(batch.prompts[i]) == want  # every image the row's tokens saw, in order
    # 56x56 -> 4 image tokens; the environment's 84x56 -> 6x4 patches -> 6 tokens
    assert_exact(engine.model, batch, [4 + (6 if i in two_turns else 0) for i in range(2)])
    assert all(len(e.messages) >= 2 for e in batch.episodes)


def _image_message(text: str, *urls: str) -> dict:
    """A user message as OpenAI's chat API takes images: image_url parts, then the text."""
    return {"role": "user", "content": [*({"type": "image_url", "image_url": {"url": u}} for u in urls),
                                        {"type": "text", "text": text}]}


async def picture_agent(client, row: dict) -> float:
    """Two chat calls through the openai client: a picture and a question, then the reply and
    another picture (the second call continues the first: bridged)."""
    messages = [_image_message("Colour?", data_url(1))]
    r = await client.chat.completions.create(model=row["model"], messages=messages, max_tokens=4)
    messages += [{"role": "assistant", "content": r.choices[0].message.content},
                 _image_message("And now?", data_url(2, (112, 56)))]
    await client.chat.completions.create(model=row["model"], messages=messages, max_tokens=4)
    return 1.0


REFUSED: list[str] = []


async def web_picture_agent(client, row: dict) -> float:
    """An image by http(s) URL: refused (400), the reason kept; then a plain text call."""
    import openai
    try:
        await client.chat.completions.create(model=row["model"], max_tokens=2, messages=[
            _image_message("Colour?", "https://example.com/cat.png")])
    except openai.BadRequestError as e:
        REFUSED.append(str(e))
    await client.chat.completions.create(model=row["model"], max_tokens=2,
                                         messages=[{"role": "user", "content": "Colour?"}])
    return 0.0


def _agent_batch(engine, agent):
    from rldsl.runtime.rollout.agents.runner import AgentRunner
    pytest.importorskip("openai")
    runner = AgentRunner(agent, model_name="vlm", context=2048)
    try:
        return runner.run(engine, ["Colour?"], ["red"], SamplingParams(n=2, max_new_tokens=4, seed=2))
    finally:
        runner.close()


def test_agent_sends_image_url_parts_through_the_endpoint(engine):
    batch = _agent_batch(engine, picture_agent)
    assert batch.group_size == 2 and len(batch) == 2
    for i in range(2):
        info = batch.episodes[i]
        assert info.error is None and info.agent.rows == 1 and len(info.agent.calls) == 2
        assert info.agent.calls[1]["bridged"]  # the second call continued the first's ids
        assert images_of(batch.prompts[i]) == (data_url(1), data_url(2, (112, 56)))
        # the row's prompt (its first call's: the first picture, 4 patches) spelled as a rendered
        # prompt is in samples.jsonl: one pad per image, not one per patch
        assert batch.prompts[i].count("<|image_pad|>") == 1
    # 56x56 -> 4 image tokens; 112x56 -> 8x4 patches -> 8 tokens
    assert_exact(engine.model, batch, [4 + 8, 4 + 8])


def test_http_image_urls_are_refused(engine):
    REFUSED.clear()
    batch = _agent_batch(engine, web_picture_agent)
    assert len(REFUSED) == 2 and all("http(s) URLs are not fetched" in r and "data: URL" in r for r in REFUSED)
    assert all(e.error is None for e in batch.episodes) and not any(images_of(p) for p in batch.prompts)


def test_episodes_with_images_are_refused_on_the_vllm_engine_only(vlm_model):
    from types import SimpleNamespace

    from rldsl.runtime.config import load_config
    from rldsl.runtime.errors import ConfigError
    from rldsl.runtime.resolve import check_model_kind
    grpo = SimpleNamespace(name="grpo", uses_critic=False, uses_teacher=False)
    for engine in ("hf", "vllm"):
        for kind, value in (("env", "episode_helpers:Nudge"), ("agent", "agent_helpers:calc_agent")):
            cfg = load_config(None, [f"model.path={vlm_model}", f"rollout.engine={engine}",
                                     f"rollout.{kind}={value}"])
            if engine == "hf":
                check_model_kind(grpo, cfg)
            else:
                with pytest.raises(ConfigError, match="on the vLLM engine .*take no images"):
                    check_model_kind(grpo, cfg)


def test_a_padding_row_added_at_replay_holds_its_prompts_images_only(engine):
    """``sampling replay`` pads a kept agent's group to a batch's rows per episode (rollout/replay.py
    ``padded``) with copies of each episode's first row, emptied. That row's response holds the
    agent's second picture (the bridged call's); its padding rows' ids hold the prompt only, so
    they carry the prompt's picture alone -- refs, prompt and processed pixels -- as the runner's
    own padding rows do, and the trainer's forward over the padded batch (carried pixels, or
    processed again from the refs) recomputes the engine's logprobs."""
    from rldsl.runtime.rollout.replay import padded

    batch = _agent_batch(engine, picture_agent)
    kind = model_kind(engine.model)
    batch.image_inputs = kind.processed(batch.images)  # as the rollout worker carries them (workers/local.py)
    out, rewards = padded(batch, torch.tensor([1.0, 0.0]), 2, engine.tokenizer.pad_token_id)
    assert len(out) == 4 and [e.agent.padding for e in out.episodes] == [False, True, False, True]
    assert rewards.tolist() == [1.0, 1.0, 0.0, 0.0]
    first, both = (data_url(1),), (data_url(1), data_url(2, (112, 56)))
    assert [tuple(x) for x in out.images] == [both, first, both, first]
    assert [images_of(p) for p in out.prompts] == [both, first, both, first]
    assert out.prompts[1] == batch.prompts[0] and out.prompts[1].count("<|image_pad|>") == 1
    alone = kind.processed([list(first)])[0]
    for j in (1, 3):
        assert set(out.image_inputs[j]) == set(alone)
        assert all(torch.equal(out.image_inputs[j][k], alone[k]) for k in alone)
    assert_exact(engine.model, out, [4 + 8, 4, 4 + 8, 4])  # the refs processed again
    ids, attn, _ = model_inputs(out)
    carried = kind.forward_inputs(engine.model, out, ids, attn)  # the carried pixels, as the trainer reads them
    with torch.no_grad():
        lp = token_logprobs(engine.model, Forward(ids, attn, out.response_ids.shape[1], inputs=carried),
                            LogprobOptions()).logprobs
    m = out.response_mask.bool()
    assert (lp[m] - out.logprobs[m]).abs().max() < 1e-6
