"""The `kv_transfer_params` contract shared by the proxy, the serving stack and the vLLM
connector: one parser per shape, and messages that say what was wrong and what was
expected. Also the one rule that counts an ended transfer."""

from __future__ import annotations

import dataclasses

import pytest

from kvpush.errors import ConfigError, FailureReason
from kvpush.integrations.vllm.params import (
    ConnectorConfig,
    client_request_id,
    pairing_id,
    prefill_transfer,
)
from kvpush.protocol import TransferEnded
from kvpush.transfer_metrics import record_ended, record_failed_at_once
from kvpush.transfer_params import (
    MAX_TEXT_CHARS,
    BadTransferParams,
    PrefillComputed,
    RemoteDecode,
    RemotePrefill,
    parse_remote_decode,
    parse_remote_prefill,
    wants_remote_decode,
    wants_remote_prefill,
)

DECODE = {"do_remote_prefill": True, "transfer_id": "t", "remote_host": "h", "remote_port": 5600}


def test_a_decode_requests_params_read_back_as_the_struct_the_proxy_built() -> None:
    built = RemotePrefill(transfer_id="t", remote_host="h", remote_port=5600)
    params = built.to_params()
    assert params == DECODE
    assert wants_remote_prefill(params) and not wants_remote_decode(params)
    assert parse_remote_prefill(params) == built


def test_a_port_written_in_decimal_digits_is_the_integer_it_spells() -> None:
    remote = parse_remote_prefill({**DECODE, "remote_port": "5600"})
    assert remote.remote_port == 5600 and isinstance(remote.remote_port, int)
    assert remote.to_params()["remote_port"] == 5600


@pytest.mark.parametrize(
    ("port", "got"),
    [
        (0, "got int 0"),
        (70000, "got int 70000"),
        (-1, "got int -1"),
        ("56x0", "got str '56x0'"),
        ("", "got str ''"),
        ("\uff15\uff16\uff10\uff10", "got str"),  # full-width digits are not a port
        (True, "got bool True"),
        (5600.0, "got float 5600.0"),
        (None, "got NoneType None"),
    ],
)
def test_a_bad_port_says_what_it_was_and_what_is_expected(port: object, got: str) -> None:
    with pytest.raises(BadTransferParams) as err:
        parse_remote_prefill({**DECODE, "remote_port": port})
    message = str(err.value)
    assert message.startswith("kv_transfer_params.remote_port must be a port number")
    assert "an integer in 1..65535, or one written in decimal digits" in message
    assert got in message


@pytest.mark.parametrize("key", ["transfer_id", "remote_host", "remote_port"])
def test_a_missing_field_is_named_as_missing(key: str) -> None:
    params = {k: v for k, v in DECODE.items() if k != key}
    with pytest.raises(BadTransferParams, match=rf"kv_transfer_params\.{key} .*got missing$"):
        parse_remote_prefill(params)


@pytest.mark.parametrize(
    ("key", "value", "got"),
    [
        ("transfer_id", 7, "got int 7"),
        ("transfer_id", "", "got str ''"),
        ("remote_host", ["h"], "got list ['h']"),
        ("remote_host", "h" * (MAX_TEXT_CHARS + 1), "got str 'hhhh"),
    ],
)
def test_a_field_of_the_wrong_type_says_what_was_expected(
    key: str, value: object, got: str
) -> None:
    with pytest.raises(BadTransferParams) as err:
        parse_remote_prefill({**DECODE, key: value})
    message = str(err.value)
    assert message.startswith(
        f"kv_transfer_params.{key} must be a non-empty string of at most {MAX_TEXT_CHARS} "
        "characters"
    )
    assert got in message


def test_tp_sizes_are_read_and_checked_but_may_differ_from_the_receivers() -> None:
    remote = parse_remote_prefill({**DECODE, "tp_size": 2, "decode_tp_size": 1})
    assert (remote.tp_size, remote.decode_tp_size) == (2, 1)
    assert parse_remote_prefill(DECODE).tp_size is None
    for key in ("tp_size", "decode_tp_size"):
        for bad in ("2", 0, -1, 1025, True, 1.5):
            with pytest.raises(BadTransferParams, match=rf"{key} must be an integer in 1\.\.1024"):
                parse_remote_prefill({**DECODE, key: bad})
    assert parse_remote_decode({"decode_tp_size": 4}).decode_tp_size == 4
    with pytest.raises(BadTransferParams, match=r"decode_tp_size must be an integer .* got str"):
        parse_remote_decode({"decode_tp_size": "4"})


