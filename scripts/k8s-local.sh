#!/usr/bin/env bash
# A real, one-node Kubernetes control plane on this machine, from Debian's packages only (issue #60, item 2):
# nothing current can be installed from the registries this project reaches, but Debian bookworm's
# `kubernetes` source package (1.20.2, full vendor tree) builds with Debian's Go into every binary a
# cluster needs, and Debian carries etcd, containerd, the CNI plugins and dnsmasq.
#
#   scripts/k8s-local.sh build        apt packages, the source, the binaries (cached: $K8S_CACHE/bin)
#   scripts/k8s-local.sh up           etcd, kube-apiserver, -controller-manager, -scheduler, containerd, kubelet,
#                                     kube-proxy, cluster DNS (dnsmasq fed from the API); waits for node0 Ready
#   scripts/k8s-local.sh load IMG...  podman's images into containerd's k8s.io namespace
#   scripts/k8s-local.sh down         stops what `up` started
#   scripts/k8s-local.sh env          the line to eval for kubectl
#
# Root only (containerd, iptables, addresses). Everything lives under $K8S_STATE (default /tmp/prfaas-k8s): etcd's
# data, the logs (one per process), the pid files. The API server listens on 127.0.0.1:6443 with a self-signed
# certificate and one admin token, and allows whatever that token asks: the cluster exists to check what
# `launch --emit k8s` writes against a real API server and real controllers, on one machine; it is not a
# cluster to share.
set -euo pipefail

VERSION=1.20.2
K8S_CACHE=${K8S_CACHE:-$HOME/.cache/prfaas-sglang/k8s-$VERSION}
K8S_STATE=${K8S_STATE:-/tmp/prfaas-k8s}
BIN=$K8S_CACHE/bin
PAUSE_IMAGE=localhost/pause:3.2
SERVICE_CIDR=10.96.0.0/16
POD_CIDR=10.88.0.0/16
DNS_IP=169.254.20.10  # on the loopback device: dnsmasq listens there, pods reach it through the bridge
CLUSTER_DOMAIN=cluster.local
COMPONENTS=(kube-apiserver kube-controller-manager kube-scheduler kubelet kube-proxy kubectl)
HERE=$(cd "$(dirname "$0")" && pwd)

log() { printf '[k8s-local] %s\n' "$*" >&2; }
CTR() { ctr --address "$K8S_STATE/run/containerd.sock" -n k8s.io "$@"; }
KUBECTL() { "$BIN/kubectl" --kubeconfig "$K8S_STATE/kubeconfig" "$@"; }

build() {
  if [ -x "$BIN/kube-proxy" ] && [ -x "$BIN/pause" ]; then log "cached: $BIN"; return; fi
  log "apt: the source package, Go, etcd, containerd, the CNI plugins, dnsmasq"
  if [ ! -f /etc/apt/sources.list.d/prfaas-k8s-src.sources ]; then
    printf '%s\n' "Types: deb-src" "URIs: http://deb.debian.org/debian" "Suites: bookworm" "Components: main" \
      "Signed-By: /usr/share/keyrings/debian-archive-keyring.gpg" > /etc/apt/sources.list.d/prfaas-k8s-src.sources
  fi
  apt-get update -qq
  DEBIAN_FRONTEND=noninteractive apt-get install -y -qq --no-install-recommends dpkg-dev golang-go etcd-server \
    containerd containernetworking-plugins dnsmasq-base iptables conntrack rsync gcc libc6-dev openssl curl >/dev/null
  local work=$K8S_CACHE/work
  mkdir -p "$work" "$BIN"
  if [ ! -d "$work/src" ]; then
    (cd "$work" && apt-get source -qq --download-only kubernetes && dpkg-source -x --skip-debianization kubernetes_*.dsc src)
  fi
  log "building ${COMPONENTS[*]} (GOPATH mode, as Debian's rules do; about 15 minutes cold on 2 cores)"
  mkdir -p "$work/src/.go/src/k8s.io"
  [ -L "$work/src/.go/src/k8s.io/kubernetes" ] || ln -s ../../.. "$work/src/.go/src/k8s.io/kubernetes"
  rm -rf "$work/src/_output"  # a failed run leaves empty generators behind that make takes as built (Go's cache stays)
  (cd "$work/src" && env GOPATH="$work/src/.go" CGO_ENABLED=0 HOME="$work/home" \
     make WHAT="${COMPONENTS[*]/#/cmd/}" > "$work/build.log" 2>&1) || { tail -30 "$work/build.log" >&2; exit 1; }
  local c
  for c in "${COMPONENTS[@]}"; do cp "$work/src/_output/bin/$c" "$BIN/"; done
  log "the pause container, compiled here (build/pause/linux/pause.c)"
  gcc -Os -static -o "$BIN/pause" "$work/src/build/pause/linux/pause.c"
  log "built: $(ls "$BIN" | tr '\n' ' ')"
}

