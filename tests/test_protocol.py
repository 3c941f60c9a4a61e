"""Wire types: round trips, and a clear reason for every kind of bad request."""

from __future__ import annotations

import dataclasses
import re
import subprocess
import sys

import msgpack
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from pdqueue.keys import Keys
from pdqueue.protocol import (
    DEFAULT_MAX_TOKENS,
    DEFAULT_TEMPERATURE,
    DEFAULT_TOP_K,
    DEFAULT_TOP_P,
    PROTOCOL_VERSION,
    REQUEST_FIELDS,
    Completion,
    ErrorCode,
    FinishReason,
    Handoff,
    HandoffError,
    Priority,
    ProtocolError,
    Request,
    RequestError,
    ResultType,
    ServiceClass,
    decode_handoff,
    done_entry,
    encode_handoff,
    error_entry,
    parse_request,
    parse_result,
    request_to_fields,
    token_entry,
    validate_request,
)
from pdqueue.queue.streams import request_streams

EID = "1700000000123-4"


def as_bytes(fields: dict) -> dict[bytes, bytes]:
    """What redis-py hands a worker."""
    return {k.encode(): v.encode() if isinstance(v, str) else v for k, v in fields.items()}


# -- keys ----------------------------------------------------------------------------------

def test_keys_share_one_hash_tag():
    keys = Keys()
    names = [keys.requests, keys.request_stream_for(ServiceClass.INTERACTIVE), keys.handoff, keys.handoff_node("n1"),
             keys.out("r1"), keys.done, keys.dead, keys.worker("w1"), keys.cancel("r1"),
             keys.seen("r1")]
    assert all(name.startswith("pdq:{default}:") for name in names)
    assert keys.request_stream_for(ServiceClass.INTERACTIVE) == "pdq:{default}:requests:high"
    assert keys.handoff_node("n1") == "pdq:{default}:handoff:n1"
    assert request_streams(keys) == ("pdq:{default}:requests:high", keys.requests, "pdq:{default}:requests:batch")
    assert keys.worker_id_of(keys.worker("w:1").encode()) == "w:1"
    assert Keys("blue").out("x") == "pdq:{blue}:out:x"
    with pytest.raises(ValueError):
        Keys("a{b}")


# -- requests ------------------------------------------------------------------------------

def test_request_round_trip_all_fields():
    req = Request(id="req-1", prompt="héllo\n", max_tokens=7, temperature=0.5, top_p=0.9,
                  top_k=40, seed=123, stop=("\n\n", "END"), deadline_ms=2500,
                  priority=Priority.HIGH, chat=True)
    fields = request_to_fields(req)
    assert all(isinstance(v, str) for v in fields.values())
    assert fields["stop"] == '["\\n\\n", "END"]' and fields["chat"] == "1"
    parsed = parse_request(EID, as_bytes(fields))
    assert parsed == dataclasses.replace(req, enqueued_ms=1700000000123)
    assert parsed.deadline_at_ms == 1700000000123 + 2500
    assert parsed.expired(1700000000123 + 2501) and not parsed.expired(1700000000123 + 2500)


def test_the_wire_carries_the_sampling_defaults_and_an_absent_field_means_the_default():
    """What the producer meant goes on the wire, defaults included (a worker whose defaults
    differ reads the same request); an older producer's entry without them still means the
    defaults; the other fields at their default are left out."""
    req = Request(id="r", prompt_ids=(1, 2, 3))
    assert request_to_fields(req) == {"id": "r", "prompt_ids": "[1,2,3]", "max_tokens": "128", "temperature": "1.0",
                                      "top_p": "1.0", "top_k": "0"}
    assert parse_request(EID, request_to_fields(req)) == dataclasses.replace(req, enqueued_ms=1700000000123)
    old = parse_request(EID, {"id": "r", "prompt_ids": "[1,2,3]"})
    assert old == dataclasses.replace(req, enqueued_ms=1700000000123)
    assert (old.max_tokens, old.temperature, old.top_p, old.top_k) == (DEFAULT_MAX_TOKENS, DEFAULT_TEMPERATURE,
                                                                       DEFAULT_TOP_P, DEFAULT_TOP_K)


@pytest.mark.parametrize("name,bad,good", [("max_tokens", 0, 1), ("temperature", -0.5, 0), ("top_p", 0.0, 1.0),
                                           ("top_k", -1, 0), ("seed", -1, 0)])
