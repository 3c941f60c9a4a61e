"""Shared fixtures: one real redis-server per test session, flushed before each test.

No fakeredis and no mocks: tests talk to a real server started by ``RedisServer`` on a
free loopback port. The server is stopped at session end whatever happens (fixture
finalizer, atexit, and PDEATHSIG if the pytest process is killed outright).
"""

from __future__ import annotations

import atexit
import os

import pytest
import redis

from pdqueue.queue.redis_server import RedisServer
from tests import timeline
from tests.timeline import pytest_runtest_logreport  # noqa: F401  (PDQ_TEST_TIMELINE's hook: pytest finds it here)

# What the tests set themselves; a developer's own PDQ_* settings (a cluster name, a Redis
# URL, a cache directory) must not change what a test sees. PDQ_REDIS_SERVER (which server
# binary to run) stays, and PDQ_CACHE_DIR, which ``_own_cache_dir`` sets for the whole run.
_KEPT_ENV = {"PDQ_REDIS_SERVER", "PDQ_CACHE_DIR"}


# --- parallel runs (pytest-xdist: `scripts/test` runs `-n 3 --dist loadgroup`) ----------------
#
# Each xdist worker is a pytest session of its own: its own redis-server (``redis_server``),
# basetemp, KV segment prefix (tests/kv_peers.py) and cluster tags (tests/cluster.py). Tests are
# handed out one at a time, except these modules, which run whole on one worker: their module-
# or session-scoped fixtures (a `pdqueue up`, a 6-node Redis Cluster, network-namespace hosts,
# a sender process, SmolLM2's runs) start once, not once per worker, and their tests do not
# interleave with another module's (which would tear such a fixture down and start it again).
ONE_WORKER_MODULES = {
    "test_gateway.py", "test_redis_cluster.py", "test_netns.py", "test_kv_auth.py", "test_transfer.py",
    "test_nixl.py", "test_security.py", "test_engine.py", "test_models.py", "test_gateway_limits.py",
    "test_ledger.py",
}


