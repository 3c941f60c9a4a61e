"""`pdqueue up`, `submit`, `status`: the local cluster and its everyday commands."""


def register(cli) -> None:
    """Add this module's commands to the `pdqueue` group."""
