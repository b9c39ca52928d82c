"""Where the processes of a rank container may connect to: the server and the job's peers only.

A rank container shares the host's network (peers on other machines must reach its rendezvous
and collective ports, which gloo and NCCL pick as they go), so Docker's own network options
cannot fence it. Its processes run as a uid of their own per slot, though, and netfilter's
``owner`` match sees the uid of the socket a packet leaves from: one iptables chain per agent,
hooked into OUTPUT, sends each slot's uid to a chain of its own, which accepts the replies of
connections made to the rank (so its listeners work), the job's allowed destinations (each an
address and a TCP port or range of ports, never every port of an address), and rejects the rest
at once (a refused connection, not a hang). Between jobs a slot's chain rejects everything. IPv6 gets the same chains from ip6tables. Each change is one
``iptables-restore --noflush`` per family: atomic, and a few milliseconds.

This needs root (CAP_NET_ADMIN) and the iptables commands; without them ``Egress.available``
is False and the isolation says "egress NOT filtered". The chains of an agent that died stay
until an agent of the same work dir starts again (they fence uids no one else uses).
"""
from __future__ import annotations

import ipaddress
import logging
import os
import shutil
import subprocess
import threading

log = logging.getLogger("gpu_client.sandbox.egress")

#: (address, TCP port or (first, last) range of ports) a rank may connect to.
Destination = tuple[str, "int | tuple[int, int]"]
FAMILIES = {"iptables": 4, "ip6tables": 6}


class Egress:
    """The chains of one agent: ``ZWDX-<tag>`` and ``ZWDX-<tag>-<uid>`` per slot's uid."""

    def __init__(self, tag: str):
        self.chain = f"ZWDX-{tag[:8]}"
        self.tools = [t for t in FAMILIES if shutil.which(t) and shutil.which(f"{t}-restore")]
        self.available = os.geteuid() == 0 and "iptables" in self.tools and self._works()
        self.uids: set[int] = set()
        self._lock = threading.Lock()  # one change of the tables at a time (the agent's threads)

    def _works(self) -> bool:
        try:
            return subprocess.run(["iptables", "-w", "-S", "OUTPUT"], capture_output=True).returncode == 0
        except OSError:
            return False

    def _apply(self, lines: dict[str, list[str]]) -> None:
        """Each tool's rules in one transaction (a chain declared is created, or emptied)."""
        for tool, rules in lines.items():
            text = "*filter\n" + "".join(f"{r}\n" for r in rules) + "COMMIT\n"
            done = subprocess.run([f"{tool}-restore", "-w", "--noflush"], input=text, capture_output=True, text=True)
            if done.returncode != 0:
                raise RuntimeError(f"{tool}-restore: {done.stderr.strip()} (rules: {rules})")

    def install(self) -> None:
        """The agent's chain, empty, hooked first into OUTPUT (an earlier run's removed first)."""
        with self._lock:
            self._remove()
            self._apply({t: [f":{self.chain} - [0:0]", f"-I OUTPUT 1 -j {self.chain}"] for t in self.tools})

    def fence(self, uid: int) -> None:
        """``uid`` may connect nowhere (a standby, or a slot between jobs)."""
        self.allow(uid, [])

    def allow(self, uid: int, destinations: list[Destination]) -> None:
        """``uid`` may connect to ``destinations`` (and answer what connects to it), nowhere else."""
        sub = f"{self.chain}-{uid}"
        with self._lock:
            lines = {}
            for tool in self.tools:
                rules = [f":{sub} - [0:0]", f"-A {sub} -m conntrack --ctstate ESTABLISHED,RELATED -j ACCEPT"]
                for addr, port in destinations:
                    if ipaddress.ip_address(addr).version == FAMILIES[tool]:
                        ports = f"{port[0]}:{port[1]}" if isinstance(port, tuple) else int(port)
                        rules.append(f"-A {sub} -d {addr} -p tcp --dport {ports} -j ACCEPT")
                rules += [f"-A {sub} -p tcp -j REJECT --reject-with tcp-reset", f"-A {sub} -j REJECT"]
                if uid not in self.uids:
                    rules.append(f"-A {self.chain} -m owner --uid-owner {uid} -j {sub}")
                lines[tool] = rules
            self._apply(lines)
            self.uids.add(uid)

    def remove(self) -> None:
        """Unhook and delete the agent's chains (nothing of it left in the tables)."""
        with self._lock:
            self._remove()

    def _remove(self) -> None:
        for tool in self.tools:
            while subprocess.run([tool, "-w", "-D", "OUTPUT", "-j", self.chain], capture_output=True).returncode == 0:
                pass
            listed = subprocess.run([tool, "-w", "-S"], capture_output=True, text=True).stdout.split("\n")
            mine = [line.split()[1] for line in listed if line.startswith(f"-N {self.chain}")]
            for verb in ("-F", "-X"):
                for chain in mine:
                    subprocess.run([tool, "-w", verb, chain], capture_output=True)
        self.uids.clear()
