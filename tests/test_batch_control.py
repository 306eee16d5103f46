"""The batch's control fields (issue 64): whether the ref server runs the reference (`needs_ref`) and the
temperature of the logprobs (`logp_temperature`) are typed fields of RolloutBatch / ScoredBatch, not keys of the
free `extra` dict; on the wire they stay `extra` keys (docs/protocol.md), so a producer writing that form, and a
peer reading it, work unchanged."""
from __future__ import annotations

import json

import pytest
from test_protocol import join, make_rollout, make_scored, split

from common.wire.batch import collate
from common.wire.protocol import ProtocolError, decode_rollout, decode_scored, encode_rollout, encode_scored


def test_control_fields_are_typed_and_extra_holds_only_data():
    b = make_rollout(extra={"needs_ref": False, "logp_temperature": 0.7, "truncated": [False] * 4})
    assert b.needs_ref is False and b.logp_temperature == 0.7 and b.extra == {"truncated": [False] * 4}
    plain = make_rollout()
    assert plain.needs_ref is True and plain.logp_temperature == 1.0


def test_wire_form_unchanged_both_ways():
    b = make_rollout(needs_ref=False, logp_temperature=0.7)
    data = encode_rollout(b)
    extra = json.loads(split(data)[0]["__metadata__"]["extra"])
    assert extra["needs_ref"] is False and extra["logp_temperature"] == 0.7  # what a peer of the extra form reads
    got = decode_rollout(data)
    assert (got.needs_ref, got.logp_temperature) == (False, 0.7) and "needs_ref" not in got.extra
    # the defaults are not written: absent means them, as the wire always said
    assert "needs_ref" not in json.loads(split(encode_rollout(make_rollout()))[0]["__metadata__"]["extra"])
    s = decode_scored(encode_scored(make_scored(ref=False, logp_temperature=0.9)))
    assert s.logp_temperature == 0.9 and s.needs_ref is True


@pytest.mark.parametrize("kw,match", [
    ({"logp_temperature": 0}, r"logp_temperature'\] must be a number > 0"),
    ({"logp_temperature": float("nan")}, r"logp_temperature'\] must be a number > 0"),
    ({"needs_ref": "no"}, r"needs_ref'\] must be true or false"),
    ({"extra": {"needs_ref": 1}}, r"needs_ref'\] must be true or false"),
])
def test_bad_control_fields_are_refused_at_encode_and_decode(kw, match):
    with pytest.raises(ProtocolError, match=match):
        encode_rollout(make_rollout(**kw))
    header, body = split(encode_rollout(make_rollout()))  # a peer that wrote the bad value into extra itself
    control = kw["extra"] if "extra" in kw else kw
    header["__metadata__"]["extra"] = json.dumps(control)
    with pytest.raises(ProtocolError, match=match):
        decode_rollout(join(header, body))


def test_collate_keeps_the_first_batchs_control_fields():
    a, b = make_rollout(logp_temperature=0.8, needs_ref=False), make_rollout(seed=1, logp_temperature=0.8,
                                                                             needs_ref=False)
    c = collate([a, b])
    assert c.num_rows == 8 and (c.needs_ref, c.logp_temperature) == (False, 0.8) and "needs_ref" not in c.extra
