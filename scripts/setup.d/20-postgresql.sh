# PostgreSQL on 127.0.0.1:5432 for the tests, and its server binaries
# (initdb, pg_ctl) for outbox-testkit's throwaway servers.
#
# On a fresh machine (the Debian package just installed) the cluster has
# only the `postgres` role and password authentication on 127.0.0.1; the
# default DATABASE_URL (postgres://root@127.0.0.1:5432/test) then needs a
# `root` superuser, a `test` database and trust for root on 127.0.0.1 (a
# throwaway test machine only). This is done only for that default URL and
# only when it does not connect already; a DATABASE_URL of your own is used
# as it is.
if ! ls /usr/lib/postgresql/*/bin/initdb >/dev/null 2>&1; then
  apt_install postgresql
fi
if ! command -v psql >/dev/null 2>&1; then
  apt_install postgresql-client
fi
outbox_pg_port="${OUTBOX_TEST_PG_PORT:-5432}"
outbox_pg_cluster() {
  # "<version> <name>" of the cluster on $outbox_pg_port, if pg_lsclusters knows it.
  command -v pg_lsclusters >/dev/null 2>&1 && pg_lsclusters -h 2>/dev/null | awk -v p="$outbox_pg_port" '$3 == p { print $1, $2; exit }'
}
if ! pg_isready -h 127.0.0.1 -p "$outbox_pg_port" -q 2>/dev/null; then
  echo "test: starting PostgreSQL"
  cluster="$(outbox_pg_cluster || true)"
  if [ -n "$cluster" ]; then
    # shellcheck disable=SC2086
    pg_ctlcluster --skip-systemctl-redirect $cluster start || true
  fi
  for _ in $(seq 1 30); do pg_isready -h 127.0.0.1 -p "$outbox_pg_port" -q && break; sleep 1; done
fi
pg_isready -h 127.0.0.1 -p "$outbox_pg_port" -q || { echo "test: PostgreSQL does not answer on 127.0.0.1:$outbox_pg_port (set DATABASE_URL)" >&2; exit 1; }

if [ "$DATABASE_URL" = "postgres://root@127.0.0.1:$outbox_pg_port/test" ] && ! psql "$DATABASE_URL" -qAtc 'SELECT 1' >/dev/null 2>&1; then
  echo "test: preparing the local cluster for $DATABASE_URL (role root, database test, trust for root on 127.0.0.1)"
  as_postgres() { if [ "$(id -u)" = 0 ]; then runuser -u postgres -- "$@"; else sudo -n -u postgres "$@"; fi; }
  pg_local() { as_postgres psql -p "$outbox_pg_port" -qAtX "$@"; }
  pg_local -c "SELECT 1 FROM pg_roles WHERE rolname = 'root'" | grep -q 1 || pg_local -c "CREATE ROLE root SUPERUSER LOGIN"
  pg_local -c "SELECT 1 FROM pg_database WHERE datname = 'test'" | grep -q 1 || pg_local -c "CREATE DATABASE test OWNER root"
  if ! psql "$DATABASE_URL" -qAtc 'SELECT 1' >/dev/null 2>&1; then
    hba="$(pg_local -c 'SHOW hba_file')"
    if ! grep -q '^host all root 127.0.0.1/32 trust' "$hba"; then
      as_postgres sh -c "{ echo 'host all root 127.0.0.1/32 trust  # added by the outbox scripts/test'; cat '$hba'; } > '$hba.outbox' && cat '$hba.outbox' > '$hba' && rm '$hba.outbox'"
    fi
    pg_local -c "SELECT pg_reload_conf()" >/dev/null
    sleep 1
  fi
  psql "$DATABASE_URL" -qAtc 'SELECT 1' >/dev/null || { echo "test: cannot connect to $DATABASE_URL after preparing the cluster" >&2; exit 1; }
fi
unset -f outbox_pg_cluster
