#!/usr/bin/env python3
"""Reads a Kafka topic with the CloudEvents SDK (Kafka protocol binding,
binary mode) and prints each message's CloudEvent as one JSON line:
its attributes and its data.

    cloudevents_read.py --bootstrap HOST:PORT --topic TOPIC [--expect N] [--timeout-s S]

Data is decoded as JSON when content-type says JSON, else given as text.
Exit 0 after the topic is read to its end; 2 when it cannot be read or a
message is not a CloudEvent. Needs cloudevents and confluent-kafka.
"""

import argparse
import json
import sys

from cloudevents.kafka import KafkaMessage, from_binary

import verify


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--bootstrap", required=True)
    ap.add_argument("--topic", required=True)
    ap.add_argument("--timeout-s", type=float, default=60.0)
    ap.add_argument("--expect", type=int, default=0, help="read on (until idle) while fewer messages than this came")
    a = ap.parse_args()
    try:
        for m in verify.read_topic(a.bootstrap, a.topic, a.timeout_s, want=a.expect):
            headers = {k: (v or b"") for k, v in (m.headers() or [])}
            ct = headers.get("content-type", b"").decode()
            json_data = ct.split(";")[0].strip().endswith("json")
            event = from_binary(
                KafkaMessage(headers=headers, key=m.key(), value=m.value()),
                data_unmarshaller=(json.loads if json_data else (lambda b: b.decode("utf-8", "replace"))),
            )
            attrs = {k: v for k, v in event.get_attributes().items() if k != "partitionkey"}
            key = event.get("partitionkey")
            print(json.dumps({
                "attributes": attrs,
                "partitionkey": key.decode() if isinstance(key, bytes) else key,
                "data": event.get_data(),
                "partition": m.partition(),
                "offset": m.offset(),
            }, sort_keys=True, default=str), flush=True)
    except Exception as e:
        print(f"cannot read {a.topic!r} at {a.bootstrap} as CloudEvents: {type(e).__name__}: {e}", file=sys.stderr)
        return 2
    return 0


if __name__ == "__main__":
    sys.exit(main())
