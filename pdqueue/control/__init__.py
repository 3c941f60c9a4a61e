"""The control plane: optional loops that watch a cluster through Redis and move its workers.

`observe` reads an Observation from Redis, `planner` decides (no I/O, no clock), `adapter`
acts on a live cluster, `commands` is the switch-command protocol a worker answers.
"""
