"""runtime/processes.py: the worker process both pools start (the reward's deadline pool and the
tool pool): its first message is its config, it answers on its own pipe, a kill stops it whatever
it does, and a worker that exits says so by its closed pipe and its exit code."""
from __future__ import annotations

import sys

import pytest

from rldsl.runtime.processes import WorkerProcess

#: A worker as the pools' are: its two pipe ends are its last arguments; it answers each message
#: with (the config it got first, the message), and exits with code 3 on "exit"
ECHO = """
import sys
from multiprocessing import connection
inbox = connection.Connection(int(sys.argv[-2]), writable=False)
outbox = connection.Connection(int(sys.argv[-1]), readable=False)
config = inbox.recv()
while True:
    message = inbox.recv()
    if message == "exit":
        sys.exit(3)
    if message == "hang":
        import time
        time.sleep(600)
    outbox.send((config, message))
"""


def test_the_worker_gets_its_config_first_and_answers_on_its_pipe():
    w = WorkerProcess([sys.executable, "-c", ECHO], ("config", ["/a"]))
    try:
        w.outbox.send("hello")
        assert w.conn.poll(60)
        assert w.conn.recv() == (("config", ["/a"]), "hello")
    finally:
        w.kill()
    assert w.process.poll() is not None and w.outbox.closed and w.conn.closed


def test_an_exited_worker_closes_its_pipe_and_gives_its_exit_code():
    w = WorkerProcess([sys.executable, "-c", ECHO], "config")
    w.outbox.send("exit")
    assert w.conn.poll(60)
    with pytest.raises(EOFError):
        w.conn.recv()
    assert w.exit_code() == 3
    w.kill()  # a second stop of an exited worker is harmless


def test_a_kill_stops_a_busy_worker():
    w = WorkerProcess([sys.executable, "-c", ECHO], "config")
    w.outbox.send("hang")
    assert not w.conn.poll(0.2)  # busy: no answer
    w.kill()
    assert w.process.returncode is not None and w.process.returncode < 0  # killed by a signal
