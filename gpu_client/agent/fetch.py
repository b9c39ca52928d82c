"""How the GPU client fetches and unpacks a dataset a job names by URL (``datasets.py``).

The agent fetches as root on the donor's machine, outside any rank's egress rules, so a URL is
the submitter's request made from inside the donor's network. It is held to what the donor
allows (``FetchPolicy``):

- ``http://`` and ``https://`` go through aiohttp with a resolver that keeps only the addresses
  the policy allows, and the connection goes to one of those (no second lookup a name could
  rebind between check and connect); an address written in the URL is checked before the
  request, and so is every redirect's target, each hop anew. Refused unless a network of
  ``--dataset-allow-net`` holds them: private, loopback, link-local, shared (100.64.0.0/10),
  multicast, reserved and unspecified addresses, IPv4 and IPv6 (an IPv4-mapped or NAT64
  address by the IPv4 address it carries). No proxy or netrc from the environment is used.
- ``s3://`` is anonymous (public buckets only) unless the donor lends their own credentials
  (``--dataset-s3-credentials``).
- A tar archive is read twice: first every entry's header (only files and folders, inside the
  entry, at most ``MAX_MEMBERS`` of them, their sizes added up against the cache's bound), and
  only then, with room made for that total, is anything written (``unpack``).
"""
from __future__ import annotations

import ipaddress
import socket
import tarfile
from dataclasses import dataclass, field
from urllib.parse import urlsplit

import aiohttp
from aiohttp.abc import AbstractResolver
from aiohttp.resolver import ThreadedResolver

#: Entries a dataset's tar archive may hold.
MAX_MEMBERS = 1_000_000
_NAT64 = ipaddress.ip_network("64:ff9b::/96")
_SCHEMES = ("http", "https", "s3")

Network = ipaddress.IPv4Network | ipaddress.IPv6Network


class DatasetRefused(Exception):
    """A URL, an address or an archive's entry this GPU client does not fetch or write."""


class DatasetTooLarge(Exception):
    """A dataset this GPU client's cache cannot hold, even alone."""


def parse_nets(text: str | list[str] | None) -> tuple[Network, ...]:
    """``--dataset-allow-net`` values (each a network or address, or several separated by commas),
    or ValueError naming the one that is not."""
    items = [text] if isinstance(text, str) else list(text or [])
    nets = []
    for item in items:
        for part in filter(None, (p.strip() for p in item.split(","))):
            try:
                nets.append(ipaddress.ip_network(part, strict=False))
            except ValueError:
                raise ValueError(f"--dataset-allow-net: {part!r} is not a network (10.0.0.0/8, 127.0.0.1, ::1/128)") \
                    from None
    return tuple(nets)


def _carried(ip: ipaddress.IPv4Address | ipaddress.IPv6Address):
    """The IPv4 address an IPv6 one carries to (mapped, NAT64), else the address itself."""
    if ip.version == 6:
        if ip.ipv4_mapped is not None:
            return ip.ipv4_mapped
        if ip in _NAT64:
            return ipaddress.IPv4Address(int(ip) & 0xFFFFFFFF)
    return ip


@dataclass(frozen=True)
class FetchPolicy:
    """What the donor lets a job's URL reach: ``allow_nets`` (beside the global internet) and
    whether ``s3://`` may use the donor's own credentials."""
    allow_nets: tuple[Network, ...] = ()
    s3_credentials: bool = False

    def refusal(self, addr: str) -> str | None:
        """Why the agent does not connect to ``addr``, or None when it may."""
        try:
            ip = ipaddress.ip_address(addr.split("%", 1)[0])
        except ValueError:
            return f"{addr!r} is not an address"
        if any(ip in net or _carried(ip) in net for net in self.allow_nets):
            return None
        target = _carried(ip)
        if target.is_global and not target.is_multicast:
            return None
        return (f"address {addr} is not a public one (private, loopback, link-local, multicast or reserved): this "
                f"GPU client fetches such addresses only where its donor allows them (zwdx gpu-client "
                f"--dataset-allow-net)")