# Tests handed out first (longest first, by `--durations` of full runs on 2 cores; tests of the
# groups above are left out: a group goes to one worker whole, and xdist hands out the groups
# before single tests). Handed out in file order, one of these could start in the last minutes
# while the other workers had nothing left: a run would end a minute after the other two
# workers. A test not listed (or renamed) is only handed out in file order, so the list needs no
# upkeep to stay correct, only to stay useful. Ids without brackets take every parametrization.
# Left out: tests of modules with costly module-scoped fixtures (test_gateway_batches' workers
# and gateway), which a worker would start again for the one test taken out of their order.
SLOW_FIRST = (
    # transformers' 400-token greedy answers (the oracle, once per run) and two decode workers
    "test_families_pipeline.py::test_running_decodes_migrate_with_their_kv_and_answer_as_transformers",
    "test_chaos.py::test_chaos_kill_and_restart",                                  # ~45 s
    "test_migration.py::test_a_receiver_killed_mid_move_loses_nothing",            # ~40 s
    "test_elastic_chaos.py::test_levers_and_kills_under_load_lose_nothing_and_double_nothing",   # ~40 s
    "test_switching.py::test_roles_flipping_under_load",                           # ~35 s
    "test_migration.py::test_a_sender_killed_while_it_serves_the_moved_kv_loses_nothing",   # ~30 s
    "test_supervision.py::test_a_worker_rides_out_a_short_outage_and_exits_once_redis_stays_gone",
    "test_switching.py::test_last_worker_of_a_role_refuses_to_leave_a_backlog",
    "test_cli.py::test_two_local_clusters_side_by_side",
    "test_pipeline.py::test_pipeline_matches_colocated_engine[2-2-zmq-zmq]",
    "test_up_supervisor.py::test_a_decode_worker_killed_mid_answer_is_restarted_and_the_answer_completes_as_without_the_kill",
    "test_migration.py::test_decode_workers_stopped_together_finish_their_own_requests",   # ~35 s in its setup, ~35 s
    "test_migration.py::test_a_warm_stopped_decode_worker_moves_its_running_requests_with_their_kv",
    "test_migration.py::test_a_stopped_colocated_worker_moves_its_decodes_to_a_decode_worker",
    "test_pipeline.py::test_pipeline_matches_colocated_engine[2-2-tcp-tcp]",
    "test_switching.py::test_switch_each_way_with_requests_in_flight",
    "test_pipeline.py::test_pipeline_matches_colocated_engine[2-2-auto-shm]",
    "test_pipeline.py::test_smollm2_pipeline_matches_colocated_engine",
    "test_migration.py::test_a_migrate_command_moves_running_decodes_off_a_serving_colocated_worker",
    "test_bench.py::test_serve_tiny_json_has_the_figures_per_mode",
    "test_bench.py::test_serve_chaos_rolling_restart_then_zero_capacity_fail_no_request_beside_a_baseline",
    "test_families_pipeline.py::test_prefill_and_decode_workers_answer_as_transformers",   # ~20 s each
    "test_bench.py::test_transfer_quick_json_has_the_ratios",
    "test_bench.py::test_serve_batch_with_a_worker_killed_and_redis_restarted_answers_every_line_once",
    "test_gguf_families.py::test_gguf_vocabularies_tokenize_as_llama_cpp",      # ~10 s each
    "test_faults.py::test_prefill_killed_and_its_segment_removed_before_fetch",
    "test_cli.py::test_up_keeps_the_logs_when_the_redis_server_dies",
    "test_pipeline.py::test_pipeline_matches_colocated_engine[1-1-auto-shm]",
    "test_cli.py::test_generate_prints_its_random_seed_and_repeats_with_it",
    "test_long_step.py::test_a_stopped_worker_is_still_taken_over_as_hung",
    "test_cli.py::test_up_serves_submit_and_status_then_leaves_nothing_behind",
    "test_cli.py::test_ctrl_c_in_the_terminal_is_a_warm_stop",
    "test_cli.py::test_ctrl_c_answers_what_is_queued_before_stopping",
    "test_up_supervisor.py::test_the_gateway_takes_sigterm_first_and_exits_last_with_its_open_answer_complete",
    "test_fuzz.py::test_fuzz_requests",
    "test_metrics.py::test_a_metrics_port_in_use_is_refused_before_the_model_loads",
    "test_up_supervisor.py::test_under_adapt_a_restarted_worker_comes_back_in_the_role_it_was_switched_to",
    "test_pipeline.py::test_pipeline_matches_colocated_engine[1-1-tcp-tcp]",   # ~20 s; the rest 15-20 s
    "test_faults.py::test_warm_stop_drains_a_decode_worker",
    "test_up_supervisor.py::test_print_env_and_print_url_give_redis_cli_the_running_ups_password",
    "test_up_supervisor.py::test_a_worker_that_keeps_dying_is_given_up_on_and_up_stops_when_its_role_has_nobody",
    "test_pipeline.py::test_plain_redis_producer",
    "test_faults.py::test_decode_killed_mid_generation",
    "test_pipeline.py::test_bad_input_gets_an_error_and_nothing_is_lost",
    "test_switching.py::test_worker_killed_mid_switch",
    "test_routing.py::test_requests_routed_to_a_hung_worker_are_taken_over_exactly_once",   # ~12 s
    "test_placement.py::test_a_decode_worker_killed_holding_placed_prompts_loses_nothing",   # ~7 s (400 tokens)
    "test_placement.py::test_placed_prompts_are_prefilled_on_the_decode_worker_token_for_token",
    "test_faults.py::test_hung_decode_worker_is_taken_over_and_answers_once",
    "test_service_classes.py::test_interactive_requests_start_before_batch_work_queued_ahead_of_them",
    "test_gateway_runtime.py::test_bench_gateway_variants_runs_one_gateway_each",
    "test_pipeline.py::test_cross_host_path_is_chosen_by_itself",
    "test_long_step.py::test_a_step_longer_than_reclaim_idle_keeps_its_entries",
    "test_pipeline.py::test_pipeline_matches_colocated_engine[1-1-zmq-zmq]",
    "test_long_step.py::test_a_step_longer_than_max_step_s_is_taken_for_stuck",
)


def _slow_rank(item) -> int:
    """``item``'s place in SLOW_FIRST (its length when not listed)."""
    test_id = f"{item.path.name}::{item.name}"
    for rank, listed in enumerate(SLOW_FIRST):
        if test_id == listed or ("[" not in listed and test_id.startswith(listed + "[")):
            return rank
    return len(SLOW_FIRST)


