"""Separate hosts on one machine: one Linux network namespace per node, all on one LAN that a test can unplug.

    pytest, the client (root namespace)  10.213.K.100 --+
    vsup-<pid>-n0, the head              10.213.K.1   --+-- bridge br0 in vsup-<pid>-lan, the switch
    vsup-<pid>-n1, another node          10.213.K.2   --+

Each node's namespace has lo up and one veth `eth0`, whose other end is a port of the bridge in a
namespace of its own. A node reaches another only through its port: `unplug(i)` pulls node i's cable
at the switch (its port set down), or with `drop=True` has the switch drop its frames while every link
stays up; every process keeps running (no netem needed). The root namespace is plugged in too, so
pytest reaches the head's API server at the head's LAN address without entering a namespace itself;
nothing is routed further (a new namespace does not forward), and traffic only ever goes to these
addresses.

`vsup serve` runs in node i as `[*lan.exec(i), ...]`: `ip netns exec` execs, it does not fork, so the
process that Popen made is the supervisor itself and its tree stays pytest's (a child subreaper's)
descendants. Unix sockets in the file system and /dev/shm are not per network namespace, so `vsup ps`
from the root namespace and the supervisors' shared-memory sweep work as on one host.

Names carry pytest's pid and K is a /24 of 10.213.0.0/16 that the root namespace does not use yet, so two
sessions never collide; `close()` deletes the root namespace's veth and every namespace (the other veths
and the bridge go with them) and says what it had to kill.
"""

from __future__ import annotations

import os
import re
import signal
import subprocess
import time

PREFIX = "10.213"
CLIENT_HOST = 100  # the root namespace's host number on the LAN


class NetnsError(RuntimeError):
    """A namespace or link could not be made or changed: the message is ip's own."""


def choose_subnet(used: set[int], seed: int) -> int:
    """The third octet of a 10.213.K.0/24 not in `used`, starting at one derived from `seed` (a pid)."""
    for step in range(254):
        k = (seed + step) % 254 + 1
        if k not in used:
            return k
    raise NetnsError(f"every 10.213.K.0/24 is in use in the root namespace: {sorted(used)}")


def used_subnets(ip_output: str) -> set[int]:
    """The K of every 10.213.K.x that `ip -4 addr` or `ip -4 route` output mentions."""
    return {int(k) for k in re.findall(rf"\b{re.escape(PREFIX)}\.(\d+)\.\d+", ip_output)}


def ip(*args: str, tool: str = "ip") -> str:
    """Run `ip ARGS` (or iproute2's `bridge`); NetnsError with its message when it fails (no root, no
    iproute2, ...)."""
    try:
        result = subprocess.run([tool, *args], capture_output=True, text=True, timeout=30)
    except OSError as e:
        raise NetnsError(f"cannot run {tool} ({e})") from None
    if result.returncode:
        raise NetnsError(f"{tool} {' '.join(args)}: {result.stderr.strip() or f'exit {result.returncode}'}")
    return result.stdout


