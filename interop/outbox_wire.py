"""The outbox wire format, written from docs/WIRE.md alone (no Rust source).

Pure functions: canonical.v1 decoding, digests, Kafka's murmur2 partitioner,
identifiers, and the checks one message must pass. Python 3.9+, standard
library only.
"""

import hashlib
import re

ENVELOPE_SCHEMA = "outboxEnvelope.v1"
DESTINATION_SCHEMA = "destination.v1"
DESTINATION_FIELDS = (
    "clusterId", "topic", "routingKey", "partitioner", "partitions", "partition", "routePolicy",
    "routePolicyGeneration", "serializer", "durability", "requiredAcks", "ordering",
)
# destination.v2 (WIRE.md "destination.v2"): destination.v1's fields with the
# topic's identity (Kafka topic id) right after `topic`.
DESTINATION_SCHEMA_V2 = "destination.v2"
DESTINATION_V2_FIELDS = DESTINATION_FIELDS[:2] + ("topicId",) + DESTINATION_FIELDS[2:]
_TOPIC_ID = re.compile(r"^[A-Za-z0-9_-]{21}[AQgw]$")
ENVELOPE_FIELDS = (
    "eventId", "envelopeGeneration", "aggregateType", "aggregateId", "aggregateVersion", "eventType",
    "payloadSchema", "payloadDigest", "tenant", "occurredAtMs", "createdTxid",
)
# Headers every message carries (WIRE.md "Headers").
REQUIRED_HEADERS = (
    "outbox-schema", "outbox-event-id", "outbox-envelope-generation", "outbox-attempt-id", "outbox-payload-digest",
    "outbox-destination-digest", "outbox-destination", "outbox-event-type", "outbox-tenant", "outbox-aggregate",
)
CLOUDEVENTS_HEADERS = ("ce_specversion", "ce_id", "ce_source", "ce_type", "ce_time", "content-type")
# The message claims record (WIRE.md "Source, claims digest and signature"):
# (field, header whose exact text is the value), in record order.
CLAIMS_SCHEMA = "outboxClaims.v1"
CLAIMS_FIELDS = (
    ("source", "outbox-source"), ("eventId", "outbox-event-id"), ("envelopeGeneration", "outbox-envelope-generation"),
    ("attemptId", "outbox-attempt-id"), ("aggregate", "outbox-aggregate"), ("eventType", "outbox-event-type"),
    ("tenant", "outbox-tenant"), ("payloadDigest", "outbox-payload-digest"), ("destinationDigest", "outbox-destination-digest"),
)
_SIGNATURE = re.compile(r"^hmac-sha256:[0-9a-f]{64}$")

_ID = re.compile(r"^(evt|att)-[0-7][0-9A-HJKMNP-TV-Z]{25}$")
_DIGEST = re.compile(r"^sha256:[0-9a-f]{64}$")
_TIME = re.compile(r"^\d{4}-\d{2}-\d{2}T\d{2}:\d{2}:\d{2}\.\d{3}Z$")
_TRACEPARENT = re.compile(r"^[0-9a-f]{2}-[0-9a-f]{32}-[0-9a-f]{16}-[0-9a-f]{2}$")
_CROCKFORD = "0123456789ABCDEFGHJKMNPQRSTVWXYZ"


class WireError(ValueError):
    """A message or encoding that does not follow WIRE.md."""


def decode_destination(data: bytes) -> dict:
    """A destination.v1 or destination.v2 (chosen by its first line); a v2's topicId must be 22
    characters of URL-safe base64 (16 bytes, no padding) and not the all-zero id."""
    if data.startswith(DESTINATION_SCHEMA_V2.encode() + b"\n"):
        d = decode_canonical(data, DESTINATION_SCHEMA_V2, DESTINATION_V2_FIELDS)
        if not _TOPIC_ID.match(d["topicId"]) or d["topicId"] == "A" * 22:
            raise WireError(f"topicId {d['topicId']!r} is not a Kafka topic id (22 characters of URL-safe base64)")
        return d
    return decode_canonical(data, DESTINATION_SCHEMA, DESTINATION_FIELDS)


def encode_destination(d: dict) -> bytes:
    """Re-encodes a decoded destination under its own schema."""
    return encode_canonical(DESTINATION_SCHEMA_V2 if "topicId" in d else DESTINATION_SCHEMA, d.items())


def sha256_digest(data: bytes) -> str:
    return "sha256:" + hashlib.sha256(data).hexdigest()


