#!/usr/bin/env bash
# The SSH side of cluster/local.yaml: two "nodes" on this machine, 127.0.0.2 (head) and 127.0.0.3
# (worker), reached by Ray's launcher over SSH on loopback.
#
#   bash cluster/loopback_ssh.sh up     # sshd on 127.0.0.2/127.0.0.3:$PORT, a throwaway key, ~/.ssh/config
#   bash cluster/loopback_ssh.sh down   # stops it and restores everything `up` changed
#
# `up` starts a private sshd (its own config, host key, authorized key and pid file under $STATE; it
# accepts only that key, for this user, on those two addresses), prepends a `Host` entry with the port
# and key to ~/.ssh/config, and adds a guarded line to ~/.bashrc that puts the nodes' venv
# (~/pdserve/.venv, made by local.yaml's setup_commands) on the PATH of the shells this sshd starts,
# and only those (sshd sets PDSERVE_LOOPBACK_NODE=1); the caller's PIP_* and proxy variables pass
# through to those shells. It records what existed before.
# `down` stops that sshd and its sessions, closes Ray's SSH multiplexing sockets for the cluster, and
# removes what `up` added plus what the two nodes left in this home directory and in /tmp/ray (the
# project copy ~/pdserve, Ray's ~/ray_bootstrap_*, a Ray auth token the cluster created, the local
# provider's /tmp/ray/cluster-pdserve-local.*, `ray up`'s /tmp/ray-config-* cache of this cluster's
# config), each only if it did not exist before `up`.
# Needs sshd, ssh-keygen and rsync (scripts/setup.sh installs openssh-server and rsync when missing).
set -euo pipefail

STATE=/tmp/pdserve-loopback-ssh       # cluster/local.yaml names $STATE/id_ed25519 as its ssh_private_key
PORT=${PDSERVE_LOOPBACK_SSH_PORT:-22022}
ADDRS=(127.0.0.2 127.0.0.3)
CLUSTER=pdserve-local                 # cluster_name in cluster/local.yaml
# The launcher's pip and proxy settings reach the nodes' shells (setup_commands install from there).
PASS_ENV="PIP_* http_proxy https_proxy no_proxy HTTP_PROXY HTTPS_PROXY NO_PROXY"
BEGIN="# >>> pdserve loopback nodes (cluster/loopback_ssh.sh) >>>"
END="# <<< pdserve loopback nodes <<<"
# What the nodes leave behind; removed by `down` when absent before `up`.
NODE_LEFTOVERS=(
  "$HOME/pdserve" "$HOME/ray_bootstrap_key.pem" "$HOME/ray_bootstrap_config.yaml" "$HOME/.ray/auth_token"
  "$HOME/.ray" "/tmp/ray/cluster-$CLUSTER.lock" "/tmp/ray/cluster-$CLUSTER.state"
)

log() { echo "loopback_ssh: $*" >&2; }
die() { log "error: $*"; exit 1; }

# Remove the block between BEGIN and END from $1; restore the saved original when nothing else changed.
strip_block() {
  local file=$1 saved=$2
  [ -f "$file" ] || return 0
  local stripped
  stripped=$(mktemp)
  awk -v b="$BEGIN" -v e="$END" '$0==b{skip=1; next} $0==e{skip=0; next} !skip' "$file" >"$stripped"
  if [ -f "$saved" ] && cmp -s "$stripped" "$saved"; then
    cp -p "$saved" "$file"
  else
    cat "$stripped" >"$file"
  fi
  rm -f "$stripped"
}

sshd_running() { [ -f "$STATE/sshd.pid" ] && kill -0 "$(cat "$STATE/sshd.pid")" 2>/dev/null; }

