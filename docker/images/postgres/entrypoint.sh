#!/bin/bash
# The official postgres image's interface, on Debian's packages: on an empty $PGDATA, create the
# cluster with POSTGRES_USER (default postgres) and POSTGRES_PASSWORD (required unless
# POSTGRES_HOST_AUTH_METHOD=trust) and the database POSTGRES_DB (default: the user's name); then
# run the command, `postgres [-c name=value...]`, in the foreground.
set -euo pipefail

user=${POSTGRES_USER:-postgres}
db=${POSTGRES_DB:-$user}
auth=${POSTGRES_HOST_AUTH_METHOD:-scram-sha-256}

if [ "${1:-}" = postgres ] && [ ! -s "$PGDATA/PG_VERSION" ]; then
  if [ -z "${POSTGRES_PASSWORD:-}" ] && [ "$auth" != trust ]; then
    echo "entrypoint: POSTGRES_PASSWORD is not set (or set POSTGRES_HOST_AUTH_METHOD=trust)" >&2
    exit 1
  fi
  pwfile=$(mktemp)
  printf '%s\n' "${POSTGRES_PASSWORD:-}" > "$pwfile"
  initdb --username="$user" --pwfile="$pwfile" --auth-local=trust --auth-host="$auth" \
    --encoding=UTF8 --no-instructions -D "$PGDATA"
  rm -f "$pwfile"
  # Any address may connect with the password (the server listens where listen_addresses says).
  printf 'host all all all %s\n' "$auth" >> "$PGDATA/pg_hba.conf"
  if [ "$db" != postgres ]; then
    echo "CREATE DATABASE \"$db\";" | postgres --single -D "$PGDATA" -j postgres > /dev/null
  fi
  echo "entrypoint: initialised $PGDATA (user $user, database $db)"
fi
exec "$@"