def test_each_sampling_field_has_one_check_that_every_layer_applies(name, bad, good):
    """sampling_error is the check: a Request, the engine's SamplingParams, the OpenAI front end
    and the CLI refuse the same value with the same reason, and take the same good one."""
    import click

    from pdqueue.engine.sampling import SamplingParams
    from pdqueue.frontends.openai_compat import OpenAIError, parse_completion
    from pdqueue.protocol import sampling_error
    from workers.cli.common import check_sampling

    reason = sampling_error(name, bad)
    assert reason and reason.startswith(f"{name} must be") and sampling_error(name, good) is None
    with pytest.raises(RequestError) as info:
        validate_request(Request(id="r", prompt="p", **{name: bad}))
    assert info.value.reason == reason
    if name != "seed":   # (the engine's seed is always the effective one, drawn or given)
        with pytest.raises(ValueError, match=re.escape(reason)):
            SamplingParams(**{name: bad})
        SamplingParams(**{name: good})
    with pytest.raises(OpenAIError) as http:
        parse_completion({"prompt": "p", name: bad - 1 if name == "top_k" else bad})   # (vLLM's top_k -1 is off)
    assert http.value.status == 400 and http.value.param == name and http.value.message.startswith(f"{name} must be")
    assert parse_completion({"prompt": "p", name: good}) is not None
    param = click.Option([f"--{name.replace('_', '-')}"], expose_value=True)
    param.name = name
    with pytest.raises(click.BadParameter, match=re.escape(sampling_error(name, bad, param.opts[0]))):
        check_sampling(None, param, bad)
    assert check_sampling(None, param, good) == good


def test_request_without_id_takes_the_entry_id():
    req = parse_request(EID, {b"prompt": b"hi"})
    assert req.id == EID and req.prompt == "hi" and req.max_tokens == 128
    assert Keys().out(req.id) == f"pdq:{{default}}:out:{EID}"


def test_redis_cli_style_values_are_accepted():
    req = parse_request(EID, {"prompt": "x", "max_tokens": " 5 ", "temperature": "0",
                              "top_p": ".5", "chat": "true", "priority": "HIGH"})
    assert (req.max_tokens, req.temperature, req.top_p, req.chat, req.priority) == (
        5, 0.0, 0.5, True, Priority.HIGH)


BAD_REQUESTS = [
    ({}, "needs 'prompt' or 'prompt_ids'"),
    ({"prompt": "a", "prompt_ids": "[1]"}, "both 'prompt' and 'prompt_ids'"),
    ({"prompt": b"\xff\xfe"}, "field 'prompt' is not valid UTF-8"),
    ({"prompt": "a", "max_tokens": "ten"}, "max_tokens must be an integer"),
    ({"prompt": "a", "max_tokens": "-3"}, "max_tokens must be an integer >= 1"),
    ({"prompt": "a", "max_tokens": "0"}, "max_tokens must be an integer >= 1"),
    ({"prompt": "a", "max_tokens": "1.5"}, "max_tokens must be an integer"),
    ({"prompt": "a", "temperature": "-0.1"}, "temperature must be a finite number >= 0"),
    ({"prompt": "a", "temperature": "nan"}, "temperature must be a finite decimal number"),
    ({"prompt": "a", "temperature": "1e999"}, "temperature must be a finite decimal number"),
    ({"prompt": "a", "top_p": "0"}, "top_p must be in (0, 1]"),
    ({"prompt": "a", "top_p": "1.01"}, "top_p must be in (0, 1]"),
    ({"prompt": "a", "top_k": "-1"}, "top_k must be an integer >= 0"),
    ({"prompt": "a", "seed": "-1"}, "seed must be an integer in [0, 2**63)"),
    ({"prompt": "a", "deadline_ms": "0"}, "deadline_ms must be an integer >= 1"),
    ({"prompt_ids": "[1, 2"}, "prompt_ids is not valid JSON"),
    ({"prompt_ids": '{"a": 1}'}, "prompt_ids must be a JSON array"),
    ({"prompt_ids": "[1, -2]"}, "prompt_ids must be a JSON array of non-negative integers"),
    ({"prompt_ids": '[1, "2"]'}, "prompt_ids must be a JSON array of non-negative integers"),
    ({"prompt_ids": "[1.0]"}, "prompt_ids must be a JSON array of non-negative integers"),
    ({"prompt_ids": "[true]"}, "prompt_ids must be a JSON array of non-negative integers"),
    ({"prompt_ids": "[]"}, "prompt_ids is empty"),
    ({"prompt": ""}, "prompt is empty"),
    ({"prompt": "a", "stop": "\n"}, "stop is not valid JSON"),
    ({"prompt": "a", "stop": "[1]"}, "stop must be a JSON array of strings"),
    ({"prompt": "a", "stop": '[""]'}, "stop must be a list of non-empty strings"),
    ({"prompt": "a", "priority": "urgent"}, "priority must be 'normal' or 'high'"),
    ({"prompt": "a", "chat": "yes"}, "chat must be 1 or 0"),
    ({"prompt_ids": "[1]", "chat": "1"}, "chat=1 needs 'prompt'"),
    ({"prompt": "a", "temprature": "0"}, "unknown field 'temprature'"),
]


