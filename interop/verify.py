#!/usr/bin/env python3
"""Reads a Kafka topic and checks every message against docs/WIRE.md.

    verify.py --bootstrap HOST:PORT --topic TOPIC [--expect N] [--timeout-s S] [--key SOURCE=KEY_ID=HEX ...]
    verify.py --self-test

Reads every partition of TOPIC from its first offset to its end (the high
watermark when the run starts), checks each message's headers, digests,
destination and partition, and prints one JSON line per message, then a
summary line. Exit 0: at least N messages read (default 1) and all verified;
1: a message failed; 2: too few messages, or the broker could not be read.
Needs confluent-kafka.
"""

import argparse
import datetime
import hashlib
import json
import os
import re
import sys
import time

import outbox_wire as wire

# Kafka's own reference values for murmur2 (Java client, Utils.murmur2), signed.
MURMUR2_REFERENCE = [
    ("21", -973932308),
    ("foobar", -790332482),
    ("a-little-bit-long-string", -985981536),
    ("a-little-bit-longer-string", -1486304829),
    ("lkjh234lh9fiuh90y23oiuhsafujhadof229phr9h19h89h8", -58897971),
    ("abc", 479470107),
]


def self_test() -> int:
    failures = 0
    for key, want in MURMUR2_REFERENCE:
        got = wire.murmur2(key.encode())
        got = got - (1 << 32) if got >= 1 << 31 else got
        if got != want:
            print(f"murmur2({key!r}) = {got}, Kafka says {want}")
            failures += 1
    if wire.sha256_digest(b"") != "sha256:e3b0c44298fc1c149afbf4c8996fb92427ae41e4649b934ca495991b7852b855":
        print("sha256 of the empty string")
        failures += 1
    enc = wire.encode_canonical("s.v1", [("k", "v\u00e9"), ("n", "12")])
    if enc != b"s.v1\nk=3:v\xc3\xa9\nn=2:12\n":
        print(f"canonical encoding {enc!r}")
        failures += 1
    for bad in (b"s.v1\nk=3:v\xc3\xa9\n", b"s.v1\nn=2:12\nk=3:v\xc3\xa9\n", enc + b"x", enc[:-1]):
        try:
            wire.decode_canonical(bad, "s.v1", ("k", "n"))
            print(f"decoded malformed {bad!r}")
            failures += 1
        except wire.WireError:
            pass
    checks, bad = example_checks(WIRE_MD)
    failures += bad
    print(f"self-test: {len(MURMUR2_REFERENCE) + 6 + checks - failures} passed, {failures} failed")
    return 1 if failures else 0


WIRE_MD = os.path.join(os.path.dirname(os.path.abspath(__file__)), "..", "docs", "WIRE.md")