def test_the_prefills_block_size_is_read_and_checked() -> None:
    assert parse_remote_prefill({**DECODE, "block_size": 16}).block_size == 16
    assert parse_remote_prefill(DECODE).block_size is None  # the decode's own, then
    for bad in ("16", 0, -1, 1 << 21, True, 16.0):
        with pytest.raises(
            BadTransferParams,
            match=r"block_size must be an integer in 1\.\.1048576 \(the prefill's block "
            r"size in tokens\), got",
        ):
            parse_remote_prefill({**DECODE, "block_size": bad})


def test_bad_params_are_a_config_error_and_a_bracketed_host_is_used_bare() -> None:
    assert issubclass(BadTransferParams, ConfigError)
    assert parse_remote_prefill({**DECODE, "remote_host": "[::1]"}).remote_host == "::1"


def test_a_prefill_requests_transfer_id_is_optional_unless_required() -> None:
    assert parse_remote_decode({"do_remote_decode": True}) == RemoteDecode()
    assert parse_remote_decode({"transfer_id": "t"}).transfer_id == "t"
    with pytest.raises(BadTransferParams, match=r"transfer_id .*got missing"):
        parse_remote_decode({"do_remote_decode": True}, require_transfer_id=True)
    with pytest.raises(BadTransferParams, match=r"transfer_id .*got int 3"):
        parse_remote_decode({"transfer_id": 3})
    assert RemoteDecode(transfer_id="t").to_params() == {
        "do_remote_decode": True,
        "transfer_id": "t",
    }


def test_a_prefill_request_may_name_its_decode_servers_side_channel() -> None:
    named = {"transfer_id": "t", "decode_host": "[::1]", "decode_port": "5601"}
    assert parse_remote_decode(named) == RemoteDecode(
        transfer_id="t", decode_host="::1", decode_port=5601
    )
    assert RemoteDecode(transfer_id="t", decode_host="h", decode_port=1).to_params() == {
        "do_remote_decode": True,
        "transfer_id": "t",
        "decode_host": "h",
        "decode_port": 1,
    }
    with pytest.raises(BadTransferParams, match=r"decode_port must be a port number .*missing"):
        parse_remote_decode({"transfer_id": "t", "decode_host": "h"})
    with pytest.raises(BadTransferParams, match=r"decode_host .*given with decode_port.*missing"):
        parse_remote_decode({"transfer_id": "t", "decode_port": 5601})
    with pytest.raises(BadTransferParams, match=r"decode_port must be a port number .*70000"):
        parse_remote_decode({"transfer_id": "t", "decode_host": "h", "decode_port": 70000})


def test_a_serving_prefill_answer_carries_the_flag_and_its_fields() -> None:
    answer = PrefillComputed(transfer_id="t", num_blocks=3, prompt_fingerprint="ab")
    assert answer.to_params() == {
        "do_remote_decode": True,
        "transfer_id": "t",
        "num_blocks": 3,
        "prompt_fingerprint": "ab",
    }


class _Tally:
    def __init__(self) -> None:
        self.ended: list[tuple[str, str, str]] = []
        self.nbytes: list[tuple[str, int]] = []
        self.seconds: list[tuple[str, float]] = []

    def count_ended(self, side: str, outcome: str, reason: str) -> None:
        self.ended.append((side, outcome, reason))

    def add_bytes(self, side: str, nbytes: int) -> None:
        self.nbytes.append((side, nbytes))

    def observe_seconds(self, side: str, seconds: float) -> None:
        self.seconds.append((side, seconds))


def test_a_finished_transfer_adds_bytes_and_time_a_failed_one_only_its_reason() -> None:
    tally = _Tally()
    # Held 3 blocks, moved 2 (a prefix hit at the receiver): the 2 are what count.
    finished = TransferEnded("a", "sender", None, "", (1, 2, 3), blocks_moved=2)
    record_ended(tally, finished, seconds=0.5, bytes_per_block=32)
    failed = TransferEnded("b", "receiver", FailureReason.PEER_GONE, "gone", ())
    record_ended(tally, failed, seconds=1.0, bytes_per_block=32)
    record_failed_at_once(tally, "receiver")
    assert tally.ended == [
        ("sender", "finished", ""),
        ("receiver", "failed", "peer_gone"),
        ("receiver", "failed", "local_error"),
    ]
    assert tally.nbytes == [("sender", 64)]
    assert tally.seconds == [("sender", 0.5)]