up() {
  [ -e "$STATE" ] && die "$STATE exists: already up (run '$0 down' first)"
  local sshd bin
  sshd=$(command -v sshd || echo /usr/sbin/sshd)
  for bin in "$sshd" ssh ssh-keygen rsync; do
    command -v "$bin" >/dev/null || die "$bin not found: run scripts/setup.sh (installs openssh-server, rsync)"
  done
  if [ -e "$HOME/pdserve" ]; then
    die "$HOME/pdserve exists: the loopback nodes put their copy of the project there; move it away first"
  fi
  local addr
  for addr in "${ADDRS[@]}"; do
    if (exec 3<>"/dev/tcp/$addr/$PORT") 2>/dev/null; then
      die "$addr:$PORT is in use (set PDSERVE_LOOPBACK_SSH_PORT)"
    fi
  done

  mkdir -m 700 "$STATE"
  : >"$STATE/existed"
  local path
  for path in "${NODE_LEFTOVERS[@]}" "$HOME/.ssh" "$HOME/.ssh/config" "$HOME/.bashrc" /run/sshd /tmp/ray-config-*; do
    if [ -e "$path" ]; then echo "$path" >>"$STATE/existed"; fi
  done
  if [ -f "$HOME/.ssh/config" ]; then cp -p "$HOME/.ssh/config" "$STATE/ssh_config.orig"; fi
  if [ -f "$HOME/.bashrc" ]; then cp -p "$HOME/.bashrc" "$STATE/bashrc.orig"; fi

  ssh-keygen -q -t ed25519 -N "" -C pdserve-loopback-host -f "$STATE/host_ed25519"
  ssh-keygen -q -t ed25519 -N "" -C pdserve-loopback -f "$STATE/id_ed25519"
  echo "from=\"127.0.0.0/8\" $(cat "$STATE/id_ed25519.pub")" >"$STATE/authorized_keys"
  {
    for addr in "${ADDRS[@]}"; do echo "ListenAddress $addr:$PORT"; done
    cat <<EOF
HostKey $STATE/host_ed25519
AuthorizedKeysFile $STATE/authorized_keys
PidFile $STATE/sshd.pid
AllowUsers $(id -un)
PermitRootLogin prohibit-password
PubkeyAuthentication yes
PasswordAuthentication no
KbdInteractiveAuthentication no
UsePAM no
StrictModes no
X11Forwarding no
PrintMotd no
MaxStartups 64:30:128
MaxSessions 64
SetEnv PDSERVE_LOOPBACK_NODE=1
AcceptEnv $PASS_ENV
Subsystem sftp internal-sftp
EOF
  } >"$STATE/sshd_config"
  mkdir -p /run/sshd 2>/dev/null || true
  "$sshd" -f "$STATE/sshd_config" -E "$STATE/sshd.log" || die "sshd did not start: $(tail -3 "$STATE/sshd.log")"

  mkdir -p -m 700 "$HOME/.ssh"
  local entry
  entry=$(mktemp)
  cat >"$entry" <<EOF
$BEGIN
Host ${ADDRS[*]}
    Port $PORT
    IdentityFile $STATE/id_ed25519
    IdentitiesOnly yes
    StrictHostKeyChecking no
    UserKnownHostsFile /dev/null
    LogLevel ERROR
    SendEnv $PASS_ENV
$END
EOF
  if [ -f "$HOME/.ssh/config" ]; then cat "$HOME/.ssh/config" >>"$entry"; fi  # first match wins: go first
  cat "$entry" >"$HOME/.ssh/config"
  chmod 600 "$HOME/.ssh/config"
  rm -f "$entry"
  cat >>"$HOME/.bashrc" <<EOF
$BEGIN
if [ -n "\${PDSERVE_LOOPBACK_NODE:-}" ] && [ -f ~/pdserve/.venv/bin/activate ]; then . ~/pdserve/.venv/bin/activate; fi
$END
EOF

  for addr in "${ADDRS[@]}"; do
    local tries=0
    until ssh -o BatchMode=yes -o ConnectTimeout=5 "$(id -un)@$addr" true 2>/dev/null; do
      tries=$((tries + 1))
      [ "$tries" -lt 20 ] || { down; die "ssh to $addr:$PORT fails (sshd log: $STATE/sshd.log, removed)"; }
      sleep 0.25
    done
  done
  log "up: sshd (pid $(cat "$STATE/sshd.pid")) on ${ADDRS[*]} port $PORT, key $STATE/id_ed25519"
}

down() {
  if [ ! -d "$STATE" ]; then
    log "down: not up (no $STATE)"
    return 0
  fi
  local pid child
  if sshd_running; then
    pid=$(cat "$STATE/sshd.pid")
    for child in $(ps -o pid= --ppid "$pid" 2>/dev/null); do kill "$child" 2>/dev/null || true; done
    kill "$pid" 2>/dev/null || true
    for _ in $(seq 50); do kill -0 "$pid" 2>/dev/null || break; sleep 0.1; done
  fi
  # Ray's launcher multiplexes SSH through control sockets that linger; close ours and their folder.
  local user_hash cluster_hash control sock
  user_hash=$(printf %s "$(id -un)" | sha256sum | cut -c1-10)
  cluster_hash=$(printf %s "$CLUSTER" | sha256sum | cut -c1-10)
  control=/tmp/ray_ssh_$user_hash/$cluster_hash
  if [ -d "$control" ]; then
    for sock in "$control"/*; do
      [ -S "$sock" ] && ssh -o ControlPath="$sock" -O exit placeholder >/dev/null 2>&1 || true
    done
    rm -rf "$control"
    rmdir "/tmp/ray_ssh_$user_hash" 2>/dev/null || true
  fi

  strip_block "$HOME/.ssh/config" "$STATE/ssh_config.orig"
  strip_block "$HOME/.bashrc" "$STATE/bashrc.orig"
  local path
  if ! grep -qxF "$HOME/.ssh/config" "$STATE/existed" && [ ! -s "$HOME/.ssh/config" ]; then
    rm -f "$HOME/.ssh/config"
  fi
  if ! grep -qxF "$HOME/.ssh" "$STATE/existed"; then rmdir "$HOME/.ssh" 2>/dev/null || true; fi
  if ! grep -qxF "$HOME/.bashrc" "$STATE/existed" && [ ! -s "$HOME/.bashrc" ]; then rm -f "$HOME/.bashrc"; fi
  for path in "${NODE_LEFTOVERS[@]}"; do
    if [ -e "$path" ] && ! grep -qxF "$path" "$STATE/existed"; then
      if [ "$path" = "$HOME/.ray" ]; then rmdir "$path" 2>/dev/null || true; else rm -rf "$path"; fi
    fi
  done
  if ! grep -qxF /run/sshd "$STATE/existed"; then rmdir /run/sshd 2>/dev/null || true; fi
  local cache  # `ray up` caches the resolved config as /tmp/ray-config-<hash>
  for cache in /tmp/ray-config-*; do
    if [ -f "$cache" ] && ! grep -qxF "$cache" "$STATE/existed" && grep -qF "\"cluster_name\": \"$CLUSTER\"" "$cache"; then
      rm -f "$cache"
    fi
  done
  rm -rf "$STATE"
  log "down: sshd stopped; ~/.ssh/config, ~/.bashrc and the nodes' files restored"
}

case "${1:-}" in
  up) up ;;
  down) down ;;
  *) echo "usage: $0 up|down" >&2; exit 2 ;;
esac
