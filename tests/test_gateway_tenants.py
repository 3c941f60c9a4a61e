"""The gateway's tenants without a process (`pdqueue.frontends.tenants`): the tenants file and
its errors, who a key is, the token buckets behind 429 + Retry-After, tokens charged when an
answer ends, and the share that admits a quiet tenant over the backlog limit. End to end
(a real gateway, the openai client): tests/test_gateway_batches.py."""

from __future__ import annotations

import pytest

from pdqueue.frontends import tenants as tn
from pdqueue.frontends.service_classes import class_fields
from pdqueue.frontends.tenants import RateLimited, Tenant, TenantError, Tenants, load_tenants


def write(tmp_path, text: str) -> str:
    path = tmp_path / "tenants.toml"
    path.write_text(text)
    return str(path)


def test_the_tenants_file_maps_keys_to_tenants_with_their_settings(tmp_path):
    path = write(tmp_path, '[tenants.chat]\napi_keys = ["k1", "k2"]\nshare = 3\nrequests_per_s = 5\n'
                           'service_class = "interactive"\n[tenants.etl]\napi_keys = "k3"\n')
    loaded = load_tenants(path, api_key="k0")
    assert [t.name for t in loaded] == ["chat", "etl", "default"]
    chat = loaded[0]
    assert chat.api_keys == ("k1", "k2") and chat.share == 3 and chat.requests_per_s == 5
    assert chat.service_class == "interactive" and chat.tokens_per_s is None
    t = Tenants(loaded)
    assert t.identify("Bearer k2").name == "chat" and t.identify("bearer k3").name == "etl"
    assert t.identify("Bearer k0").name == "default"
    assert t.identify("Bearer nope") is None and t.identify("k1") is None and t.identify("") is None


@pytest.mark.parametrize("text, says", [
    ('[tenants.a]\napi_keys = ["x"]\nrate = 3\n', "unknown field(s) rate"),
    ('[tenants.a]\nshare = 1\n', "api_keys must be a non-empty list"),
    ('[tenants.a]\napi_keys = ["x"]\nrequests_per_s = 0\n', "requests_per_s must be a number > 0"),
    ('[tenants.a]\napi_keys = ["x"]\nservice_class = "gold"\n', "service_class must be one of"),
    ('[tenants.a]\napi_keys = ["x"]\n[tenants.b]\napi_keys = ["x"]\n', "the same API key is given to tenants"),
    ('api_keys = ["x"]\n', "expected [tenants.NAME] tables only"),
    ('[tenants.a\n', "not valid TOML"),
])
def test_a_bad_tenants_file_is_an_error_naming_what_is_wrong(tmp_path, text, says):
    with pytest.raises(TenantError) as info:
        load_tenants(write(tmp_path, text))
    assert says in str(info.value) and "--tenants" in str(info.value)


def test_no_key_configured_makes_every_request_the_default_tenant():
    t = Tenants(load_tenants(None, None))
    assert t.identify("").name == "default" and t.identify("Bearer anything").name == "default"


def test_requests_per_s_refuses_with_a_retry_after_until_the_bucket_refills(monkeypatch):
    clock = [1000.0]
    monkeypatch.setattr(tn.time, "monotonic", lambda: clock[0])
    t = Tenants([Tenant("slow", ("k",), requests_per_s=0.5, burst_s=4)])   # 2 at once, then one per 2 s
    state = t.identify("Bearer k")
    t.admit(state)
    t.admit(state)
    with pytest.raises(RateLimited) as info:
        t.admit(state)
    assert info.value.error.status == 429 and info.value.error.code == "rate_limit_exceeded"
    assert info.value.retry_after == 2 and "'slow'" in info.value.error.message
    clock[0] += 2.0
    t.admit(state)   # refilled


def test_tokens_are_charged_when_an_answer_ends_and_debt_refuses(monkeypatch):
    clock = [50.0]
    monkeypatch.setattr(tn.time, "monotonic", lambda: clock[0])
    t = Tenants([Tenant("t", ("k",), tokens_per_s=100)])
    state = t.identify("Bearer k")
    t.admit(state)
    state.started()
    state.finished(200, prompt_tokens=150, generated_tokens=250)   # 400 tokens: 300 in debt
    assert state.open == 0
    with pytest.raises(RateLimited) as info:
        t.admit(state)
    assert info.value.retry_after == 4   # (300 + 1) / 100 s
    clock[0] += 3.02
    t.admit(state)


def test_over_the_backlog_a_tenant_under_its_share_is_still_admitted():
    t = Tenants([Tenant("big", ("a",), share=1), Tenant("small", ("b",), share=1)])
    big, small = t.identify("Bearer a"), t.identify("Bearer b")
    for _ in range(9):
        big.started()
    small.started()
    assert t.exempt(small) and not t.exempt(big)   # 1 of 10 open against a half share
    assert not Tenants([Tenant("only", ("c",))]).exempt(t.identify("Bearer a"))   # one tenant: no exemption


def test_a_service_class_becomes_request_fields():
    assert class_fields("interactive") == {"service_class": "interactive", "priority": "high"}
    assert class_fields("standard") == {"service_class": "standard"}
    assert class_fields("batch") == {"service_class": "batch"}
    with pytest.raises(ValueError, match="expected one of interactive, standard, batch"):
        class_fields("gold")
