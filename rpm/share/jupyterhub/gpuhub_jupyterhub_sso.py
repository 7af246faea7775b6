"""JupyterHub sign-in from the site's edge proxy (SSO): the edge has authenticated the user and
sends their e-mail address in a header; this authenticator believes it only when the edge
proves itself, and maps the address to a Unix user of this node (the notebook then runs as
that user's Slurm job, billed to them).

Shipped by gpuhub in /usr/share/gpuhub/jupyterhub/ (jupyterhub_config.py there loads it).

Why the header is not believed from an address alone: JupyterHub sits behind
configurable-http-proxy (CHP), and every user on the node can connect to CHP's port, or to the
hub's own port, from 127.0.0.1 and send any header, including `X-Forwarded-For`. So, as for
the gpuhub gateway's SSO (docs/security.md), an address on this node proves nothing; and since
a local user can reach the hub's port directly, even another machine's address in
`X-Forwarded-For` is only a claim. The proof is a shared secret the edge sends in
`secret_header` (compared as SHA-256 digests in constant time), read from a root-only file at
start; and the peer as CHP saw it (the last `X-Forwarded-For` entry, which CHP appends) must be
one of `trusted_proxies` as well. The edge must send the secret only on `/hub/` paths:
requests under `/user/NAME/` reach that user's own notebook server, which could read it.

Mapping (the e-mail address, lower-cased):
  1. `user_map`: an explicit table, e-mail -> Unix user (wins);
  2. else `local_part_domains`: an address in one of these domains maps to its local part
     (`alice@example.org` -> `alice`).
The Unix user must exist on this node with a uid of at least `min_uid` (no `root@...`).
Anything else is refused with a page that says why and whom to ask.

The decisions are plain functions (`proxy_refusal`, `map_email`) so they are tested without a
hub (tests/rpm/test_jupyterhub_sso.py); the Authenticator class needs JupyterHub.
"""

import hashlib
import hmac
import ipaddress
import os
import pwd
import re
import stat

# A Unix login name this authenticator maps to (the portable subset useradd accepts).
UNIX_NAME = re.compile(r"^[a-z_][a-z0-9_.-]{0,31}$")
# An e-mail address: one @, a non-empty local part and a dotted domain, no spaces or controls.
EMAIL = re.compile(r"^[^@\s\x00-\x1f\x7f]{1,64}@[a-z0-9.-]{1,253}$")
# The secret file is read at most this big.
MAX_SECRET_FILE = 4096


class SsoConfigError(Exception):
    """The authenticator's settings cannot work; the message names the setting and the fix."""


def digest(value):
    return hashlib.sha256(value).digest()


def read_secret_file(path):
    """The secret in `path` (whitespace stripped), checked like the gateway's: a regular file,
    not readable by group or others, at least 16 bytes."""
    try:
        st = os.stat(path)
    except OSError as e:
        raise SsoConfigError(f"GpuhubSSOAuthenticator.shared_secret_file {path}: {e.strerror}; create it: "
                             f"(umask 077; openssl rand -hex 32 > {path})") from e
    if not stat.S_ISREG(st.st_mode):
        raise SsoConfigError(f"GpuhubSSOAuthenticator.shared_secret_file {path}: not a regular file")
    if st.st_mode & 0o077:
        raise SsoConfigError(f"GpuhubSSOAuthenticator.shared_secret_file {path}: mode {stat.S_IMODE(st.st_mode):04o} lets other "
                             f"users read it (and sign in as anyone); chmod 600 {path}")
    with open(path, "rb") as f:
        secret = f.read(MAX_SECRET_FILE + 1)
    if len(secret) > MAX_SECRET_FILE:
        raise SsoConfigError(f"GpuhubSSOAuthenticator.shared_secret_file {path}: larger than {MAX_SECRET_FILE} bytes")
    secret = secret.strip()
    if len(secret) < 16:
        raise SsoConfigError(f"GpuhubSSOAuthenticator.shared_secret_file {path}: the secret must be at least 16 bytes; "
                             f"(umask 077; openssl rand -hex 32 > {path})")
    return secret


def parse_proxies(proxies):
    """`trusted_proxies` as addresses; at least one, each an IP address."""
    if not proxies:
        raise SsoConfigError("GpuhubSSOAuthenticator.trusted_proxies is empty: list the edge proxy's address as "
                             "configurable-http-proxy sees it (e.g. [\"10.0.0.5\"], or [\"127.0.0.1\"] for an edge on this node)")
    out = []
    for p in proxies:
        try:
            out.append(canonical(ipaddress.ip_address(str(p).strip())))
        except ValueError as e:
            raise SsoConfigError(f"GpuhubSSOAuthenticator.trusted_proxies: `{p}` is not an IP address") from e
    return out


def canonical(ip):
    """An IPv4-mapped IPv6 address as IPv4 (CHP reports `::ffff:10.0.0.5`)."""
    if isinstance(ip, ipaddress.IPv6Address) and ip.ipv4_mapped is not None:
        return ip.ipv4_mapped
    return ip


def peer_of(forwarded_for, direct):
    """The peer as configurable-http-proxy saw it: the last `X-Forwarded-For` entry (CHP
    appends it), else the direct peer. None if it is not an address."""
    candidate = forwarded_for.split(",")[-1].strip() if forwarded_for else (direct or "")
    try:
        return canonical(ipaddress.ip_address(candidate))
    except ValueError:
        return None


