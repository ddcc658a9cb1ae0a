"""``python -m recloop.cli``: the ``recloop`` command."""

from recloop.cli import main

main()