def decode_canonical(data: bytes, schema: str, fields) -> dict:
    """canonical.v1: `schema\\n`, then `name=<byte length>:<value>\\n` per field, in order, nothing after."""
    head = schema.encode() + b"\n"
    if not data.startswith(head):
        raise WireError(f"expected schema {schema}")
    pos = len(head)
    out = {}
    for name in fields:
        prefix = name.encode() + b"="
        if data[pos:pos + len(prefix)] != prefix:
            raise WireError(f"field {name}: missing or out of order")
        pos += len(prefix)
        colon = data.find(b":", pos, pos + 12)
        if colon < 0 or not data[pos:colon].isdigit():
            raise WireError(f"field {name}: bad length")
        length = int(data[pos:colon])
        start = colon + 1
        end = start + length
        if end >= len(data) or data[end:end + 1] != b"\n":
            raise WireError(f"field {name}: truncated")
        try:
            out[name] = data[start:end].decode("utf-8")
        except UnicodeDecodeError:
            raise WireError(f"field {name}: not UTF-8")
        pos = end + 1
    if pos != len(data):
        raise WireError("trailing bytes after the last field")
    return out


def encode_canonical(schema: str, pairs) -> bytes:
    out = bytearray(schema.encode() + b"\n")
    for name, value in pairs:
        v = value.encode("utf-8")
        out += name.encode() + b"=" + str(len(v)).encode() + b":" + v + b"\n"
    return bytes(out)


def murmur2(data: bytes) -> int:
    """Kafka's murmur2 (32-bit, seed 0x9747b28c), as an unsigned 32-bit value."""
    m = 0x5BD1E995
    mask = 0xFFFFFFFF
    length = len(data)
    h = (0x9747B28C ^ length) & mask
    full = length - length % 4
    for i in range(0, full, 4):
        k = data[i] | (data[i + 1] << 8) | (data[i + 2] << 16) | (data[i + 3] << 24)
        k = (k * m) & mask
        k ^= k >> 24
        k = (k * m) & mask
        h = (h * m) & mask
        h ^= k
    rest = length % 4
    if rest >= 3:
        h ^= data[full + 2] << 16
    if rest >= 2:
        h ^= data[full + 1] << 8
    if rest >= 1:
        h ^= data[full]
        h = (h * m) & mask
    h ^= h >> 13
    h = (h * m) & mask
    h ^= h >> 15
    return h


def partition_of(key: bytes, partitions: int) -> int:
    return (murmur2(key) & 0x7FFFFFFF) % partitions


def id_millis(ident: str) -> int:
    """The creation time (ms since the epoch) in an evt-/att- id: its first 48 of 128 bits."""
    value = 0
    for c in ident[4:]:
        value = (value << 5) | _CROCKFORD.index(c)
    return value >> 80


def header_map(headers) -> dict:
    """Kafka headers (a list of (name, bytes)) as a dict; a repeated name keeps its last value."""
    out = {}
    for name, value in headers or []:
        out[name] = value if value is not None else b""
    return out


def claims_bytes(h: dict) -> bytes:
    """The outboxClaims.v1 bytes of a message (its header map); WireError when a covered header is missing."""
    pairs = []
    for field, name in CLAIMS_FIELDS:
        if name not in h:
            raise WireError(f"header {name} missing")
        try:
            pairs.append((field, h[name].decode("utf-8")))
        except UnicodeDecodeError:
            raise WireError(f"header {name} is not UTF-8")
    return encode_canonical(CLAIMS_SCHEMA, pairs)


def signature_of(secret: bytes, claims: bytes) -> str:
    """The outbox-signature value: HMAC-SHA256 of the claims bytes under the secret."""
    import hmac
    return "hmac-sha256:" + hmac.new(secret, claims, hashlib.sha256).hexdigest()


def check_trust(h: dict, keys=None) -> list:
    """Checks 7 and 8 of "Verifying a message": the claims digest when present, the
    signature when present and `keys` ({(source, keyId): secret bytes}) has the key."""
    errors = []
    if "outbox-claims-digest" not in h:
        if "outbox-signature" in h:
            errors.append("outbox-signature without outbox-claims-digest")
        return errors
    try:
        claims = claims_bytes(h)
    except WireError as e:
        return [f"claims: {e}"]
    if sha256_digest(claims).encode() != h["outbox-claims-digest"]:
        errors.append("claims digest: the covered headers do not hash to outbox-claims-digest")
    source = h["outbox-source"].decode("utf-8", "replace")
    if "ce_source" in h and h["ce_source"].decode("utf-8", "replace") != source:
        errors.append(f"ce_source is not outbox-source {source!r}")
    if "outbox-signature" in h:
        sig = h["outbox-signature"].decode("utf-8", "replace")
        key_id = h.get("outbox-key-id", b"").decode("utf-8", "replace")
        if not _SIGNATURE.match(sig) or not key_id:
            errors.append("outbox-signature malformed or outbox-key-id missing")
        elif keys and (source, key_id) in keys:
            import hmac
            if not hmac.compare_digest(signature_of(keys[(source, key_id)], claims), sig):
                errors.append(f"signature does not verify under key {key_id!r} of {source!r}")
    return errors


