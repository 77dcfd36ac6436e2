"""The ``fedlore`` command's entry point: a Ctrl-C at any moment ends in one line.

Loading torch and the libraries behind ``fedlore.cli`` takes a second or two. Python's own
SIGINT handler raises ``KeyboardInterrupt`` wherever the main thread is, and an import cut short
that way can fail in any manner (a traceback of ``import torch``; once, a ``RecursionError``
inside numpy's import). So this module, which imports nothing heavy, installs
:func:`fedlore.engine.interrupt.startup_handler` (it counts the signal, then raises) before it
imports the command line: an interrupt while that loads ends with one line and exit status 130,
and ``fedlore.cli.main`` reports any error that follows a counted signal as the interrupt it
is. Once a run starts, :func:`fedlore.engine.interrupt.handling` takes SIGINT and SIGTERM over
(clean stops between rounds).
"""

from __future__ import annotations

import os
import signal
import sys

from fedlore.engine import interrupt


def main() -> int:
    """Run ``fedlore`` with the arguments of ``sys.argv``; its exit status."""
    signal.signal(signal.SIGINT, interrupt.startup_handler)
    try:
        from fedlore.cli import main as command
    except BaseException:
        if not interrupt.signals():
            raise
        os.write(2, b"fedlore: interrupted while starting; nothing was run or written\n")
        os._exit(130)  # skip the shutdown of half-loaded libraries
    return command()


if __name__ == "__main__":
    sys.exit(main())