# --- tiers, by what a test starts (`bash scripts/test --fast` runs pure and redis) -------------
#
#   pure       nothing: functions, classes, the tiny model in this process
#   redis      the session's redis-server (fixtures redis_server, redis_url, r)
#   processes  worker, gateway, CLI or server processes of its own
#   model      the real SmolLM2 (marked slow)
#
# A test's tier is the highest that applies: marked slow, or asking for the smollm2 fixture,
# is `model`; a test in a module of PROCESS_MODULES, asking for a fixture of
# PROCESS_FIXTURES, or marked `processes` is `processes`; one asking for a Redis fixture is
# `redis`; the rest is `pure`. Tests that start processes by themselves in a mixed module are
# marked `@pytest.mark.processes` (checked with `PDQ_TEST_TRACE_PROCS=1`,
# which fails a pure or redis test that starts a process).
TIERS = ("pure", "redis", "processes", "model")
# Tools a pure test may run: a second each, no pdqueue process (the linter, tests/test_suite_hygiene.py).
FAST_TIER_TOOLS = {"ruff"}
REDIS_FIXTURES = {"redis_server", "redis_url", "r"}
PROCESS_FIXTURES = {"cluster", "env"}
PROCESS_MODULES = {
    "test_batch.py", "test_bench.py", "test_chaos.py", "test_cli.py", "test_faults.py", "test_fuzz.py",
    "test_gateway.py", "test_long_step.py", "test_netns.py", "test_nixl.py", "test_pipeline.py",
    "test_redis_cluster.py", "test_routing.py", "test_security.py", "test_switching.py", "test_supervision.py",
    "test_migration.py",
    "test_up_supervisor.py", "test_bench_clients.py", "test_elastic_chaos.py", "test_gateway_limits.py",
    "test_up_stop.py", "test_gguf_families.py", "test_families_pipeline.py",
}


def tier_of(item) -> str:
    fixtures = set(getattr(item, "fixturenames", ()))
    if item.get_closest_marker("slow") or "smollm2" in fixtures:
        return "model"
    if (item.path.name in PROCESS_MODULES or fixtures & PROCESS_FIXTURES
            or item.get_closest_marker("processes")):
        return "processes"
    return "redis" if fixtures & REDIS_FIXTURES else "pure"


@pytest.hookimpl(tryfirst=True)  # before xdist's own hook reads the xdist_group marks
def pytest_collection_modifyitems(config, items):
    for item in items:
        if item.path.name in ONE_WORKER_MODULES and item.get_closest_marker("xdist_group") is None:
            item.add_marker(pytest.mark.xdist_group(item.path.stem))
        item.add_marker(getattr(pytest.mark, tier_of(item)))
    items.sort(key=_slow_rank)   # stable: the rest keep their order


@pytest.fixture(autouse=True)
def _fast_tier_starts_no_process(request, monkeypatch):
    """With PDQ_TEST_TRACE_PROCS=1, a pure or redis test that starts a process fails: how
    the tiers above are kept true."""
    if os.environ.get("PDQ_TEST_TRACE_PROCS") != "1" or tier_of(request.node) in ("processes", "model"):
        return
    import subprocess

    real = subprocess.Popen.__init__

    def popen(self, args, *a, **kw):
        program = args[0] if isinstance(args, (list, tuple)) else str(args).split()[0]
        if os.path.basename(str(program)) in FAST_TIER_TOOLS:
            return real(self, args, *a, **kw)
        pytest.fail(f"a {tier_of(request.node)}-tier test started a process ({args!r}): mark it "
                    f"@pytest.mark.processes or move it")
        real(self, args, *a, **kw)

    monkeypatch.setattr(subprocess.Popen, "__init__", popen)


def _xdist_can_group() -> bool:
    """Whether pytest-xdist's loadgroup can add a test's group to its node id (it writes
    ``item._nodeid``; pytest 9.2's ``Node.nodeid`` reads another attribute, and every group
    was then silently ignored: pyproject.toml pins pytest below 9.2)."""
    import inspect

    from _pytest.nodes import Node

    return "_nodeid" in inspect.getsource(Node.nodeid.fget)


def pytest_configure(config):
    timeline.configure()
    if config.getoption("dist", "no") == "loadgroup" and not _xdist_can_group():
        raise pytest.UsageError(
            f"--dist loadgroup would not group the tests with pytest {pytest.__version__} (the one-worker "
            f"modules would run spread over every worker): pip install 'pytest>=8,<9.2'")
    if os.environ.get("PYTEST_XDIST_WORKER"):
        # Several test processes share the cores: torch work in this one (oracles, engines)
        # runs on one thread, as the worker processes the tests start do (--threads 1).
        import torch

        torch.set_num_threads(1)


@pytest.fixture(scope="session", autouse=True)
def _oracle_cache(tmp_path_factory):
    """``tests.helpers.oracle``'s answers, shared by this run's xdist workers (their basetemps
    are folders of the run's; one pytest process: its own basetemp). Never across runs."""
    from tests import helpers

    base = tmp_path_factory.getbasetemp()
    helpers.ORACLE_CACHE = (base.parent if os.environ.get("PYTEST_XDIST_WORKER") else base) / "oracle-cache"
    yield
    helpers.ORACLE_CACHE = None


@pytest.fixture(scope="session", autouse=True)
def _run_cache(tmp_path_factory):
    """``tests.run_cache``'s folder (checkpoints, GGUF files, answers made once per run),
    shared by this run's xdist workers as ``_oracle_cache``'s is. Never across runs."""
    from tests import run_cache

    base = tmp_path_factory.getbasetemp()
    run_cache.ROOT = (base.parent if os.environ.get("PYTEST_XDIST_WORKER") else base) / "run-cache"
    yield
    run_cache.ROOT = None


