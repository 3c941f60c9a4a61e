"""The parts of `up`'s supervisor (``workers.cli.local_cluster.LocalCluster``): the processes,
their restarts, the drain of the embedded server's queue, the stop."""
