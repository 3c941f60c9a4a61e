"""``python -m workers.cli``: the `pdqueue` command without its console script."""

from workers.cli import main

main()