start() {  # start NAME CMD...: in the background, its log and pid file under $K8S_STATE
  local name=$1
  shift
  "$@" > "$K8S_STATE/logs/$name.log" 2>&1 &
  echo $! > "$K8S_STATE/run/$name.pid"
}

wait_for() {  # wait_for WHAT SECONDS CMD...
  local what=$1 limit=$2
  shift 2
  for _ in $(seq "$limit"); do "$@" >/dev/null 2>&1 && return 0; sleep 1; done
  log "timed out waiting for $what (logs: $K8S_STATE/logs)"
  return 1
}

node_ready() { [ "$(KUBECTL get node node0 -o 'jsonpath={.status.conditions[?(@.type=="Ready")].status}')" = True ]; }

configs() {
  mkdir -p "$K8S_STATE"/{pki,etcd,logs,run,kubelet,containerd,cni/net.d,dns/hosts.d,pause}
  if [ ! -f "$K8S_STATE/pki/sa.key" ]; then
    openssl genrsa -out "$K8S_STATE/pki/sa.key" 2048 2>/dev/null
    openssl rsa -in "$K8S_STATE/pki/sa.key" -pubout -out "$K8S_STATE/pki/sa.pub" 2>/dev/null
  fi
  [ -f "$K8S_STATE/pki/admin-token" ] || head -c 16 /dev/urandom | od -An -tx1 | tr -d ' \n' > "$K8S_STATE/pki/admin-token"
  local token
  token=$(cat "$K8S_STATE/pki/admin-token")
  echo "$token,admin,admin,system:masters" > "$K8S_STATE/pki/tokens.csv"
  printf '%s\n' "apiVersion: v1" "kind: Config" \
    'clusters: [{name: local, cluster: {server: "https://127.0.0.1:6443", insecure-skip-tls-verify: true}}]' \
    "users: [{name: admin, user: {token: $token}}]" "contexts: [{name: local, context: {cluster: local, user: admin}}]" \
    "current-context: local" > "$K8S_STATE/kubeconfig"
  printf '%s\n' '{"cniVersion": "0.4.0", "name": "prfaas", "plugins": [' \
    '  {"type": "bridge", "bridge": "cni0", "isGateway": true, "ipMasq": true, "hairpinMode": true,' \
    "   \"ipam\": {\"type\": \"host-local\", \"ranges\": [[{\"subnet\": \"$POD_CIDR\"}]], \"routes\": [{\"dst\": \"0.0.0.0/0\"}]}}," \
    '  {"type": "portmap", "capabilities": {"portMappings": true}}]}' > "$K8S_STATE/cni/net.d/10-prfaas.conflist"
  printf '%s\n' 'version = 2' "root = \"$K8S_STATE/containerd/root\"" "state = \"$K8S_STATE/containerd/state\"" \
    '[grpc]' "  address = \"$K8S_STATE/run/containerd.sock\"" \
    '[plugins."io.containerd.grpc.v1.cri"]' "  sandbox_image = \"$PAUSE_IMAGE\"" '  restrict_oom_score_adj = true' \
    '  [plugins."io.containerd.grpc.v1.cri".cni]' '    bin_dir = "/usr/lib/cni"' \
    "    conf_dir = \"$K8S_STATE/cni/net.d\"" \
    '  [plugins."io.containerd.grpc.v1.cri".containerd.runtimes.runc]' '    runtime_type = "io.containerd.runc.v2"' \
    > "$K8S_STATE/containerd.toml"
}