@dataclass
class Fetcher:
    """One URL's fetch under ``policy``; ``refused`` keeps why a connection was refused (fsspec
    reports a failed request as a FileNotFoundError of the URL)."""
    policy: FetchPolicy
    refused: list[str] = field(default_factory=list)

    def _refuse(self, why: str) -> DatasetRefused:
        self.refused.append(why)
        return DatasetRefused(why)

    def filesystem(self, url: str):
        """(fsspec filesystem, path) for ``url``, built here rather than by fsspec's URL parser
        (which would also follow ``::`` chains to other protocols)."""
        import fsspec
        scheme = urlsplit(url).scheme.lower()
        if scheme not in _SCHEMES:
            raise self._refuse(f"{url}: only {', '.join(_SCHEMES)} URLs are fetched")
        if scheme == "s3":
            return fsspec.filesystem("s3", anon=not self.policy.s3_credentials, skip_instance_cache=True), url[5:]
        return fsspec.filesystem("http", get_client=self._client, skip_instance_cache=True), url

    async def _client(self, **kwargs):
        connector = aiohttp.TCPConnector(resolver=_Resolver(self), use_dns_cache=False)
        return aiohttp.ClientSession(connector=connector, middlewares=(self._checked,), trust_env=False, **kwargs)

    async def _checked(self, request, handler):
        """Every request, each redirect's included: an address in the URL is checked here (a
        name is checked as it resolves, ``_Resolver``)."""
        host = request.url.host or ""
        try:
            ipaddress.ip_address(host.split("%", 1)[0])
        except ValueError:
            return await handler(request)
        why = self.policy.refusal(host)
        if why:
            raise self._refuse(f"{request.url}: {why}")
        return await handler(request)


class _Resolver(AbstractResolver):
    """aiohttp's threaded resolver, less the addresses the policy refuses: aiohttp connects to
    what this returns, so what was checked is what is reached."""

    def __init__(self, fetcher: Fetcher, inner: AbstractResolver | None = None):
        self.fetcher, self.inner = fetcher, inner or ThreadedResolver()

    async def resolve(self, host: str, port: int = 0, family: socket.AddressFamily = socket.AF_INET):
        found = await self.inner.resolve(host, port, family)
        kept = [r for r in found if self.fetcher.policy.refusal(r["host"]) is None]
        if not kept:
            why = self.fetcher.policy.refusal(found[0]["host"]) if found else "no address"
            raise self.fetcher._refuse(f"{host} resolves to {', '.join(r['host'] for r in found)}: {why}")
        return kept

    async def close(self) -> None:
        await self.inner.close()


def unpack(archive: str, dest: str, bound: int, make_room, what: str) -> None:
    """The tar ``archive`` unpacked into ``dest``: every entry's header read first (regular files
    and folders only, inside ``dest``, at most ``MAX_MEMBERS``, their sizes at most ``bound``
    bytes together), then ``make_room(total)``, then the entries written."""
    with tarfile.open(archive, "r:*") as tar:
        members, total = [], 0
        for member in tar:
            if len(members) >= MAX_MEMBERS:
                raise DatasetTooLarge(f"{what} holds more than {MAX_MEMBERS} entries")
            if not (member.isreg() or member.isdir()):
                raise DatasetRefused(f"{what}: entry {member.name!r} is not a file or a folder (links, devices and "
                                     f"pipes are not unpacked)")
            try:
                member = tarfile.data_filter(member, dest)
            except tarfile.FilterError as exc:
                raise DatasetRefused(f"{what}: entry {member.name!r} is refused ({exc})") from None
            total += member.size if member.isreg() else 0
            if total > bound:
                raise DatasetTooLarge(f"{what} unpacks to more than {bound} bytes: more than this GPU client's "
                                      f"dataset cache holds (zwdx gpu-client --dataset-cache-bytes)")
            members.append(member)
        make_room(total)
        tar.extractall(dest, members=members, filter="data")