def proxy_refusal(peer, sent_secret, proxies, secret_digest):
    """Why the call's e-mail header is not believed (a sentence for the refusal page), or None
    when the edge proved itself: peer in `proxies` and the right secret."""
    if peer is None or peer not in proxies:
        return (f"this sign-in did not come through the site's single sign-on proxy (it came from {peer or 'an unknown address'}); "
                "open the hub through the site's address")
    if sent_secret is None or not hmac.compare_digest(digest(sent_secret), secret_digest):
        return ("this sign-in came without the single sign-on proxy's proof (the shared secret); "
                "open the hub through the site's address, or ask the admins to check the proxy's configuration")
    return None


def local_user(name, min_uid, getpwnam=pwd.getpwnam):
    """(uid, None) if `name` is a login on this node with uid >= min_uid, else (None, why)."""
    if not UNIX_NAME.match(name):
        return None, f"`{name}` is not a Unix user name"
    try:
        uid = getpwnam(name).pw_uid
    except KeyError:
        return None, f"there is no user `{name}` on this node"
    if uid < min_uid:
        return None, f"`{name}` is a system account (uid {uid} < {min_uid})"
    return uid, None


def map_email(email, user_map, local_part_domains, min_uid=1000, getpwnam=pwd.getpwnam):
    """(unix_user, None) for a mapped e-mail address, or (None, why) with a sentence for the
    refusal page. `user_map`: e-mail -> user (keys compared lower-cased); `local_part_domains`:
    domains whose addresses map to their local part."""
    email = (email or "").strip().lower()
    if not email or not EMAIL.match(email):
        return None, "the single sign-on proxy sent no usable e-mail address"
    table = {str(k).strip().lower(): str(v) for k, v in (user_map or {}).items()}
    if email in table:
        user = table[email]
        how = f"user_map maps {email} to `{user}`, but"
    else:
        local, _, domain = email.partition("@")
        if domain not in {d.strip().lower().lstrip("@") for d in (local_part_domains or [])}:
            return None, (f"{email} has no account on this hub: it is not in the hub's user table and {domain} is not one of the "
                          "domains whose addresses map to a Unix user; ask the admins to map it (GpuhubSSOAuthenticator.user_map)")
        user = local
        how = f"{email} maps to the Unix user `{user}`, but"
    _, why = local_user(user, min_uid, getpwnam)
    if why:
        return None, f"{how} {why}; ask the admins to map it (GpuhubSSOAuthenticator.user_map)"
    return user, None


try:  # The Authenticator needs JupyterHub; the functions above do not.
    from jupyterhub.auth import Authenticator
    from jupyterhub.handlers import BaseHandler
    from tornado import web
    from traitlets import Dict, Integer, List, Unicode
except ImportError:  # pragma: no cover (imported without JupyterHub: the tests of the functions)
    Authenticator = None

if Authenticator is not None:

    class GpuhubSSOLoginHandler(BaseHandler):
        """`/hub/login`: signs in from the edge's header; no form of its own."""

        async def get(self):
            user = await self.login_user()
            if user is None:  # authenticate() raises with the reason; this is a safety net
                raise web.HTTPError(403, "single sign-on refused this sign-in; ask the admins")
            self.redirect(self.get_next_url(user))

    class GpuhubSSOAuthenticator(Authenticator):
        """Signs users in from the edge's authenticated e-mail header (see the module's doc)."""

        email_header = Unicode("X-Auth-Request-Email", config=True, help="The header in which the edge sends the e-mail address.")
        secret_header = Unicode("X-Gpuhub-Proxy-Secret", config=True, help="The header in which the edge sends the shared secret.")
        shared_secret_file = Unicode("", config=True, help="Root-only file (0600) with the shared secret (at least 16 bytes).")
        trusted_proxies = List(Unicode(), config=True, help="The edge's addresses as configurable-http-proxy sees them.")
        user_map = Dict(config=True, help="E-mail address -> Unix user (wins over local_part_domains).")
        local_part_domains = List(Unicode(), config=True, help="Domains whose addresses map to their local part.")
        min_uid = Integer(1000, config=True, help="Lowest uid a sign-in may map to (no system accounts).")

        def __init__(self, **kwargs):
            super().__init__(**kwargs)
            if not self.shared_secret_file:
                raise SsoConfigError("GpuhubSSOAuthenticator.shared_secret_file is not set: the edge proves itself with a shared "
                                     "secret (an address alone proves nothing on this node); create one with "
                                     "(umask 077; openssl rand -hex 32 > /etc/jupyterhub/sso-secret) and set it")
            self._secret = digest(read_secret_file(self.shared_secret_file))
            self._proxies = parse_proxies(self.trusted_proxies)

        def get_handlers(self, app):
            return [(r"/login", GpuhubSSOLoginHandler)]

        def check_allowed(self, username, authentication=None):
            # The mapping is the allow-list: only mapped users get this far.
            return True

        async def authenticate(self, handler, data=None):
            headers = handler.request.headers
            context = handler.request.connection.context
            direct = getattr(context, "_orig_remote_ip", None) or handler.request.remote_ip
            peer = peer_of(headers.get("X-Forwarded-For"), direct)
            secret = headers.get(self.secret_header)
            why = proxy_refusal(peer, secret.encode() if secret is not None else None, self._proxies, self._secret)
            if why:
                self.log.warning("SSO sign-in refused: peer %s not proven (%s)", peer, "address" if peer not in self._proxies else "secret")
                raise web.HTTPError(403, why)
            email = headers.get(self.email_header, "")
            user, why = map_email(email, self.user_map, self.local_part_domains, self.min_uid)
            if why:
                self.log.warning("SSO sign-in refused for %r: %s", email[:128], why)
                raise web.HTTPError(403, why)
            self.log.info("SSO sign-in: %s -> %s", email.strip().lower(), user)
            return {"name": user, "auth_state": None}
