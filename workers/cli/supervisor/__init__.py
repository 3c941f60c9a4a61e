"""The parts of `up`'s supervisor (``workers.cli.local_cluster.LocalCluster``): the processes,
their restarts, the drain of the embedded server's queue, the stop. They see the cluster as
``supervised.Supervised`` and never import ``local_cluster``."""
