#!/bin/sh
# Print the Secrets with kvpush's NATS passwords, new random ones, for every user in
# nats/users.conf, and new development TLS certificates for NATS:
#
#   deploy/k8s/make-secrets.sh | kubectl apply -f -
#
#   kvpush-nats-server     NATS_PASSWORD_<NAME> for every user: the NATS servers' environment
#                          (users.conf says `password: $NATS_PASSWORD_PREFILL_0`, ...)
#   kvpush-nats-scheduler  key scheduler-0, ...: mounted into the scheduler pods
#   kvpush-nats-prefill    key prefill-0, ...:   mounted into the prefill pods
#   kvpush-nats-decode     key decode-0, ...:    mounted into the decode pods
#   kvpush-nats-client     key gateway, ...:     the gateway's KVPUSH_NATS_PASSWORD
#   kvpush-nats-server-tls   tls.crt, tls.key, ca.crt: the NATS servers' certificate (for nats,
#                            nats-0.nats, ... in NAMESPACE) and the CA their clients must present
#   kvpush-nats-client-tls   tls.crt, tls.key, ca.crt: the client certificate of every kvpush pod
#
# The passwords come from `kvpush nats-config --passwords random` (shared/permissions.py),
# with a letter in front (below), for the same identities as users.conf; the script first checks that `kvpush nats-config`
# still writes exactly users.conf for them (else: regenerate it, README.md). Running it
# again rotates every password: then restart NATS and every kvpush workload (README.md).
# The certificates come from tools/dev_certs.py (a throw-away CA whose key is not kept): for
# production, apply Secrets of the same names and keys from your own CA (cert-manager's
# Certificate writes exactly these keys) and leave these two out.
# Needs `kvpush` (or KVPUSH=...), python3 (or PYTHON=...) and awk. NAMESPACE (default kvpush)
# sets the namespace.
set -eu

here=$(cd "$(dirname "$0")" && pwd)
kvpush=${KVPUSH:-kvpush}
namespace=${NAMESPACE:-kvpush}
users_conf="$here/nats/users.conf"
python=${PYTHON:-python3}
# What README.md's command gives `kvpush nats-config` besides the identities: every address
# of the pod, and the certificate files where nats/statefulset.yaml mounts them.
server_flags="--listen 0.0.0.0 --tls-dir /etc/nats-tls"
tmp=$(mktemp -d)
trap 'rm -rf "$tmp"' EXIT

# Each user in users.conf is written as `# <role>` then `user: "<name>"`.
names() {
    awk -v role="$1" '
        $1 == "#" && NF == 2 { current = $2 }
        $1 == "user:" { gsub(/"/, "", $2); if (current == role) { printf "%s%s", sep, $2; sep = "," } }
    ' "$users_conf"
}
roles="--schedulers=$(names scheduler) --prefill=$(names prefill) --decode=$(names decode) --clients=$(names client)"

# shellcheck disable=SC2086  # $roles is split into flags on purpose (names have no spaces)
$kvpush nats-config $roles $server_flags > "$tmp/users.conf" 2>/dev/null
if ! cmp -s "$tmp/users.conf" "$users_conf"; then
    echo "make-secrets.sh: $users_conf is not what \`kvpush nats-config $roles $server_flags\` writes; regenerate it (README.md)" >&2
    exit 1
fi
# shellcheck disable=SC2086
$kvpush nats-config $roles --passwords random --passwords-out "$tmp/passwords.raw" > /dev/null 2>&1
# nats-server parses a $VARIABLE's value as a config token, so a password that starts with
# "-" or with digits and a "-" ("-x9..", "12-a..") is read as a broken number or date and
# the server does not start (about 1 in 50 of these passwords). One letter in front makes
# every one a plain string.
sed 's/=/=k/' "$tmp/passwords.raw" > "$tmp/passwords"

# Passwords are URL-safe base64 (letters, digits, - and _): safe inside YAML double quotes.
secret() {  # secret NAME ROLE-PATTERN KEY-STYLE: the Secret NAME with the NAME=PASSWORD lines matching
    printf -- '---\napiVersion: v1\nkind: Secret\nmetadata:\n  name: %s\n  namespace: %s\n' "$1" "$namespace"
    printf '  labels:\n    app.kubernetes.io/part-of: kvpush\ntype: Opaque\nstringData:\n'
    awk -F= -v pattern="$2" -v style="$3" '
        $1 ~ pattern {
            key = $1
            if (style == "variable") { key = toupper(key); gsub(/-/, "_", key); key = "NATS_PASSWORD_" key }
            printf "  %s: \"%s\"\n", key, substr($0, length($1) + 2)
        }
    ' "$tmp/passwords"
}

pattern() { printf '^(%s)$' "$(names "$1" | tr , '|')"; }

secret kvpush-nats-server '.' variable
secret kvpush-nats-scheduler "$(pattern scheduler)" name
secret kvpush-nats-prefill "$(pattern prefill)" name
secret kvpush-nats-decode "$(pattern decode)" name
secret kvpush-nats-client "$(pattern client)" name

# The servers are reached as nats-0.nats, ... (the routes in nats.conf, and kvpush's
# KVPUSH_NATS_URL), nats-0.nats.<namespace>.svc, ... and the Service as nats. Each member
# is named: a wildcard over one label (*.nats) is no match for OpenSSL, so for Python.
members=$(sed -n 's|.*"nats://\([^:"]*\):6222".*|\1|p' "$here/nats/nats.conf" | paste -sd, -)
names="nats,$members,nats.$namespace.svc,*.nats.$namespace.svc,*.nats.$namespace.svc.cluster.local"
(cd "$here/../.." && "$python" -m kvpush.tools.dev_certs "$tmp/certs" --server-names "$names" > /dev/null)

tls_secret() {  # tls_secret NAME STEM: a kubernetes.io/tls Secret with STEM.pem, STEM-key.pem and the CA
    printf -- '---\napiVersion: v1\nkind: Secret\nmetadata:\n  name: %s\n  namespace: %s\n' "$1" "$namespace"
    printf '  labels:\n    app.kubernetes.io/part-of: kvpush\ntype: kubernetes.io/tls\ndata:\n'
    for pair in "tls.crt:$2.pem" "tls.key:$2-key.pem" "ca.crt:ca.pem"; do
        printf '  %s: %s\n' "${pair%%:*}" "$(base64 < "$tmp/certs/${pair#*:}" | tr -d '\n')"
    done
}

tls_secret kvpush-nats-server-tls server
tls_secret kvpush-nats-client-tls client