load() {  # podman's images into containerd (k8s.io), also under the docker.io name a bare reference means
  local image bare
  for image in "$@"; do
    podman save "$image" | CTR images import - >/dev/null
    if [[ $image == localhost/* ]]; then
      bare=${image#localhost/}
      [[ $bare == */* ]] || bare=library/$bare  # how a one-part name reads: docker.io/library/NAME
      CTR images tag --force "$image" "docker.io/$bare" >/dev/null
    fi
    log "loaded $image"
  done
}

pause_image() {  # the pause binary as an image, imported into containerd
  cp "$BIN/pause" "$K8S_STATE/pause/pause"
  printf '%s\n' 'FROM scratch' 'COPY pause /pause' 'ENTRYPOINT ["/pause"]' > "$K8S_STATE/pause/Containerfile"
  podman build -q -t "$PAUSE_IMAGE" "$K8S_STATE/pause" >/dev/null
  load "$PAUSE_IMAGE"
}

up() {
  build
  configs
  local node_ip
  node_ip=$(ip -4 route get 1.1.1.1 2>/dev/null | awk '{for (i = 1; i < NF; i++) if ($i == "src") print $(i + 1)}')
  node_ip=${node_ip:-127.0.0.1}
  modprobe br_netfilter 2>/dev/null || true
  sysctl -qw net.ipv4.ip_forward=1
  ip addr show dev lo | grep -q "$DNS_IP" || ip addr add "$DNS_IP/32" dev lo
  log "etcd, kube-apiserver"
  start etcd etcd --data-dir "$K8S_STATE/etcd" --listen-client-urls http://127.0.0.1:2379 \
    --advertise-client-urls http://127.0.0.1:2379 --listen-peer-urls http://127.0.0.1:2380
  wait_for etcd 30 curl -sf http://127.0.0.1:2379/health
  start kube-apiserver "$BIN/kube-apiserver" --etcd-servers=http://127.0.0.1:2379 \
    --service-cluster-ip-range="$SERVICE_CIDR" --secure-port=6443 --cert-dir="$K8S_STATE/pki/apiserver" \
    --token-auth-file="$K8S_STATE/pki/tokens.csv" --authorization-mode=AlwaysAllow \
    --service-account-key-file="$K8S_STATE/pki/sa.pub" --service-account-signing-key-file="$K8S_STATE/pki/sa.key" \
    --service-account-issuer="https://kubernetes.default.svc.$CLUSTER_DOMAIN" --allow-privileged=true \
    --advertise-address="$node_ip" --kubelet-preferred-address-types=InternalIP
  wait_for kube-apiserver 90 KUBECTL get --raw /healthz
  start kube-controller-manager "$BIN/kube-controller-manager" --kubeconfig="$K8S_STATE/kubeconfig" --leader-elect=false \
    --service-account-private-key-file="$K8S_STATE/pki/sa.key" --controllers='*,-csrsigning,-nodeipam'
  start kube-scheduler "$BIN/kube-scheduler" --kubeconfig="$K8S_STATE/kubeconfig" --leader-elect=false
  log "containerd, kubelet, kube-proxy, cluster DNS"
  start containerd containerd --config "$K8S_STATE/containerd.toml"
  wait_for containerd 30 CTR version
  pause_image
  start kubelet "$BIN/kubelet" --kubeconfig="$K8S_STATE/kubeconfig" --container-runtime=remote \
    --container-runtime-endpoint="unix://$K8S_STATE/run/containerd.sock" --cgroup-driver=cgroupfs \
    --fail-swap-on=false --cgroups-per-qos=false --enforce-node-allocatable="" --root-dir="$K8S_STATE/kubelet" \
    --pod-infra-container-image="$PAUSE_IMAGE" --cluster-dns="$DNS_IP" --cluster-domain="$CLUSTER_DOMAIN" \
    --hostname-override=node0 --node-ip="$node_ip" --image-gc-high-threshold=100 --image-gc-low-threshold=99 \
    --eviction-hard='nodefs.available<1%,imagefs.available<1%,memory.available<100Mi' \
    --serialize-image-pulls=false
  start kube-proxy "$BIN/kube-proxy" --kubeconfig="$K8S_STATE/kubeconfig" --proxy-mode=iptables \
    --cluster-cidr="$POD_CIDR" --hostname-override=node0 --conntrack-max-per-core=0
  start dns-feed "${PYTHON:-python3}" "$HERE/k8s_local_dns.py" "$BIN/kubectl" "$K8S_STATE/kubeconfig" \
    "$K8S_STATE/dns/hosts.d/records" "$CLUSTER_DOMAIN"
  start dnsmasq dnsmasq --keep-in-foreground --no-resolv --no-hosts --listen-address="$DNS_IP" --bind-interfaces \
    --hostsdir="$K8S_STATE/dns/hosts.d" --local="/$CLUSTER_DOMAIN/" --user=root
  wait_for "node0 Ready" 120 node_ready
  log "node0 Ready; $(print_env)"
}

