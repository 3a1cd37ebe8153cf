"""engine/process.py's SIGTERM: a stop asked for unwinds through the `finally` blocks and exits 0, and a
SIGTERM once the process is stopping (a second one, one after its engine core told it to stop, one while
it exits) never cuts the cleanup short; and freeze_heap leaves what a process held at startup out of the
collections that follow."""

from __future__ import annotations

import subprocess
import sys
import textwrap


def run(body: str) -> subprocess.CompletedProcess:
    code = "import atexit, os, signal\nfrom engine.process import exit_on_sigterm, stopping\n" + textwrap.dedent(body)
    return subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=60)


def test_a_sigterm_while_it_unwinds_does_not_cut_the_cleanup_short():
    done = run("""
        exit_on_sigterm()
        try:
            os.kill(os.getpid(), signal.SIGTERM)  # (its handler runs before the next line)
            print("not stopped", flush=True)
        finally:
            os.kill(os.getpid(), signal.SIGTERM)  # the second stop, mid-cleanup
            print("cleaned up", flush=True)
    """)
    assert (done.returncode, done.stdout, done.stderr) == (0, "cleaned up\n", "")


def test_a_sigterm_after_main_returned_is_ignored():
    """What CI saw: a worker told to stop by its core returned from main, and the supervisor's SIGTERM
    came while torch's atexit callbacks ran: SystemExit in a callback, a traceback in the log."""
    done = run("""
        def late():  # registered first, like torch's: runs last
            os.kill(os.getpid(), signal.SIGTERM)
            print("exited", flush=True)
        atexit.register(late)
        exit_on_sigterm()
    """)
    assert (done.returncode, done.stdout, done.stderr) == (0, "exited\n", "")


def test_a_sigterm_after_the_process_began_to_stop_of_its_own_accord_is_ignored():
    """What make test saw: a worker told to shut down by its core was closing its sockets when the
    supervisor's SIGTERM came: SystemExit raised inside a socket's __del__, a traceback in the log."""
    done = run("""
        exit_on_sigterm()
        try:
            print("serving", flush=True)
        finally:
            stopping()  # the core said Shutdown
            os.kill(os.getpid(), signal.SIGTERM)
            print("cleaned up", flush=True)
    """)
    assert (done.returncode, done.stdout, done.stderr) == (0, "serving\ncleaned up\n", "")


def test_a_frozen_heap_is_left_out_of_every_later_collection():
    """freeze_heap (each engine process, once started): what it held so far is no longer scanned by the
    collector, so a full collection while serving costs what came since, not the whole heap."""
    done = subprocess.run([sys.executable, "-c", textwrap.dedent("""
        import gc
        from engine.process import freeze_heap
        held = [[i] for i in range(200_000)]  # startup's objects: modules, a model's Python objects
        before = len(gc.get_objects())
        freeze_heap()
        after = len(gc.get_objects())  # what a full collection walks
        new = [[i] for i in range(1_000)]
        print(before - after >= 200_000, len(gc.get_objects()) - after >= 1_000, gc.get_freeze_count() >= 200_000)
    """)], capture_output=True, text=True, timeout=60)
    assert (done.returncode, done.stdout) == (0, "True True True\n"), done.stderr
