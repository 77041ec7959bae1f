"""Tools for the episode tests (importable by the tool processes)."""
import time


def boom(x: int) -> str:
    """Raises.

    Args:
        x: anything
    """
    raise RuntimeError(f"boom {x}")


def sleepy(seconds: float) -> str:
    """Sleeps.

    Args:
        seconds: how long
    """
    time.sleep(seconds)
    return "awake"


def chatty(n: int) -> str:
    """Prints a lot.

    Args:
        n: characters
    """
    return "x" * n


def structured(n: int) -> dict:
    """Returns a dict.

    Args:
        n: a number
    """
    return {"n": n, "set": [1, 2]}


def opaque(n: int) -> object:
    """Returns an object json cannot write.

    Args:
        n: a number
    """
    return {1, 2}


def dial(port: int) -> str:
    """Tries to open a TCP connection to 127.0.0.1.

    Args:
        port: the port
    """
    import socket

    socket.create_connection(("127.0.0.1", port), timeout=2).close()
    return "connected"


def where() -> str:
    """The tool process's working folder and what it holds."""
    import os

    return f"{os.getcwd()} {sorted(os.listdir('.'))}"


def typed(count: int, label: str, values: list[float], scale: float | None = None) -> str:
    """A tool with several argument types.

    Args:
        count: how many
        label: a name
        values: the numbers
        scale: an optional factor
    """
    return label * count


def peek(folder: str) -> str:
    """Lists a folder.

    Args:
        folder: the folder
    """
    import os

    return str(sorted(os.listdir(folder)))


def hang(x: int) -> str:
    """Never returns (the fault the runner must contain).

    Args:
        x: anything
    """
    import threading

    threading.Event().wait()
    return "unreachable"


def nap(seconds: float, tag: str) -> str:
    """Sleeps, then answers its tag.

    Args:
        seconds: how long
        tag: what to answer
    """
    time.sleep(seconds)
    return tag


def echo(text: str) -> str:
    """Answers its argument.

    Args:
        text: what to answer
    """
    return text


def loud(megabytes: int) -> str:
    """Prints megabytes to stdout and a line to stderr, then answers "done".

    Args:
        megabytes: how much to print
    """
    import sys

    line = "y" * 1023 + "\n"
    for _ in range(megabytes * 1024):
        sys.stdout.write(line)
    print("a warning", file=sys.stderr)
    return "done"


#: A Hermes call whose tokens (fixture.scripted_model) all differ; ``where`` takes no argument.
SPECIAL_MARKER_CALL = '<tool_call>{"name": "where"}</tool_call>'


def special_marker_episode(engine) -> None:
    """A tools episode of ``engine``, whose model (scripted_model, ``special_tool_markers``
    tokenizer) answers every turn with SPECIAL_MARKER_CALL: the call is parsed, the tool runs, a
    second turn follows; the messages keep the markers, the completion rewards read (the last
    turn, as the engine decoded it) has none. Decoded without the special tokens, the markers
    were gone: no call, the episode ended after its first turn (and scored nothing), silently."""
    from rldsl.runtime.rollout.engines.base import SamplingParams
    from rldsl.runtime.rollout.episodes.runner import EpisodeRunner

    tok = engine.tokenizer
    assert tok.decode(tok(SPECIAL_MARKER_CALL)["input_ids"], skip_special_tokens=True) == '{"name": "where"}'
    batch = EpisodeRunner([where], max_turns=2).run(engine, ["Where are you?"], [""],
                                                    SamplingParams(n=2, max_new_tokens=16, seed=0))
    said = tok(SPECIAL_MARKER_CALL, add_special_tokens=False)["input_ids"] + [tok.eos_token_id]
    for i in range(2):
        messages = batch.episodes[i].messages
        assert [m["role"] for m in messages] == ["user", "assistant", "tool", "assistant", "tool"]
        assert messages[1]["content"] == messages[3]["content"] == SPECIAL_MARKER_CALL
        assert all(m["name"] == "where" and not m["content"].startswith("error") for m in messages[2::2])
        assert batch.finish_reason[i] == "length"  # out of turns with the call unanswered
        assert batch.completions[i] == '{"name": "where"}'
        n = int(batch.response_attention[i].sum())
        ids, mask = batch.response_ids[i, :n].tolist(), batch.response_mask[i, :n].tolist()
        assert ids[:len(said)] == said and ids[-len(said):] == said and sum(mask) == 2 * len(said)