down() {
  local name
  for name in kube-proxy kubelet dnsmasq dns-feed kube-scheduler kube-controller-manager kube-apiserver etcd; do
    [ -f "$K8S_STATE/run/$name.pid" ] && kill "$(cat "$K8S_STATE/run/$name.pid")" 2>/dev/null || true
  done
  if [ -f "$K8S_STATE/run/containerd.pid" ]; then
    CTR tasks ls -q 2>/dev/null | xargs -r -n1 ctr --address "$K8S_STATE/run/containerd.sock" -n k8s.io tasks kill -s SIGKILL \
      2>/dev/null || true
    kill "$(cat "$K8S_STATE/run/containerd.pid")" 2>/dev/null || true
  fi
  sleep 1
  # the pods' mounts (root filesystems, secrets, /dev/shm), kube-proxy's rules, the CNI bridge
  awk -v state="$K8S_STATE/" 'index($2, state) == 1 {print $2}' /proc/mounts | sort -r | xargs -r -n1 umount -l 2>/dev/null || true
  "$BIN/kube-proxy" --cleanup >/dev/null 2>&1 || true
  ip link del cni0 2>/dev/null || true
  ip addr del "$DNS_IP/32" dev lo 2>/dev/null || true
  log "stopped (state kept in $K8S_STATE)"
}

run_demo() {  # run_demo [TOPOLOGY]: emit, apply, wait Ready, the demo's load through the router's Service, the drill
  local topology=${1:-launch/local-two-cluster.yaml} out=$K8S_STATE/manifests py=${PYTHON:-.venv/bin/python}
  local dir ns url
  rm -rf "$out"
  "$py" -m prfaas_sglang.launch --config "$topology" --emit k8s --engine mock --out "$out" >&2
  [ -f "$K8S_STATE/deployment-secret" ] || head -c 32 /dev/urandom > "$K8S_STATE/deployment-secret"
  for dir in "$out"/*/; do
    [ -f "$dir/kustomization.yaml" ] || continue
    ns=$(awk '/^namespace:/ {print $2}' "$dir/kustomization.yaml")
    KUBECTL get namespace "$ns" >/dev/null 2>&1 || KUBECTL create namespace "$ns" >/dev/null
    KUBECTL -n "$ns" get secret prfaas-deployment >/dev/null 2>&1 || KUBECTL -n "$ns" create secret generic \
      prfaas-deployment --from-file=deployment-secret="$K8S_STATE/deployment-secret" --from-literal=admin-token=local >/dev/null
    # 1.20's kubectl refuses the NetworkPolicies' endPort (1.25+, the manifests say so) and its API server would
    # drop it: applied unvalidated here, where the bridge CNI enforces no NetworkPolicy anyway
    KUBECTL apply --validate=false -k "$dir" >&2
  done
  for dir in "$out"/*/; do
    [ -f "$dir/kustomization.yaml" ] || continue
    ns=$(awk '/^namespace:/ {print $2}' "$dir/kustomization.yaml")
    wait_for "every pod of $ns created" 120 sh -c "'$BIN/kubectl' --kubeconfig '$K8S_STATE/kubeconfig' -n $ns get pods -o name | grep -q ."
    KUBECTL -n "$ns" wait --for=condition=Ready pod --all --timeout=300s >&2
  done
  KUBECTL get pods -A -o wide >&2
  url=http://$(KUBECTL -n control get service router-api -o 'jsonpath={.spec.clusterIP}:{.spec.ports[0].port}')
  log "the demo's load through the router's Service at $url"
  "$py" -m prfaas_sglang.demo --against "$url" --duration "${DEMO_DURATION_S:-30}" --json > "$K8S_STATE/demo.json"
  drill "$url" "$py"
  "$py" - "$K8S_STATE/demo.json" "$K8S_STATE/drill.json" <<'EOF'
import json, sys
keys = ("requests_ok", "requests_rejected", "requests_failed", "errors", "offload_fraction", "ttft_p50_s", "ttft_p90_s")
print(json.dumps({name: {k: json.load(open(path))[k] for k in keys} | json.load(open(path)).get("drill", {})
                  for name, path in zip(("load", "drill"), sys.argv[1:])}, indent=2))
EOF
}

