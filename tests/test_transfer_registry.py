"""transfer.registry is the one list of KV transports: the CLI's --transfer choices, the
worker configuration's check, the receiver's modes, mode auto's order, the sender halves a
KVSender starts and the ops they answer all derive from it; reading it imports neither
torch nor zmq nor NIXL. And a new transport is one module and one registration: a fake one,
registered here, runs end to end (its sender half answers its op over the control channel,
its receiver half copies the blocks) without a change anywhere else."""

from __future__ import annotations

import subprocess
import sys
import uuid

import click
import pytest
import torch

from pdqueue.transfer import registry
from pdqueue.transfer.base import ReceiveContext, Source, SourceContext, Ticket, Transport
from pdqueue.transfer.errors import FailureCode, TransferError
from pdqueue.transfer.wire import ok_reply
from tests.kv_peers import SMALL, pool_values


def test_the_cli_and_the_configuration_take_their_transfer_modes_from_the_registry():
    from workers.cli.worker import worker
    from workers.common import TRANSFERS, WorkerConfig

    assert registry.modes() == ("auto", "shm", "tcp", "zmq", "nixl") == TRANSFERS
    option = next(p for p in worker.params if p.name == "transfer")
    assert isinstance(option.type, click.Choice) and tuple(option.type.choices) == registry.modes()
    assert option.help == registry.help_text()
    for mode in registry.modes():
        assert WorkerConfig(transfer=mode).transfer == mode
    with pytest.raises(ValueError, match="auto, shm, tcp, zmq, nixl"):
        WorkerConfig(transfer="carrier-pigeon")


def test_an_unknown_transport_is_refused_with_the_list():
    from pdqueue.transfer import KVReceiver, KVSender

    with pytest.raises(ValueError, match=r"unknown transfer mode 'udp'; expected auto or one of \['nixl', 'shm', "
                                         r"'tcp', 'zmq'\]"):
        registry.check_mode("udp")
    pool = SMALL.allocate()
    with pytest.raises(ValueError, match="unknown transfer mode 'udp'"):
        KVReceiver(pool, SMALL, "node", mode="udp")
    with pytest.raises(ValueError, match="unknown transfer mode 'udp'"):
        KVSender(pool, SMALL, "w", "i", "node", data_port=None, transfer="udp")
    with pytest.raises(ValueError, match="already registered"):
        registry.register("tcp", "pdqueue.transfer.tcp", "TcpTransport")


def test_each_registration_names_the_classes_of_both_halves_in_one_module():
    for spec in map(registry.spec, registry.names()):
        receiver = spec.receiver_class()
        assert issubclass(receiver, Transport) and receiver.name == spec.name and receiver.__module__ == spec.module
        source = spec.source_class()
        assert source is None or (issubclass(source, Source) and source.__module__ == spec.module)
        assert set(spec.leased_ops) <= set(spec.ops) and (not spec.ops or source is not None)
    assert registry.auto_order() == ["shm", "tcp", "zmq"]
    assert [registry.same_host_possible(m) for m in registry.modes()] == [True, True, False, False, False]
    assert [s.name for s in registry.served("auto")] == ["tcp"] and [s.name for s in registry.served("nixl")] == [
        "tcp", "nixl"]
    assert registry.op_owner("acquire").name == "nixl" and registry.op_owner("fetch") is None


def test_reading_the_registry_imports_no_transport():
    code = ("import sys, pdqueue.transfer, pdqueue.transfer.registry as r, workers.common, workers.cli.worker; "
            "r.modes(), r.auto_order(), r.help_text(), r.same_host_possible('auto'); "
            "print(sorted(m for m in ('torch', 'zmq', 'pdqueue.transfer.zmq', 'pdqueue.transfer.tcp', "
            "'pdqueue.transfer.shm', 'pdqueue.transfer.nixl') if m in sys.modules))")
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=60, check=True)
    assert out.stdout.strip() == "[]"


# -- a new transport: this module's two classes and one register() call ---------------------

class CourierSource(Source):
    """The fake transport's sender half: answers op ``courier_get`` with the leased blocks."""

    started: list["CourierSource"] = []

    def __init__(self, ctx: SourceContext):
        self.ctx, self.closed = ctx, False

    @classmethod
    def start(cls, ctx: SourceContext) -> "CourierSource":
        cls.started.append(source := cls(ctx))
        return source

    def ticket_fields(self) -> dict:
        return {}

    def answer(self, seq, op: str, request_id) -> bytes:
        leases = self.ctx.admission.leases
        assert op == "courier_get" and leases.acquire(request_id)
        ids = list(leases.get(request_id).block_ids)
        return ok_reply(seq, data=self.ctx.pool[:, :, ids].contiguous().view(torch.uint8).numpy().tobytes())

    def close(self) -> None:
        self.closed = True


class CourierTransport(Transport):
    """The fake transport's receiver half."""

    name = "courier"

    def __init__(self, ctx: ReceiveContext):
        super().__init__(ctx)

    def fetch(self, ticket: Ticket, dst_block_ids: list[int], first_block: int = 0) -> int:
        data = self.ctx.control.call(ticket, "courier_get")["data"]
        src = torch.frombuffer(bytearray(data), dtype=torch.uint8).view(self.ctx.layout.torch_dtype)
        self.ctx.pool[:, :, dst_block_ids] = src.view(*self.ctx.pool[:, :, dst_block_ids].shape)
        self.ctx.control.release_nowait(ticket)
        return len(data)


@pytest.fixture
def courier(monkeypatch):
    monkeypatch.setattr(registry, "_SPECS", dict(registry._SPECS))
    CourierSource.started.clear()
    return registry.register("courier", __name__, "CourierTransport", source="CourierSource", serve="named",
                             ops=("courier_get",), leased_ops=("courier_get",), unserved="runs no courier",
                             help="blocks carried in a reply")


def test_a_new_transport_is_one_module_and_one_registration(courier):
    from pdqueue.transfer import KVReceiver, KVSender

    assert "courier" in registry.modes() and "courier: blocks carried in a reply" in registry.help_text()
    assert "courier" not in registry.auto_order() and not registry.same_host_possible("courier")
    values = pool_values(SMALL, seed=3)
    local = SMALL.allocate()
    with KVSender(values, SMALL, "w-courier", uuid.uuid4().hex, "node-a", data_port=None, transfer="courier") as sender:
        assert list(sender.sources) == ["courier"]
        ticket = sender.export("req-1", [5, 2, 9], num_tokens=10)
        with KVReceiver(local, SMALL, "node-b", mode="courier", timeout_s=5) as receiver:
            result = receiver.fetch(ticket, [0, 1, 2])
        assert result.path == "courier" and result.nbytes == 3 * 2 * SMALL.num_layers * SMALL.block_nbytes
        assert torch.equal(local[:, :, [0, 1, 2]], values[:, :, [5, 2, 9]])
    assert CourierSource.started[0].closed
    # A sender of another mode does not run it, and says so to its op.
    with KVSender(values, SMALL, "w-plain", uuid.uuid4().hex, "node-a", data_port=None) as plain:
        assert plain.sources == {}
        ticket = plain.export("req-2", [1], num_tokens=2)
        with KVReceiver(local, SMALL, "node-b", mode="courier", timeout_s=5) as receiver:
            with pytest.raises(TransferError, match="runs no courier \\(start it with --transfer courier\\)") as err:
                receiver.fetch(ticket, [3])
            assert err.value.code == FailureCode.SEGMENT_UNAVAILABLE
