"""pdqueue.control.commands: switch commands, events and the plan hash, against a real Redis."""

from __future__ import annotations

import subprocess
import sys

import pytest

from pdqueue.control import commands
from pdqueue.keys import Keys

KEYS = Keys("ctl")


def test_a_sent_switch_is_read_once_and_parses(r):
    cid = commands.send_switch(r, KEYS, "w1", "decode", 1700000000123, by="planner")
    assert r.ttl(KEYS.control("w1")) > 0              # commands to a vanished worker expire
    taken = commands.take_commands(r, KEYS, "w1")
    assert len(taken) == 1
    cmd = commands.parse_command(taken[0][1])
    assert cmd == commands.SwitchCommand(id=cid, role="decode", epoch=1700000000123, by="planner")
    assert commands.take_commands(r, KEYS, "w1") == []  # deleted as read: carried out once


@pytest.mark.parametrize("fields, needle", [
    ({"op": "flip", "role": "decode", "epoch": "1"}, "op must be"),
    ({"op": "switch", "role": "gpu", "epoch": "1"}, "role must be one of"),
    ({"op": "switch", "role": "decode", "epoch": "x"}, "epoch must be an integer"),
    ({"op": "switch", "role": "decode"}, "epoch must be an integer"),
    ({"op": "switch", "role": "decode", "epoch": "1", "force": "1"}, "unknown field"),
])
def test_malformed_commands_are_refused_with_the_reason(fields, needle):
    with pytest.raises(commands.CommandError, match=needle):
        commands.parse_command({k.encode(): v.encode() for k, v in fields.items()})


def test_wait_switch_returns_the_final_event_of_that_command(r):
    commands.event(r, KEYS, commands.SWITCH, command="other", worker="w1", status="done")
    commands.event(r, KEYS, commands.SWITCH, command="c1", worker="w1", status="accepted")
    assert commands.wait_switch(r, KEYS, "c1", timeout_s=0.2) is None
    commands.event(r, KEYS, commands.SWITCH, command="c1", worker="w1", status="done", drain_ms=12.5)
    final = commands.wait_switch(r, KEYS, "c1", timeout_s=1)
    assert final["status"] == "done" and final["drain_ms"] == "12.5"
    assert [e["status"] for e in commands.switch_events(r, KEYS, "c1")] == ["accepted", "done"]


def test_plan_round_trips(r):
    assert commands.read_plan(r, KEYS) is None
    commands.write_plan(r, KEYS, {"prefill": 1, "decode": 2}, "TTFT p90 over SLO", mode="reactive", action="move")
    plan = commands.read_plan(r, KEYS)
    assert (plan["prefill"], plan["decode"], plan["colocated"]) == (1, 2, 0)
    assert plan["reason"] == "TTFT p90 over SLO" and plan["mode"] == "reactive" and plan["time_ms"] > 0


@pytest.mark.processes
def test_control_needs_no_torch():
    code = ("import sys, pdqueue.control.commands, pdqueue.control.planner, pdqueue.control.observe; "
            "print('torch' in sys.modules)")
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True).stdout
    assert out.strip() == "False"
