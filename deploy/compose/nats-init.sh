#!/bin/sh
# compose.yaml's one-shot service `nats-init` (kvpush's image, before NATS starts): a
# development CA with a server and a client certificate (tools/dev_certs.py), one random
# password per identity, and the nats-server config `kvpush nats-config` writes for them,
# each into the volume of whoever needs it:
#
#   $OUT/nats         nats-server.conf and certs/ (server.pem, server-key.pem, ca.pem):
#                     mounted into nats at /etc/kvpush-nats
#   $OUT/<identity>   user, password, ca.pem, client.pem, client-key.pem: mounted into that
#                     service alone at /run/kvpush/nats (client-0's into nobody: it is yours,
#                     `docker compose cp nats-init:/out/client-0 .`)
#
# Idempotent: once the config is there it changes nothing, so another `docker compose up`
# keeps every password; `docker compose down --volumes` discards them all, and the next
# `up` makes new ones. OUT (default /out) is where the volumes are mounted.
set -eu
out=${OUT:-/out}
if [ -s "$out/nats/nats-server.conf" ]; then
    echo "nats-init: $out/nats/nats-server.conf exists: keeping its users and certificates"
    exit 0
fi
tmp=$(mktemp -d)
trap 'rm -rf "$tmp"' EXIT

# The server is reached as nats inside the compose network, and as 127.0.0.1 from the host.
python -m kvpush.tools.dev_certs "$tmp/certs" --server-names nats > /dev/null
kvpush nats-config --schedulers scheduler-0 --prefill prefill-0 --decode decode-0 --clients gateway,client-0 \
    --listen 0.0.0.0 --tls-dir /etc/kvpush-nats/certs --passwords random --passwords-out "$tmp/passwords" \
    --out "$tmp/nats-server.conf" 2> "$tmp/nats-config.log" || { cat "$tmp/nats-config.log" >&2; exit 1; }

while IFS='=' read -r name password; do
    dir="$out/$name"
    if [ ! -d "$dir" ]; then
        echo "nats-init: no volume at $dir for the NATS user $name (compose.yaml mounts one per identity)" >&2
        exit 1
    fi
    printf '%s' "$name" > "$dir/user"
    printf '%s' "$password" > "$dir/password"
    cp "$tmp/certs/ca.pem" "$tmp/certs/client.pem" "$tmp/certs/client-key.pem" "$dir/"
    chmod 0400 "$dir/password" "$dir/client-key.pem"
done < "$tmp/passwords"

mkdir -p "$out/nats/certs"
cp "$tmp/certs/ca.pem" "$tmp/certs/server.pem" "$tmp/certs/server-key.pem" "$out/nats/certs/"
chmod 0400 "$out/nats/certs/server-key.pem"
# Last, and whole: its presence says everything above is in place.
cp "$tmp/nats-server.conf" "$out/nats/nats-server.conf.part"
mv "$out/nats/nats-server.conf.part" "$out/nats/nats-server.conf"
echo "nats-init: NATS users $(cut -d= -f1 "$tmp/passwords" | paste -sd' ' -), with mutual TLS"
