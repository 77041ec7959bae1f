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
