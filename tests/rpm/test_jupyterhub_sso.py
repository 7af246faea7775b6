#!/usr/bin/env python3
"""Unit tests of the shipped JupyterHub SSO authenticator's decisions
(rpm/share/jupyterhub/gpuhub_jupyterhub_sso.py): whom the e-mail header is believed from, and
how an e-mail address maps to a Unix user. Run: python3 -m unittest tests/rpm/test_jupyterhub_sso.py
(tests/system/jupyterhub-sso.sh runs it)."""
import ipaddress
import os
import sys
import tempfile
import unittest
from types import SimpleNamespace

sys.dont_write_bytecode = True  # no __pycache__ in rpm/share (the RPM ships that directory whole)
sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), "../../rpm/share/jupyterhub"))
import gpuhub_jupyterhub_sso as sso  # noqa: E402

SECRET = b"0123456789abcdef0123456789abcdef"

# A password database of this test's own: the mapping's rules, not this machine's accounts.
USERS = {"alice": 1001, "jdoe": 1002, "root": 0, "daemon": 1}


def getpwnam(name):
    if name not in USERS:
        raise KeyError(name)
    return SimpleNamespace(pw_uid=USERS[name])


def mapped(email, table=None, domains=("example.org",)):
    return sso.map_email(email, table or {"John.Doe@Example.org": "jdoe", "boss@partner.com": "root"}, list(domains), 1000, getpwnam)


class Mapping(unittest.TestCase):
    def test_local_part_of_an_allowed_domain(self):
        self.assertEqual(mapped("alice@example.org"), ("alice", None))
        self.assertEqual(mapped("  ALICE@Example.ORG "), ("alice", None), "addresses are compared lower-cased")

    def test_the_table_wins(self):
        self.assertEqual(mapped("john.doe@example.org"), ("jdoe", None))

    def test_unmapped_addresses_are_refused_with_the_reason(self):
        user, why = mapped("mallory@elsewhere.net")
        self.assertIsNone(user)
        self.assertIn("mallory@elsewhere.net has no account on this hub", why)
        self.assertIn("GpuhubSSOAuthenticator.user_map", why)

    def test_a_domain_address_without_a_unix_user_is_refused(self):
        user, why = mapped("bob@example.org")
        self.assertIsNone(user)
        self.assertIn("maps to the Unix user `bob`, but there is no user `bob` on this node", why)

    def test_system_accounts_are_never_mapped(self):
        for email in ("root@example.org", "daemon@example.org", "boss@partner.com"):
            user, why = mapped(email)
            self.assertIsNone(user, email)
            self.assertIn("is a system account", why)

    def test_bad_addresses(self):
        for email in ("", "alice", "a@b@example.org", "al ice@example.org", "alice@example.org\nx", None):
            user, why = mapped(email)
            self.assertIsNone(user, repr(email))
        user, why = mapped("../etc@example.org")
        self.assertIsNone(user)
        self.assertIn("is not a Unix user name", why)

    def test_a_real_user_of_this_machine(self):
        # The real password database: root exists and is a system account.
        user, why = sso.map_email("root@example.org", {}, ["example.org"], 1000)
        self.assertIsNone(user)
        self.assertIn("`root` is a system account (uid 0 < 1000)", why)


class Proxy(unittest.TestCase):
    proxies = [ipaddress.ip_address("10.0.0.5"), ipaddress.ip_address("127.0.0.1")]
    want = sso.digest(SECRET)

    def refusal(self, forwarded_for, direct, secret):
        return sso.proxy_refusal(sso.peer_of(forwarded_for, direct), secret, self.proxies, self.want)

    def test_the_edge_with_its_secret_is_believed(self):
        self.assertIsNone(self.refusal("10.0.0.5", "127.0.0.1", SECRET))
        self.assertIsNone(self.refusal("203.0.113.9, ::ffff:10.0.0.5", "127.0.0.1", SECRET), "the last hop is CHP's own")
        self.assertIsNone(self.refusal(None, "127.0.0.1", SECRET))

    def test_a_loopback_peer_without_the_secret_is_refused(self):
        why = self.refusal("127.0.0.1", "127.0.0.1", None)
        self.assertIn("without the single sign-on proxy's proof", why)
        self.assertIn("without", self.refusal("127.0.0.1", "127.0.0.1", b"wrong-secret-wrong-secret"))

    def test_an_untrusted_peer_is_refused_even_with_the_secret(self):
        why = self.refusal("10.0.0.6", "127.0.0.1", SECRET)
        self.assertIn("did not come through the site's single sign-on proxy (it came from 10.0.0.6)", why)
        # A client's own X-Forwarded-For entry does not help: CHP appends the real peer.
        self.assertIn("10.0.0.6", self.refusal("10.0.0.5, 10.0.0.6", "127.0.0.1", SECRET))
        self.assertIn("unknown address", self.refusal("not-an-ip", "127.0.0.1", SECRET))

    def test_settings_are_checked(self):
        with self.assertRaisesRegex(sso.SsoConfigError, "trusted_proxies is empty"):
            sso.parse_proxies([])
        with self.assertRaisesRegex(sso.SsoConfigError, "`edge` is not an IP address"):
            sso.parse_proxies(["edge"])
        self.assertEqual(sso.parse_proxies(["::ffff:10.0.0.5"]), [ipaddress.ip_address("10.0.0.5")])
        with tempfile.TemporaryDirectory() as d:
            p = os.path.join(d, "secret")
            with self.assertRaisesRegex(sso.SsoConfigError, "openssl rand"):
                sso.read_secret_file(p)
            with open(p, "wb") as f:
                f.write(SECRET + b"\n")
            os.chmod(p, 0o644)
            with self.assertRaisesRegex(sso.SsoConfigError, "chmod 600"):
                sso.read_secret_file(p)
            os.chmod(p, 0o600)
            self.assertEqual(sso.read_secret_file(p), SECRET)
            with open(p, "wb") as f:
                f.write(b"short")
            with self.assertRaisesRegex(sso.SsoConfigError, "at least 16 bytes"):
                sso.read_secret_file(p)


if __name__ == "__main__":
    unittest.main()