link_up() {  # link_up URL: the router routes to PrfaaS worker prfaas-0 again (its telemetry heard, no link down)
  curl -sf -m 5 "$1/status" | "$2" -c 'import json, sys; d = json.load(sys.stdin)
s = d["subscriptions"].get("link:prfaas-0", {})
sys.exit(0 if s.get("connected") and not d["link_down_workers"] and d["workers"]["prfaas-0"]["healthy"] else 1)'
}

new_pod() {  # new_pod NAMESPACE POD OLD_UID: the pod exists again, another than OLD_UID
  local uid
  uid=$(KUBECTL -n "$1" get pod "$2" -o 'jsonpath={.metadata.uid}' 2>/dev/null) || return 1
  [ -n "$uid" ] && [ "$uid" != "$3" ]
}

drill() {  # drill URL PYTHON: the demo's load for 60 s; 15 s in, the PrfaaS pod deleted; its successor adopted?
  local url=$1 py=$2 load_pid old_uid t0 ready_s linked_s
  "$py" -m prfaas_sglang.demo --against "$url" --duration 60 --seed 1 --json > "$K8S_STATE/drill-load.json" &
  load_pid=$!
  sleep 15
  old_uid=$(KUBECTL -n prfaas-b get pod prfaas-0 -o 'jsonpath={.metadata.uid}')
  t0=$(date +%s.%N)
  KUBECTL -n prfaas-b delete pod prfaas-0 --wait=false >&2
  wait_for "a new prfaas-0" 120 new_pod prfaas-b prfaas-0 "$old_uid"
  KUBECTL -n prfaas-b wait --for=condition=Ready pod/prfaas-0 --timeout=120s >&2
  ready_s=$(awk -v now="$(date +%s.%N)" -v t0="$t0" 'BEGIN {print now - t0}')
  wait_for "the router routing to the new prfaas-0" 300 link_up "$url" "$py"
  linked_s=$(awk -v now="$(date +%s.%N)" -v t0="$t0" 'BEGIN {print now - t0}')
  wait "$load_pid" || true
  "$py" -c 'import json, sys; d = json.load(open(sys.argv[1]))
d["drill"] = {"deleted_at_s": 15, "pod_ready_again_s": float(sys.argv[2]), "router_routes_to_it_again_s": float(sys.argv[3])}
json.dump(d, open(sys.argv[4], "w"))' "$K8S_STATE/drill-load.json" "$ready_s" "$linked_s" "$K8S_STATE/drill.json"
}

print_env() { echo "export KUBECONFIG=$K8S_STATE/kubeconfig PATH=$BIN:\$PATH"; }

command=${1:-build}
shift || true
case $command in
  build|up|load|down) "$command" "$@" ;;
  demo) run_demo "$@" ;;
  env) print_env ;;
  *) echo "usage: $0 build | up | load IMAGE... | demo [TOPOLOGY] | down | env" >&2; exit 2 ;;
esac