class Lan:
    """`num_nodes` namespaces on one bridge, plus the root namespace. Build with `build()`, always `close()`."""

    def __init__(self, num_nodes: int = 2, tag: str | None = None):
        if num_nodes < 1:
            raise ValueError(f"a LAN needs at least one node, got {num_nodes}")
        self.tag = tag or str(os.getpid())
        self.nodes = [f"vsup-{self.tag}-n{i}" for i in range(num_nodes)]
        self.switch = f"vsup-{self.tag}-lan"
        self.root_link = f"vs{self.tag}"[:15]  # a device name in the root namespace: 15 characters at most
        self.subnet: int | None = None
        self.made: list[str] = []  # namespaces made so far, for close()
        self.unplugged: dict[int, bool] = {}  # node -> whether its frames are dropped (else its port is down)

    def address(self, i: int) -> str:
        """Node i's address on the LAN (node 0 is the head)."""
        return f"{PREFIX}.{self.subnet}.{i + 1}"

    @property
    def client_address(self) -> str:
        return f"{PREFIX}.{self.subnet}.{CLIENT_HOST}"

    def exec(self, i: int) -> list[str]:
        """The argv prefix that runs a command in node i."""
        return ["ip", "netns", "exec", self.nodes[i]]

    def build(self) -> Lan:
        self.subnet = choose_subnet(used_subnets(ip("-4", "addr") + ip("-4", "route")), os.getpid())
        for ns in (self.switch, *self.nodes):
            ip("netns", "add", ns)
            self.made.append(ns)
            ip("-n", ns, "link", "set", "lo", "up")
        ip("-n", self.switch, "link", "add", "br0", "type", "bridge")
        ip("-n", self.switch, "link", "set", "br0", "up")
        for i, ns in enumerate(self.nodes):  # made in place: the names never exist in the root namespace
            self._plug_in(f"n{i}", "eth0", ns)
            ip("-n", ns, "addr", "add", f"{self.address(i)}/24", "dev", "eth0")
            ip("-n", ns, "link", "set", "eth0", "up")
        self._plug_in("client", self.root_link, None)
        ip("addr", "add", f"{self.client_address}/24", "dev", self.root_link)
        ip("link", "set", self.root_link, "up")
        return self

    def _plug_in(self, port: str, device: str, ns: str | None) -> None:
        """A veth from the switch's port `port` to `device` in `ns` (None: the root namespace)."""
        ip("-n", self.switch, "link", "add", port, "type", "veth", "peer", "name", device,
           "netns", ns or str(os.getpid()))  # no ns: pytest's own, the root namespace
        ip("-n", self.switch, "link", "set", port, "master", "br0")
        ip("-n", self.switch, "link", "set", port, "up")

    # faults

    def unplug(self, i: int, drop: bool = False) -> None:
        """Cut node i off the LAN; its processes run on and see no error. By default its port goes down, so
        node i's own link loses its carrier (its kernel notices); with `drop` the switch drops the port's
        frames while every link stays up (a fault further away: no kernel notices, TCP only times out)."""
        if drop:
            ip("-n", self.switch, "link", "set", "dev", f"n{i}", "state", "0", tool="bridge")  # 0: disabled
        else:
            ip("-n", self.switch, "link", "set", f"n{i}", "down")
        self.unplugged[i] = drop

    def plug(self, i: int) -> None:
        """Undo unplug(i)."""
        if self.unplugged.pop(i):
            ip("-n", self.switch, "link", "set", "dev", f"n{i}", "state", "3", tool="bridge")  # 3: forwarding
        else:
            ip("-n", self.switch, "link", "set", f"n{i}", "up")

    def pids(self, i: int) -> list[int]:
        """The live processes in node i's namespace (zombies have left it)."""
        return [int(p) for p in ip("netns", "pids", self.nodes[i]).split()]

    def kill(self, i: int, timeout: float = 10.0) -> list[int]:
        """kill -9 every process in node i, again until none is left (a supervisor may spawn meanwhile);
        the pids it killed."""
        killed, deadline = [], time.monotonic() + timeout
        while pids := self.pids(i):
            if time.monotonic() > deadline:
                raise NetnsError(f"processes in {self.nodes[i]} outlived kill -9: {pids}")
            for pid in pids:
                try:
                    os.kill(pid, signal.SIGKILL)
                    killed.append(pid)
                except ProcessLookupError:
                    pass
            time.sleep(0.05)
        return killed

    # teardown

    def close(self) -> list[int]:
        """Delete every namespace made (their veths and the bridge go with them); first kill -9 what still
        runs in a node, and return those pids, so a caller can fail on them."""
        left, errors = [], []
        for i, ns in enumerate(self.nodes):
            if ns in self.made:
                try:
                    left += self.kill(i)
                except NetnsError as e:
                    errors.append(str(e))
        if self.root_link in self._root_links():  # at once: a deleted namespace's devices go in the background
            try:
                ip("link", "del", self.root_link)
            except NetnsError as e:
                errors.append(str(e))
        for ns in reversed(self.made):
            try:
                ip("netns", "del", ns)
            except NetnsError as e:
                errors.append(str(e))
        self.made = []
        if errors:
            raise NetnsError("; ".join(errors))
        return left

    def leftovers(self) -> list[str]:
        """Namespaces and root devices of this LAN that still exist (none after close())."""
        names = set(ip("netns", "list").split())
        found = [ns for ns in (self.switch, *self.nodes) if ns in names]
        if self.root_link in self._root_links():
            found.append(self.root_link)
        return found

    @staticmethod
    def _root_links() -> set[str]:
        return {line.split()[0].split("@")[0] for line in ip("-br", "link").splitlines() if line.strip()}


def lan_for_a_test(num_nodes: int = 2, tag: str | None = None):
    """A fixture's body: the LAN built (a test fails, saying why, where namespaces cannot be made), yielded,
    then closed, failing on any process left in a node or anything left behind."""
    import pytest

    lan = Lan(num_nodes, tag=tag)
    try:
        lan.build()
    except NetnsError as e:
        reason = str(e)
        try:
            lan.close()
        except NetnsError as again:
            reason += f"; cleaning up: {again}"
        pytest.fail(f"nodes as network namespaces need root and iproute2, and making them failed: {reason}")
    yield lan
    left = lan.close()
    assert not left, f"processes still ran in the nodes' namespaces: {left}"
    assert not lan.leftovers(), f"left behind: {lan.leftovers()}"