@pytest.fixture(scope="session", autouse=True)
def _own_cache_dir(tmp_path_factory):
    """The model cache of this run ($PDQ_CACHE_DIR: converted models, quantized weights, the
    q4_1 kernel), never the user's ~/.cache/pdqueue nor a PDQ_CACHE_DIR of theirs: under the
    run's basetemp, shared by its xdist workers (their basetemps are folders of the run's;
    the cache is safe for concurrent writers, models/cache.py), so SmolLM2 is converted once
    a run, not once a test. Set in this process's environment, which every process a test
    starts inherits (the `env` fixture keeps it, tests/cluster.py's forks copy it).
    PDQ_TEST_CACHE_DIR names a cache to keep across runs instead."""
    base = tmp_path_factory.getbasetemp()
    root = os.environ.get("PDQ_TEST_CACHE_DIR") or str(
        (base.parent if os.environ.get("PYTEST_XDIST_WORKER") else base) / "pdq-cache")
    before = os.environ.get("PDQ_CACHE_DIR")
    os.environ["PDQ_CACHE_DIR"] = root
    yield root
    if before is None:
        os.environ.pop("PDQ_CACHE_DIR", None)
    else:
        os.environ["PDQ_CACHE_DIR"] = before


def pytest_sessionfinish(session, exitstatus):
    """The run's model cache (``_own_cache_dir``: ~0.5 GB with SmolLM2 converted) goes with
    the run, removed by the process that outlives its xdist workers (or the only one)."""
    factory = getattr(session.config, "_tmp_path_factory", None)
    if os.environ.get("PYTEST_XDIST_WORKER") or os.environ.get("PDQ_TEST_CACHE_DIR") or factory is None:
        return
    import shutil

    shutil.rmtree(factory.getbasetemp() / "pdq-cache", ignore_errors=True)


@pytest.fixture
def cache_dir(tmp_path, monkeypatch):
    """A model cache of this test's own ($PDQ_CACHE_DIR)."""
    root = tmp_path / "cache"
    monkeypatch.setenv("PDQ_CACHE_DIR", str(root))
    return root


@pytest.fixture(autouse=True)
def _no_pdq_environment(monkeypatch):
    for name in list(os.environ):
        if name.startswith("PDQ_") and name not in _KEPT_ENV:
            monkeypatch.delenv(name)


@pytest.fixture(scope="session")
def redis_server():
    server = RedisServer()
    atexit.register(server.stop)  # stop() is idempotent; this covers an aborted session
    server.start()
    try:
        yield server
    finally:
        server.stop()


@pytest.fixture
def redis_url(redis_server) -> str:
    """URL of the session's server, emptied (FLUSHALL) before the test."""
    if not redis_server.running:  # a test that restarted or killed it
        redis_server.restart()
    with redis.Redis.from_url(redis_server.url) as client:
        client.flushall()
    return redis_server.url


@pytest.fixture
def r(redis_url):
    """A redis-py client (bytes replies) on an empty database."""
    client = redis.Redis.from_url(redis_url)
    try:
        yield client
    finally:
        client.close()


# The models, loaded once per test module that asks (the real SmolLM2 is marked slow where used).
@pytest.fixture(scope="module")
def tiny():
    from pdqueue.models.loader import load_model

    return load_model("tiny")


@pytest.fixture(scope="module")
def smollm2():
    from pdqueue.models.loader import load_model

    return load_model("smollm2")


@pytest.fixture
def cluster(redis_url, tmp_path):
    """Real worker processes (``tests.cluster.Cluster``) against the test's Redis; at the end
    nothing may be left behind (``Cluster.stop_and_check``)."""
    from tests.cluster import Cluster

    c = Cluster(redis_url, tmp_path)
    yield c
    c.stop_and_check()


@pytest.fixture
def env(tmp_path) -> dict:
    """The environment of a user with no PDQ_* settings, no `pdqueue up` running and a
    private state directory (for commands run as subprocesses); the run's model cache
    (``_own_cache_dir``) stays."""
    clean = {k: v for k, v in os.environ.items() if not k.startswith("PDQ_") or k == "PDQ_CACHE_DIR"}
    run = tmp_path / "run"
    run.mkdir()
    return {**clean, "XDG_RUNTIME_DIR": str(run), "PYTHONUNBUFFERED": "1"}


@pytest.fixture(scope="module")
def one_thread():
    """torch on one thread for the module (restored after)."""
    import torch

    before = torch.get_num_threads()
    torch.set_num_threads(1)
    try:
        yield
    finally:
        torch.set_num_threads(before)
