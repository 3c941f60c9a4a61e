"""The `pdqueue` command. This package is the CLI side of the project (the worker processes
are the rest of ``workers/``): click commands that parse options, build config and call the
library, a worker, or the local-cluster supervisor.

Imports point one way: this module assembles the group from the command modules; each
command module imports ``workers.cli.common`` (and the supervisor or status view it
drives); none imports this module or another command module.

- ``generate``: `generate` (the engine in this process, the reference)
- ``worker``: `worker ROLE`
- ``submit``: `submit`
- ``status``: `status` (``status_view`` collects and draws the snapshot)
- ``plan``: `plan` (the planner's recommendation; ``--apply`` switches roles)
- ``up``: `up` (``local_cluster`` is the supervisor behind it)
- ``restart``: `restart` (a rolling restart of a running `up`, carried out by its supervisor)
- ``bench``: `bench engine|transfer|serve`
- ``redis_server``: `redis-server`
- ``serve``: `serve` (the OpenAI-compatible gateway, ``pdqueue.frontends.gateway``)
- ``metrics``: `metrics-sd` (Prometheus service discovery of the workers, stream backlog)
- ``acl``: `acl` (least-privilege Redis ACL users for a cluster's roles)
- ``models``: `models` (the families served, or which family a checkpoint is)
- ``usage``: `usage` (the usage ledger: tokens per tenant, model and class, or per request)
"""

from __future__ import annotations

import sys

import click

from workers.cli.acl import acl
from workers.cli.batch import batch
from workers.cli.bench import bench
from workers.cli.common import Group
from workers.cli.generate import generate
from workers.cli.metrics import metrics_sd
from workers.cli.models import models
from workers.cli.plan import plan
from workers.cli.redis_server import redis_server
from workers.cli.restart import restart
from workers.cli.serve import serve
from workers.cli.status import status
from workers.cli.submit import submit
from workers.cli.up import up
from workers.cli.usage import usage
from workers.cli.worker import worker


@click.group(cls=Group, context_settings={"help_option_names": ["-h", "--help"]})
@click.version_option(package_name="pdqueue")
def cli():
    """pdqueue: LLM serving with prefill and decode disaggregated over Redis Streams."""


for command in (up, restart, submit, status, plan, generate, worker, bench, redis_server, batch):
    cli.add_command(command)
cli.add_command(metrics_sd)
cli.add_command(serve)
cli.add_command(acl)
cli.add_command(models)
cli.add_command(usage)


def main():
    try:
        cli(prog_name="pdqueue")
    except KeyboardInterrupt:  # Ctrl-C before a command installed its own handler
        click.secho("interrupted", fg="red", err=True)
        sys.exit(130)