@pytest.mark.parametrize("fields,reason", BAD_REQUESTS)
def test_bad_request_reasons(fields, reason):
    with pytest.raises(RequestError) as info:
        parse_request(EID, as_bytes({"id": "req-9", **fields}))
    assert reason in info.value.reason
    assert info.value.request_id == "req-9"  # the error can be answered on out:req-9
    assert info.value.code == "bad_request"


@pytest.mark.parametrize("bad_id", ["", "a b", "x" * 129, "a/b", "é", "a{b}"])
def test_bad_id_has_no_answer_stream(bad_id):
    with pytest.raises(RequestError) as info:
        parse_request(EID, {"id": bad_id, "prompt": "hi"})
    assert "id must be 1..128 characters" in info.value.reason
    assert info.value.request_id is None


def test_bad_request_without_id_names_the_entry_id():
    with pytest.raises(RequestError) as info:
        parse_request(EID, {b"prompt": b"hi", b"max_tokens": b"0"})
    assert info.value.request_id == EID
    with pytest.raises(RequestError) as info:
        parse_request(None, {b"prompt": b"hi"})
    assert "no 'id' field" in info.value.reason


def test_request_error_codes():
    assert RequestError("x", "r", ErrorCode.TOO_LONG).code == "too_long"
    assert RequestError("x", "r", "duplicate").code == "duplicate"
    assert isinstance(RequestError("x"), ValueError)


FIELD_NAMES = st.sampled_from(list(REQUEST_FIELDS)) | st.text(max_size=8)
FIELD_VALUES = (st.binary(max_size=24) | st.text(max_size=24)
                | st.sampled_from(["0", "-1", "1e999", "nan", "[1,2]", "[-1]", '["a"]', "[",
                                   "high", "1", "0.5", "[[[[[[]]]]]]", "9" * 40, "true"]))


@settings(max_examples=300, deadline=None, database=None)
@given(st.dictionaries(FIELD_NAMES | st.binary(max_size=8), FIELD_VALUES, max_size=6))
def test_parse_request_raises_only_request_error(fields):
    try:
        req = parse_request(EID, fields)
    except RequestError as exc:
        assert exc.reason and exc.code == "bad_request"
    else:
        assert parse_request(EID, request_to_fields(req)) == req  # what parses, round-trips


# -- results -------------------------------------------------------------------------------

def test_token_entry_round_trip():
    fields = token_entry(3, [17, 18], "é!")
    assert fields == {"type": "token", "index": "3", "token_ids": "[17,18]", "text": "é!"}
    event = parse_result(b"5-0", as_bytes(fields))
    assert (event.type, event.index, event.token_ids, event.text, event.entry_id) == (
        ResultType.TOKEN, 3, (17, 18), "é!", "5-0")


def test_done_entry_round_trip():
    completion = Completion(
        request_id="r1", text="hi there", token_ids=(5, 6), finish_reason=FinishReason.LENGTH,
        num_prompt_tokens=4, ttft_ms=12.5, queue_ms=1.25, prefill_ms=10.0, transfer_ms=0.5,
        transfer_bytes=65536, decode_ms=30.125, tbt_p50_ms=15.0, tbt_max_ms=16.0, e2e_ms=44.0,
        prefill_worker="p0", decode_worker="d0", transfer_path="shm")
    fields = done_entry(completion)
    assert all(isinstance(v, str) for v in fields.values())
    event = parse_result("9-0", as_bytes(fields))
    assert event.type is ResultType.DONE and event.completion == completion
    assert event.completion.num_tokens == 2


def test_error_entry_round_trip():
    event = parse_result("1-0", as_bytes(error_entry("prompt too long", ErrorCode.TOO_LONG, 0)))
    assert (event.type, event.reason, event.code, event.index) == (
        ResultType.ERROR, "prompt too long", "too_long", 0)
    assert parse_result("1-0", error_entry("boom")).code == "internal"


@pytest.mark.parametrize("fields", [{}, {"type": "nope"}, {"type": "token", "index": "x"},
                                    {"type": "token", "index": "0", "token_ids": "[oops"},
                                    {"type": "done", "finish_reason": "eos"}])
def test_malformed_results_raise_protocol_error(fields):
    with pytest.raises(ProtocolError):
        parse_result("1-0", fields)


# -- handoff -------------------------------------------------------------------------------

def make_handoff(**overrides) -> Handoff:
    values = dict(
        request=Request(id="r1", prompt="hi", seed=None, stop=("x",), enqueued_ms=1700000000000),
        prompt_ids=[1, 2, 3], output_ids=[7], seed=99,
        ticket={"version": 1, "segment": "pdq-kv-1", "block_ids": [0, 4], "lease_deadline": 1.5},
        prefill_worker="p0", enqueued_ms=1700000000000.0, prefill_start_ms=1700000000001.5,
        prefill_end_ms=1700000000010.0, first_token_ms=1700000000010.25, attempt=1)
    values.update(overrides)
    return Handoff(**values)


