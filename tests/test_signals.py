"""Signal handling that cannot deadlock: a signal arriving while the main thread holds the very
lock its action needs (as ``Event.wait`` holds its condition's lock between bytecodes)."""

from __future__ import annotations

import subprocess
import sys
import textwrap

import pytest
from spoolkit import child_env

# The main thread holds the event's lock when SIGTERM arrives; the handler runs in the main
# thread at the next bytecode, still inside the ``with``.
_HELD_LOCK = textwrap.dedent(
    """
    import os, signal, threading, time
    {setup}
    stop = threading.Event()
    with {install}:
        with stop._cond:  # as Event.wait holds it around its wait
            os.kill(os.getpid(), signal.SIGTERM)
            time.sleep(0.3)  # the handler has run by now
        assert stop.wait(5), "the stop never arrived"
    print("stopped")
    """
)


def _run(setup: str, install: str) -> subprocess.CompletedProcess[str]:
    code = _HELD_LOCK.format(setup=setup, install=install)
    return subprocess.run(
        [sys.executable, "-c", code], capture_output=True, text=True, timeout=30, env=child_env()
    )


def test_a_signal_while_the_main_thread_holds_the_events_lock_still_stops() -> None:
    out = _run(
        "from deltad.signals import handle_signals",
        "handle_signals({signal.SIGTERM: lambda _: stop.set()})",
    )
    assert out.returncode == 0 and out.stdout.strip() == "stopped", out.stderr


@pytest.mark.slow  # waits out a hang
def test_the_plain_handler_it_replaces_deadlocks_there() -> None:
    """The hazard is real: ``signal.signal(SIGTERM, lambda *a: stop.set())`` hangs for good in
    the same spot (killed by the timeout here)."""
    setup = textwrap.dedent(
        """
        import contextlib
        @contextlib.contextmanager
        def plain():
            signal.signal(signal.SIGTERM, lambda *a: stop.set())
            yield
        """
    )
    try:
        out = subprocess.run(
            [sys.executable, "-c", _HELD_LOCK.format(setup=setup, install="plain()")],
            capture_output=True, text=True, timeout=3, env=child_env(),
        )  # fmt: skip
    except subprocess.TimeoutExpired:
        return
    raise AssertionError(f"the plain handler did not hang: rc {out.returncode} {out.stdout}")


def test_actions_run_in_order_and_the_previous_handlers_come_back() -> None:
    code = textwrap.dedent(
        """
        import os, signal, threading
        from deltad.signals import handle_signals
        seen, done = [], threading.Event()
        before = signal.getsignal(signal.SIGHUP)
        acts = {signal.SIGHUP: seen.append, signal.SIGUSR1: lambda s: (seen.append(s), done.set())}
        with handle_signals(acts):
            os.kill(os.getpid(), signal.SIGHUP)
            os.kill(os.getpid(), signal.SIGUSR1)
            assert done.wait(5)
        assert seen == [signal.SIGHUP, signal.SIGUSR1], seen
        assert signal.getsignal(signal.SIGHUP) is before
        print("ok")
        """
    )
    out = subprocess.run(
        [sys.executable, "-c", code], capture_output=True, text=True, timeout=30, env=child_env()
    )
    assert out.returncode == 0 and out.stdout.strip() == "ok", out.stderr
