"""The control plane: optional loops that watch a cluster through Redis and steer its workers.

`observe` reads an `Observation` from Redis; `planner` decides (no I/O, no clock) from its
parts: `observation` and `decision` (the types), `signals`, `capacity`, `moves` (the hard
rules), the policies `reactive` and `predictive`, and `elastic` (per-worker TBT budgets and
migrations); `adapter` acts on a live cluster; `commands` is the command protocol a worker
answers (switch, budget, migrate).
"""
