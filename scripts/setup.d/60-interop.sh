# Python for the interop tests (tests/tests/interop.rs): the CloudEvents SDK
# and confluent-kafka (its wheel carries its own librdkafka) in a venv under
# target/, which the tests find at target/interop-venv/bin/python.
OUTBOX_INTEROP_VENV="${OUTBOX_INTEROP_VENV:-target/interop-venv}"
OUTBOX_INTEROP_PACKAGES="cloudevents==1.11.0 confluent-kafka==2.6.1"
if ! command -v python3 >/dev/null 2>&1; then
  apt_install python3 python3-venv
fi
if [ ! -x "$OUTBOX_INTEROP_VENV/bin/python" ]; then
  echo "test: creating $OUTBOX_INTEROP_VENV"
  mkdir -p "$(dirname "$OUTBOX_INTEROP_VENV")"
  python3 -m venv "$OUTBOX_INTEROP_VENV" 2>/dev/null || { apt_install python3-venv; rm -rf "$OUTBOX_INTEROP_VENV"; python3 -m venv "$OUTBOX_INTEROP_VENV"; }
fi
if ! "$OUTBOX_INTEROP_VENV/bin/python" -c 'import cloudevents, confluent_kafka, sys; from importlib.metadata import version as v; sys.exit(not (v("cloudevents") == "1.11.0" and v("confluent-kafka") == "2.6.1"))' 2>/dev/null; then
  echo "test: installing $OUTBOX_INTEROP_PACKAGES into $OUTBOX_INTEROP_VENV"
  # shellcheck disable=SC2086
  "$OUTBOX_INTEROP_VENV/bin/python" -m pip install -q --disable-pip-version-check $OUTBOX_INTEROP_PACKAGES
fi
export OUTBOX_INTEROP_PYTHON="${OUTBOX_INTEROP_PYTHON:-$PWD/$OUTBOX_INTEROP_VENV/bin/python}"