# ----------------------------------------------------------------- vLLM's push dialect


def _config(*, randomized: bool = True) -> ConnectorConfig:
    from helpers.vllm_worker import worker_config

    config = worker_config("p", "sender", 5600, total_kv_heads=2, block_size_tokens=16)
    return dataclasses.replace(config, request_ids_randomized=randomized)


def test_a_request_id_is_the_clients_without_the_suffix_vllm_adds() -> None:
    config = _config()
    assert client_request_id("cmpl-router-7-0-1a2b3c4d", config) == "cmpl-router-7-0"
    # vLLM told not to add one: the id is the client's as it is.
    bare = _config(randomized=False)
    assert client_request_id("cmpl-router-7-0-1a2b3c4d", bare) == "cmpl-router-7-0-1a2b3c4d"
    # Nothing that is not vLLM's suffix is cut.
    assert client_request_id("cmpl-router-7-0-1A2B3C4D", config) == "cmpl-router-7-0-1A2B3C4D"
    assert client_request_id("x-1a2b3c4", config) == "x-1a2b3c4"


def test_the_two_legs_of_one_request_name_one_transfer_and_other_requests_another() -> None:
    """Each vLLM adds a suffix of its own to the router's X-Request-Id; both sides cut it
    and digest the prompt: the same id and prompt pair, anything else does not."""
    config = _config()
    prompt = [1, 2, 3, 4]
    prefill = pairing_id(client_request_id("cmpl-rid-0-0badf00d", config), prompt)
    decode = pairing_id(client_request_id("cmpl-rid-0-12345678", config), prompt)
    assert prefill == decode
    assert prefill.startswith("cmpl-rid-0@")
    others = {
        pairing_id("cmpl-rid-0", [1, 2, 3, 5]),  # the same id, another prompt
        pairing_id("cmpl-rid-0", [1, 2, 3]),
        pairing_id("cmpl-other-0", prompt),
        pairing_id("cmpl-rid-0", prompt, cache_salt="tenant-b"),
        pairing_id("cmpl-rid-0", prompt, lora_name="adapter"),
        # A salt is not confused with an id that contains it.
        pairing_id("cmpl-rid-0", prompt, lora_name="x", cache_salt=""),
        pairing_id("cmpl-rid-0", prompt, lora_name="", cache_salt="x"),
    }
    assert prefill not in others and len(others) == 7
    long_id = "r" * 300
    assert len(pairing_id(long_id, prompt)) <= MAX_TEXT_CHARS
    assert pairing_id(long_id, prompt) != pairing_id(long_id + "s", prompt)


def test_a_prefill_takes_the_transfer_id_it_is_given_else_its_pairing_id() -> None:
    config = _config()
    named = prefill_transfer({"do_remote_decode": True, "transfer_id": "t-1"}, config, "pair")
    assert named.transfer_id == "t-1"
    # vllm-router's prefill leg: every remote field null, no transfer id.
    routed = {
        "do_remote_decode": True,
        "do_remote_prefill": False,
        "remote_engine_id": None,
        "remote_block_ids": None,
        "remote_host": None,
        "remote_port": None,
    }
    assert prefill_transfer(routed, config, "pair").transfer_id == "pair"
    fresh = prefill_transfer(routed, config)
    assert fresh.transfer_id.startswith("vllm-p-") and fresh.decode is None


def test_a_decode_leg_in_vllms_push_dialect_is_read_with_its_pairing_id() -> None:
    """What vllm-router rebuilds: no transfer_id, no block size, no decode TP."""
    params = {
        "do_remote_prefill": True,
        "do_remote_decode": False,
        "remote_engine_id": "prefill-engine",
        "remote_host": "::1",
        "remote_port": 5600,
        "tp_size": 1,
        "remote_request_id": "___prefill_addr_x___decode_addr_y_1234",
    }
    got = parse_remote_prefill(params, pairing_id="cmpl-x@ab")
    assert got.transfer_id == "cmpl-x@ab"
    assert (got.remote_host, got.remote_port, got.tp_size) == ("::1", 5600, 1)
    assert got.block_size is None and got.decode_tp_size is None
    # A transfer id the params name wins; none at all is still an error.
    assert parse_remote_prefill({**params, "transfer_id": "t"}, pairing_id="p").transfer_id == "t"
    with pytest.raises(BadTransferParams, match="transfer_id must be a non-empty string"):
        parse_remote_prefill(params)
