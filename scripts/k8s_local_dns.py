"""Cluster DNS for scripts/k8s-local.sh: the API's Services and Endpoints as a hosts file dnsmasq serves.

What CoreDNS's kubernetes plugin answers, for the names the emitted manifests use: ``<service>.<namespace>
.svc.<domain>`` (its cluster IP, or its endpoints' addresses when headless) and ``<hostname>.<service>.
<namespace>.svc.<domain>`` (a StatefulSet pod's own address). dnsmasq (``--hostsdir``) reloads the file
when it changes. Usage: ``python scripts/k8s_local_dns.py KUBECTL KUBECONFIG HOSTS_FILE DOMAIN`` (runs until
killed).
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
import time


def records(services: list[dict], endpoints: list[dict], domain: str) -> list[tuple[str, str]]:
    """(address, name) pairs for every Service and every named endpoint address (pure)."""
    out = []
    by_key = {(e["metadata"]["namespace"], e["metadata"]["name"]): e for e in endpoints}
    for svc in services:
        ns, name = svc["metadata"]["namespace"], svc["metadata"]["name"]
        fqdn = f"{name}.{ns}.svc.{domain}"
        cluster_ip = svc["spec"].get("clusterIP")
        addresses = [a for subset in by_key.get((ns, name), {}).get("subsets") or []
                     for a in (subset.get("addresses") or []) + (subset.get("notReadyAddresses") or [])]
        if cluster_ip and cluster_ip != "None":
            out.append((cluster_ip, fqdn))
        else:
            out += [(a["ip"], fqdn) for a in addresses]
        out += [(a["ip"], f"{a['hostname']}.{fqdn}") for a in addresses if a.get("hostname")]
    return sorted(set(out))


def main() -> None:
    kubectl, kubeconfig, hosts_file, domain = sys.argv[1:5]
    last = None
    while True:
        try:
            got = json.loads(subprocess.run([kubectl, "--kubeconfig", kubeconfig, "get", "services,endpoints", "-A", "-o", "json"],
                                            capture_output=True, text=True, timeout=10, check=True).stdout)
        except (subprocess.SubprocessError, json.JSONDecodeError):
            time.sleep(1)
            continue
        items = got.get("items", [])
        text = "".join(f"{ip} {name}\n" for ip, name in records(
            [i for i in items if i["kind"] == "Service"], [i for i in items if i["kind"] == "Endpoints"], domain))
        if text != last:
            # written beside the watched directory, then moved in: dnsmasq never reads half a file
            tmp = os.path.join(os.path.dirname(os.path.dirname(hosts_file)), os.path.basename(hosts_file) + ".tmp")
            with open(tmp, "w") as f:
                f.write(text)
            os.replace(tmp, hosts_file)
            last = text
        time.sleep(1)


if __name__ == "__main__":
    main()