def test_handoff_round_trip():
    handoff = make_handoff()
    fields = encode_handoff(handoff)
    assert fields["id"] == b"r1" and isinstance(fields["data"], bytes)
    assert decode_handoff(as_bytes(fields)) == handoff
    assert decode_handoff(encode_handoff(make_handoff(ticket=None))).ticket is None


def test_handoff_rejects_other_versions_and_garbage():
    body = msgpack.unpackb(encode_handoff(make_handoff())["data"])
    body["version"] = PROTOCOL_VERSION + 1
    with pytest.raises(HandoffError, match="version 2 is not supported"):
        decode_handoff({b"data": msgpack.packb(body)})
    for data in [b"", b"\xc1", msgpack.packb([1, 2]), msgpack.packb({"version": PROTOCOL_VERSION})]:
        with pytest.raises(HandoffError):
            decode_handoff({b"data": data})
    with pytest.raises(HandoffError, match="no 'data'"):
        decode_handoff({b"id": b"r1"})
    with pytest.raises(HandoffError, match="output_ids is empty"):   # a ticket names KV of computed tokens
        decode_handoff(encode_handoff(make_handoff(output_ids=[])))


def test_a_prompt_handoff_has_no_ticket_and_no_output():
    prompt = make_handoff(output_ids=[], ticket=None)
    assert prompt.prompt_only and not make_handoff().prompt_only
    assert decode_handoff(encode_handoff(prompt)) == prompt


@pytest.mark.processes
def test_producer_imports_no_torch():
    code = ("import sys, pdqueue; from pdqueue import Client, AsyncClient; "
            "import pdqueue.queue, pdqueue.config; "
            "assert 'torch' not in sys.modules, 'torch imported'")
    subprocess.run([sys.executable, "-c", code], check=True, timeout=60)


def test_request_accepts_lists_and_plain_strings():
    req = Request(id="x", prompt_ids=[1, 2], stop=["a"], priority="high")
    assert req.prompt_ids == (1, 2) and req.stop == ("a",) and req.priority is Priority.HIGH
    assert request_to_fields(req)["priority"] == "high"


def test_roles_finish_reasons_and_reply_text_have_one_definition():
    from pdqueue.protocol import REQUEST_ROLES, ROLES, Role, as_str
    assert ROLES == ("prefill", "decode", "colocated") == tuple(r.value for r in Role)
    assert REQUEST_ROLES == ("prefill", "colocated") and Role.DECODE == "decode"
    assert f"{FinishReason.STOP}" == str(FinishReason.STOP) == "stop"   # as the engine's plain strings
    assert as_str(b"a") == as_str("a") == "a" and as_str(3) == "3"
    assert as_str(b"\xff", "replace") == "\ufffd"
    with pytest.raises(UnicodeDecodeError):
        as_str(b"\xff")
    req = Request(id="x", prompt="p")
    assert req.max_tokens == 128 == int(request_to_fields(req)["max_tokens"])


def test_max_tokens_against_the_context():
    """OpenAI's and vLLM's rule, prompt + max_tokens <= context; ``max_tokens=None`` (up to the
    context) goes on the wire as such and becomes what the prompt leaves of it."""
    from pdqueue.protocol import (
        MAX_TOKENS_CONTEXT,
        Limits,
        Request,
        RequestError,
        context_error,
        parse_request,
        request_to_fields,
        validate_request,
    )

    assert context_error(10, 8182, 8192) is None and context_error(None, 8191, 8192) is None
    assert "asks for 100010 tokens (10 in the prompt, 100000 in the completion)" in context_error(10, 100000, 8192)
    assert "max_tokens must be at most 8191" in context_error(None, 8192, 8192)
    assert context_error(10, None, 8192) is None and context_error(10, 100000, None) is None
    up_to = Request(id="r1", prompt="Hi", max_tokens=None)
    validate_request(up_to)
    assert request_to_fields(up_to)["max_tokens"] == MAX_TOKENS_CONTEXT
    assert parse_request("1-0", request_to_fields(up_to)).max_tokens is None
    limits = Limits()
    assert limits.fit_to_context(up_to, 100, 4096).max_tokens == 3996
    assert Limits(max_output_tokens=64).fit_to_context(up_to, 100, 4096).max_tokens == 64
    assert limits.fit_to_context(Request(id="r2", prompt="Hi", max_tokens=3996), 100, 4096).max_tokens == 3996
    with pytest.raises(RequestError) as info:
        limits.fit_to_context(Request(id="r3", prompt="Hi", max_tokens=3997), 100, 4096)
    assert info.value.code == "too_long" and "4097 tokens" in info.value.reason