def check_message(topic: str, partition: int, key, value: bytes, headers, keys=None) -> dict:
    """Every check of WIRE.md "Verifying a message". Returns {eventId, errors, cloudevents}."""
    h = header_map(headers)
    errors = []
    text = {}
    for name in REQUIRED_HEADERS:
        if name not in h:
            errors.append(f"header {name} missing")
            continue
        if name == "outbox-destination":
            continue
        try:
            text[name] = h[name].decode("utf-8")
        except UnicodeDecodeError:
            errors.append(f"header {name} is not UTF-8")
    if errors:
        return {"eventId": text.get("outbox-event-id"), "errors": errors, "cloudevents": False}
    event_id = text["outbox-event-id"]
    if text["outbox-schema"] != ENVELOPE_SCHEMA:
        errors.append(f"outbox-schema {text['outbox-schema']!r}")
    for name in ("outbox-event-id", "outbox-attempt-id"):
        want = "evt-" if name == "outbox-event-id" else "att-"
        if not _ID.match(text[name]) or not text[name].startswith(want):
            errors.append(f"{name} {text[name]!r} is not {want} and 26 Crockford base32 characters")
    if not re.fullmatch(r"[1-9][0-9]{0,9}", text["outbox-envelope-generation"]):
        errors.append("outbox-envelope-generation is not a positive decimal")
    if not _DIGEST.match(text["outbox-payload-digest"]):
        errors.append("outbox-payload-digest malformed")
    if sha256_digest(value or b"") != text["outbox-payload-digest"]:
        errors.append(f"payload digest: header {text['outbox-payload-digest']}, bytes {sha256_digest(value or b'')}")
    dest_bytes = h["outbox-destination"]
    if sha256_digest(dest_bytes) != text["outbox-destination-digest"]:
        errors.append("destination digest: the outbox-destination bytes do not hash to outbox-destination-digest")
    try:
        d = decode_destination(dest_bytes)
    except WireError as e:
        errors.append(f"outbox-destination: {e}")
        d = None
    if d is not None:
        if d["partitioner"] != "murmur2":
            errors.append(f"unknown partitioner {d['partitioner']!r}")
        elif not d["partitions"].isdigit() or int(d["partitions"]) < 1:
            errors.append(f"partitions {d['partitions']!r}")
        elif str(partition_of(d["routingKey"].encode(), int(d["partitions"]))) != d["partition"]:
            errors.append(f"partition {d['partition']} does not follow from murmur2 of key {d['routingKey']!r} over {d['partitions']}")
        if d["topic"] != topic or d["partition"] != str(partition):
            errors.append(f"message on {topic}/{partition}, destination {d['topic']}/{d['partition']}")
        k = key if isinstance(key, (bytes, bytearray)) or key is None else str(key).encode()
        if k != d["routingKey"].encode():
            errors.append(f"message key {k!r}, destination routing key {d['routingKey']!r}")
        if d["ordering"] not in ("key", "none"):
            errors.append(f"ordering {d['ordering']!r}")
    if not re.fullmatch(r"[^/]+/[^@]+@[0-9]+", text["outbox-aggregate"]):
        errors.append(f"outbox-aggregate {text['outbox-aggregate']!r} is not type/id@version")
    if "traceparent" in h and not _TRACEPARENT.match(h["traceparent"].decode("utf-8", "replace")):
        errors.append("traceparent malformed")
    ce = [n for n in CLOUDEVENTS_HEADERS if n in h]
    if ce:
        if len(ce) != len(CLOUDEVENTS_HEADERS):
            errors.append(f"CloudEvents headers incomplete: {ce}")
        else:
            c = {n: h[n].decode("utf-8", "replace") for n in CLOUDEVENTS_HEADERS}
            if c["ce_specversion"] != "1.0":
                errors.append(f"ce_specversion {c['ce_specversion']!r}")
            if c["ce_id"] != event_id:
                errors.append(f"ce_id {c['ce_id']!r} is not the eventId {event_id}")
            if c["ce_type"] != text["outbox-event-type"]:
                errors.append(f"ce_type {c['ce_type']!r} is not the event type {text['outbox-event-type']!r}")
            if not _TIME.match(c["ce_time"]):
                errors.append(f"ce_time {c['ce_time']!r} is not RFC 3339 UTC with milliseconds")
            if not c["ce_source"] or " " in c["ce_source"]:
                errors.append(f"ce_source {c['ce_source']!r}")
            if "/" not in c["content-type"]:
                errors.append(f"content-type {c['content-type']!r}")
    errors.extend(check_trust(h, keys))
    return {"eventId": event_id, "errors": errors, "cloudevents": bool(ce)}