def example_checks(path: str):
    """Recomputes every value of WIRE.md's worked example (its `json wire-example` block) from its inputs."""
    text = open(path, encoding="utf-8").read()
    m = re.search(r"```json wire-example\n(.*?)\n```", text, re.S)
    if not m:
        print(f"{path}: no json wire-example block")
        return 1, 1
    ex = json.loads(m.group(1))
    payload = bytes.fromhex(ex["payloadHex"])
    dest_bytes = bytes.fromhex(ex["destinationHex"])
    env_bytes = bytes.fromhex(ex["envelopeHex"])
    d = wire.decode_destination(dest_bytes)
    v2 = ex["destinationV2"]
    v2_bytes = bytes.fromhex(v2["destinationHex"])
    d2 = wire.decode_destination(v2_bytes)
    e = wire.decode_canonical(env_bytes, wire.ENVELOPE_SCHEMA, wire.ENVELOPE_FIELDS)
    ms = int(e["occurredAtMs"])
    ce_time = datetime.datetime.fromtimestamp(ms // 1000, datetime.timezone.utc).strftime("%Y-%m-%dT%H:%M:%S") + f".{ms % 1000:03d}Z"
    digest8 = hashlib.sha256(ex["eventId"].encode()).digest()[:8]
    eff = ex["effectKey"]
    eff_bytes = wire.encode_canonical("outboxEffectKey.v1", [("consumerId", eff["consumerId"]), ("eventId", ex["eventId"]), ("purpose", eff["purpose"])])
    headers = [(k, bytes.fromhex(v)) for k, v in ex["headers"]]
    sk = ex["signingKey"]
    keys = {(sk["source"], sk["keyId"]): bytes.fromhex(sk["secretHex"])}
    message = wire.check_message(d["topic"], int(d["partition"]), d["routingKey"].encode(), payload, headers, keys)
    claims = bytes.fromhex(ex["claimsHex"])
    h = wire.header_map(headers)
    wrong = {(sk["source"], sk["keyId"]): b"\x00" * 32}
    # The same message with a destination.v2 (its claims digest and signature
    # cover the v1 destination digest, so they are left out of this copy).
    swap = {"outbox-destination": v2_bytes, "outbox-destination-digest": v2["destinationDigest"].encode()}
    headers_v2 = [(k, swap.get(k, v)) for k, v in headers if k not in ("outbox-claims-digest", "outbox-signature", "outbox-key-id")]
    message_v2 = wire.check_message(d2["topic"], int(d2["partition"]), d2["routingKey"].encode(), payload, headers_v2)
    checks = [
        ("payloadDigest", wire.sha256_digest(payload), ex["payloadDigest"]),
        ("payloadSchema", wire.sha256_digest(ex["payloadSchemaText"].encode()), ex["payloadSchema"]),
        ("murmur2", wire.murmur2(ex["routingKey"].encode()), ex["murmur2"]),
        ("partition", wire.partition_of(ex["routingKey"].encode(), ex["partitions"]), ex["partition"]),
        ("destination fields", (d["routingKey"], d["partitions"], d["partition"]), (ex["routingKey"], str(ex["partitions"]), str(ex["partition"]))),
        ("destination re-encoded", wire.encode_destination(d), dest_bytes),
        ("destinationDigest", wire.sha256_digest(dest_bytes), ex["destinationDigest"]),
        ("destination.v1 has no topicId", "topicId" in d, False),
        ("destination.v2 topicId", d2.get("topicId"), v2["topicId"]),
        ("destination.v2 is v1 plus topicId", {k: x for k, x in d2.items() if k != "topicId"}, d),
        ("destination.v2 re-encoded", wire.encode_destination(d2), v2_bytes),
        ("destination.v2 digest", wire.sha256_digest(v2_bytes), v2["destinationDigest"]),
        ("envelope re-encoded", wire.encode_canonical(wire.ENVELOPE_SCHEMA, e.items()), env_bytes),
        ("envelopeDigest", wire.sha256_digest(env_bytes), ex["envelopeDigest"]),
        ("envelope fields", (e["eventId"], e["payloadDigest"], e["payloadSchema"], ms), (ex["eventId"], ex["payloadDigest"], ex["payloadSchema"], ex["occurredAtMs"])),
        ("eventId time", wire.id_millis(ex["eventId"]), ex["eventIdMs"]),
        ("ce_time", ce_time, ex["ceTime"]),
        ("takeoverBucket", int.from_bytes(digest8, "big") % 10000, ex["takeoverBucket"]),
        ("effectKey", "ek1-" + hashlib.sha256(eff_bytes).hexdigest(), eff["key"]),
        ("example message verifies", message["errors"], []),
        ("example message has CloudEvents", message["cloudevents"], True),
        ("claims re-encoded from the headers", wire.claims_bytes(h), claims),
        ("claimsDigest", wire.sha256_digest(claims), ex["claimsDigest"]),
        ("signature", wire.signature_of(bytes.fromhex(sk["secretHex"]), claims), ex["signature"]),
        ("a wrong key is refused", bool(wire.check_message(d["topic"], int(d["partition"]), d["routingKey"].encode(), payload, headers, wrong)["errors"]), True),
        ("example message with the destination.v2 verifies", message_v2["errors"], []),
    ]
    failures = 0
    for name, got, want in checks:
        if got != want:
            print(f"WIRE.md example, {name}: computed {got!r}, the document says {want!r}")
            failures += 1
    return len(checks), failures


def read_topic(bootstrap: str, topic: str, timeout_s: float, want: int = 0, idle_s: float = 3.0):
    """Yields every message of every partition of `topic` from its first offset.

    Stops once each partition was read to the end its broker reported when
    the read began and at least `want` messages came; short of `want`, it
    goes on until `idle_s` pass without a message (some brokers report a
    high watermark below their last record), or fails at `timeout_s`.
    """
    from confluent_kafka import Consumer, KafkaError, KafkaException, TopicPartition

    consumer = Consumer({
        "bootstrap.servers": bootstrap,
        "group.id": "outbox-interop-verify",
        "enable.auto.commit": False,
        "enable.partition.eof": True,
        "auto.offset.reset": "earliest",
        # The outbox writes no transactions; read every record there is.
        "isolation.level": "read_uncommitted",
    })
    try:
        deadline = time.monotonic() + timeout_s
        meta = consumer.list_topics(topic, timeout=timeout_s)
        t = meta.topics.get(topic)
        if t is None or t.error is not None or not t.partitions:
            raise RuntimeError(f"topic {topic!r} not found: {t.error if t else 'no metadata'}")
        parts = sorted(t.partitions)
        ends = {}
        for p in parts:
            low, high = consumer.get_watermark_offsets(TopicPartition(topic, p), timeout=timeout_s)
            ends[p] = (low, high)
        consumer.assign([TopicPartition(topic, p, low) for p, (low, _) in ends.items()])
        pending = {p: high for p, (low, high) in ends.items() if high > low}
        count = 0
        last = time.monotonic()
        while True:
            now = time.monotonic()
            if not pending and (count >= want or now - last >= idle_s):
                return
            if now > deadline:
                raise RuntimeError(f"timed out after {count} message(s); partitions not read to their end: {sorted(pending)}")
            m = consumer.poll(0.2)
            if m is None:
                continue
            if m.error():
                if m.error().code() == KafkaError._PARTITION_EOF:
                    continue
                raise KafkaException(m.error())
            if m.offset() + 1 >= pending.get(m.partition(), 0):
                pending.pop(m.partition(), None)
            count += 1
            last = time.monotonic()
            yield m
    finally:
        consumer.close()


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--bootstrap")
    ap.add_argument("--topic")
    ap.add_argument("--expect", type=int, default=1, help="fewest messages that must be read (default 1)")
    ap.add_argument("--timeout-s", type=float, default=60.0)
    ap.add_argument("--self-test", action="store_true", help="check the encodings against known values, read nothing")
    ap.add_argument("--key", action="append", default=[], metavar="SOURCE=KEY_ID=HEX", help="a verification key: signatures by it are checked")
    a = ap.parse_args()
    keys = {}
    for entry in a.key:
        parts = entry.rsplit("=", 2)
        if len(parts) != 3:
            ap.error(f"--key: expected SOURCE=KEY_ID=HEX")
        keys[(parts[0], parts[1])] = bytes.fromhex(parts[2])
    if a.self_test:
        return self_test()
    if not a.bootstrap or not a.topic:
        ap.error("--bootstrap and --topic are required")
    passed = failed = 0
    try:
        for m in read_topic(a.bootstrap, a.topic, a.timeout_s, want=a.expect):
            r = wire.check_message(m.topic(), m.partition(), m.key(), m.value(), m.headers(), keys)
            r.update({"topic": m.topic(), "partition": m.partition(), "offset": m.offset(), "ok": not r["errors"]})
            print(json.dumps(r, sort_keys=True), flush=True)
            if r["errors"]:
                failed += 1
            else:
                passed += 1
    except Exception as e:  # the broker, not a message
        print(f"cannot read {a.topic!r} at {a.bootstrap}: {e}", file=sys.stderr)
        return 2
    print(f"verified: {passed} passed, {failed} failed")
    if failed:
        return 1
    if passed < a.expect:
        print(f"expected at least {a.expect} message(s), read {passed}", file=sys.stderr)
        return 2
    return 0


if __name__ == "__main__":
    sys.exit(main())
